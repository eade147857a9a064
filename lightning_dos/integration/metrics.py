"""The metrics ``DOSMonitor`` logs that a summary shows: one table of labels, units and scales.

Read by the monitor's end-of-run summary (:func:`~lightning_dos.integration.callbacks.monitor.summary_table`) and
by ``lightning-dos report``'s medians panel, so that the two name and scale a metric alike. Importing it imports
neither Lightning nor torch (the report command does not need them).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The prefix of every metric the monitor logs.
PREFIX = "dos/"


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
