"""Whether to speculate: the commit rate observed so far, and a stop for runs whose every step is clipped.

A speculative update (:mod:`lightning_dos.engine.speculation`) costs a copy of each speculated sub-group's state
during backward, and, when the step turns out clipped, a restore and a second update after backward: on a run
that clips every step it only adds work. :class:`CommitPolicy` counts the outcomes and stops speculating after
:data:`STOP_AFTER` redone steps in a row (said once), then tries one step every :data:`RETRY_EVERY` steps: runs
typically clip through warm-up and rarely after it.
"""

from __future__ import annotations

from collections.abc import Callable

#: Redone (clipped) speculative steps in a row after which speculation stops.
STOP_AFTER = 8
#: While stopped, one step in this many speculates again, to notice that the run stopped clipping.
RETRY_EVERY = 50


class CommitPolicy:
    """The running commit rate of speculative steps, and whether the next step speculates.

    Args:
        say: called once with a line for the user when speculation stops.
    """

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.say = say
        #: Steps whose updates were speculated, and those of them committed.
        self.speculated_steps = 0
        self.committed_steps = 0
        self._redone_in_a_row = 0
        self._stopped_at: int | None = None
        self._last_seen = 0
        self._said = False

    @property
    def rate(self) -> float | None:
        """Committed speculative steps over speculative steps (None before the first)."""
        return self.committed_steps / self.speculated_steps if self.speculated_steps else None

    @property
    def expected_rate(self) -> float:
        """The commit rate to plan for: 0 while speculation is stopped, else the rate so far (1 before the first
        speculative step: after warm-up most steps are not clipped)."""
        if self._stopped_at is not None:
            return 0.0
        return 1.0 if self.rate is None else self.rate

    def observe(self, step: int, committed: bool | None) -> None:
        """Step ``step``'s outcome: ``committed`` True or False when it speculated, None when it did not. Each step
        counts once, however often it is observed."""
        if step <= self._last_seen or committed is None:
            return
        self._last_seen = step
        self.speculated_steps += 1
        if committed:
            self.committed_steps += 1
            self._redone_in_a_row = 0
            self._stopped_at = None
            return
        self._redone_in_a_row += 1
        if self._redone_in_a_row >= STOP_AFTER and self._stopped_at is None:
            self._stopped_at = step
            if self.say is not None and not self._said:
                self._said = True
                self.say(  # each line fits 80 columns after Lightning's "INFO: " prefix
                    f"lightning-dos: the last {STOP_AFTER} steps were all clipped, so overlap='auto' stops\n"
                    "beginning the update during backward (each speculative update was redone);\n"
                    f"it still overlaps the next forward, and tries again every {RETRY_EVERY} steps"
                )

    def speculates(self, step: int) -> bool:
        """Whether step ``step`` begins its update during backward."""
        return self._stopped_at is None or (step - self._stopped_at) % RETRY_EVERY == 0
