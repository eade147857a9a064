"""The metrics ``DOSMonitor`` logs that a summary shows: one table of labels, units and scales.

Read by the monitor's end-of-run summary (:func:`~lightning_dos.integration.callbacks.monitor.summary_table`) and
by ``lightning-dos report``'s medians panel, so that the two name and scale a metric alike. Importing it imports
neither Lightning nor torch (the report command does not need them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The prefix of every metric the monitor logs.
PREFIX = "dos/"
#: Bytes per GB in every metric (decimal, as bus rates are quoted).
GB = 1e9


@dataclass(frozen=True)
class Metric:
    """One logged metric as a summary shows it.

    Args:
        key: its name without :data:`PREFIX` (``update_s``).
        label: what a summary row calls it.
        unit: the unit shown after the value (``s``, ``GB/s``, ``%``, ``GB``).
        scale: what the logged value is multiplied by for display (100 for a fraction shown in %).
        device: measures the accelerator's side (a bus, the device's share): a run without an accelerator
            leaves it out where it is zero throughout, as it would read as a measurement of one.
    """

    key: str
    label: str
    unit: str
    scale: float = 1.0
    device: bool = False

    @property
    def name(self) -> str:
        """The logged name, with :data:`PREFIX`."""
        return PREFIX + self.key


#: Every metric a summary can show, by key, in the order summaries list them.
METRICS = {
    m.key: m
    for m in (
        Metric("forward_s", "forward", "s"),
        Metric("backward_s", "backward", "s"),
        Metric("update_s", "update", "s"),
        Metric("update_predicted_s", "update predicted", "s"),
        Metric("step_s", "step", "s"),
        Metric("iteration_predicted_s", "step predicted", "s"),
        Metric("engine_update_s", "engine update loop", "s"),
        Metric("engine_update_predicted_s", "engine update predicted", "s"),
        Metric("h2d_gbps", "host to device", "GB/s", device=True),
        Metric("d2h_gbps", "device to host", "GB/s", device=True),
        Metric("pcie_util", "PCIe utilisation", "%", 100.0, device=True),
        Metric("gpu_fraction", "device share", "%", 100.0, device=True),
        Metric("mem_peak_update_gb", "peak memory, update", "GB"),
        Metric("pinned_gb", "pinned host memory", "GB"),
        Metric("speculated", "sub-groups speculated", ""),
        Metric("commit_rate", "speculation committed", "%", 100.0),
    )
}

#: The monitor's end-of-run summary (per step; shares of the step's time for the phases).
SUMMARY = tuple(
    METRICS[k]
    for k in (
        "forward_s", "backward_s", "update_s", "update_predicted_s", "step_s", "iteration_predicted_s",
        "engine_update_s", "engine_update_predicted_s", "h2d_gbps", "d2h_gbps", "pcie_util", "gpu_fraction",
        "mem_peak_update_gb",
    )
)  # fmt: skip
#: ``lightning-dos report``'s medians panel.
MEDIANS = tuple(
    METRICS[k]
    for k in (
        "forward_s", "backward_s", "update_s", "update_predicted_s", "step_s", "engine_update_s",
        "engine_update_predicted_s", "h2d_gbps", "d2h_gbps", "pcie_util", "gpu_fraction", "pinned_gb",
    )
)  # fmt: skip


def engine_peak(engine: Any) -> tuple[float, float] | None:
    """The engine's calibrated peak H2D and D2H rates (bytes/s), when it offers them and has measured them."""
    peak = getattr(engine, "peak_bandwidth", None)
    measured = peak() if callable(peak) else None
    if measured is not None and all(math.isfinite(v) and v > 0 for v in measured):
        return float(measured[0]), float(measured[1])
    return None


def step_metrics(
    report: Any, seconds: float, peak_bps: float = 0.0, commits: list[int] | None = None
) -> dict[str, float]:
    """One optimizer step's metrics from the engine's report (a :class:`~lightning_dos.model.step_report.StepReport`),
    as the monitor logs them and Fabric's strategy returns them (``last_step_metrics``).

    Args:
        report: the step's report.
        seconds: the time the rates are over (the engine's update loop, where the transfers happen).
        peak_bps: the bus's peak, both directions together, in bytes/s (0: no ``pcie_util``).
        commits: speculative steps so far whose updates were redone and kept (``[redone, kept]``), for
            ``commit_rate`` (None: not given).
    """
    row = {
        "dos/h2d_gb": report.h2d_bytes / GB,
        "dos/d2h_gb": report.d2h_bytes / GB,
        "dos/gpu_fraction": report.device_share,
        "dos/pinned_gb": report.pinned_bytes / GB,
        "dos/engine_update_s": report.update_s,
        "dos/fallback_subgroups": float(len(report.fallback_host)),
        "dos/speculated": float(report.speculated),
    }
    if report.committed is not None:
        row["dos/committed"] = float(report.committed)
        if report.committed:
            row["dos/commit_s"] = report.commit_s
    if commits is not None and any(commits):
        row["dos/commit_rate"] = commits[True] / sum(commits)
    if seconds > 0:
        row["dos/h2d_gbps"] = report.h2d_bytes / seconds / GB
        row["dos/d2h_gbps"] = report.d2h_bytes / seconds / GB
        if peak_bps > 0:
            row["dos/pcie_util"] = (report.h2d_bytes + report.d2h_bytes) / seconds / peak_bps
    if report.predicted_s is not None and math.isfinite(report.predicted_s):
        row["dos/engine_update_predicted_s"] = float(report.predicted_s)
    if report.predicted_iteration_s is not None:
        row["dos/iteration_predicted_s"] = float(report.predicted_iteration_s)
    return row
