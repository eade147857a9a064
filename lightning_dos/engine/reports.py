"""The engine's step reports: the last one, and the recent ones by number.

An overlapped update issues its report after the step returned, so a monitor fetches it by number
(:meth:`ReportLog.number`) once the update has landed.
"""

from __future__ import annotations

from collections import deque

from lightning_dos.model.step_report import StepReport


class ReportLog:
    """The reports the engine has issued: how many, the last, and the few most recent."""

    def __init__(self, keep: int = 8) -> None:
        self.issued = 0
        self.last: StepReport | None = None
        self._recent: deque[StepReport] = deque(maxlen=keep)

    def issue(self, report: StepReport) -> StepReport:
        """Record ``report`` as the engine's latest; return it."""
        self.last = report
        self.issued += 1
        self._recent.append(report)
        return report

    def number(self, number: int) -> StepReport | None:
        """The ``number``-th report issued (1-based), while it is among the recent ones; None before it is issued."""
        back = self.issued - number
        return self._recent[-1 - back] if 0 <= back < len(self._recent) else None
