"""The device memory an update may use, and the plan fitted within it.

The engine's planner (the ratio scheduler) and the framework tell a :class:`DeviceBudget` what they measure: the
calibrated rates, whether the update overlaps the next forward, the device peak of the last forward and backward.
The step asks it, once the update begins, how much device memory it may use, and fits its plan within that.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dos.engine.streams import Streams
from lightning_dos.model.budget_fit import fit_to_budget, plan_device_bytes
from lightning_dos.model.perfmodel import FREE_MEMORY_MARGIN
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import Footprint


class DeviceBudget:
    """What the update may hold on the device.

    Args:
        sizes: the sub-groups' element counts.
        footprint: bytes per element held and moved.
        lp_bytes: bytes of one 16-bit (or fp32) model parameter.
        lp_downloads: device sub-groups' 16-bit results come down to host memory (each needs a device slot).
        streams: the engine's streams (they say what device memory is free).
        gpu_memory_budget: an explicit budget in bytes (the engine's argument of that name); None: what is free.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        footprint: Footprint,
        lp_bytes: int,
        lp_downloads: bool,
        streams: Streams,
        gpu_memory_budget: int | None,
    ) -> None:
        self.sizes, self.footprint, self.lp_bytes, self.lp_downloads = tuple(sizes), footprint, lp_bytes, lp_downloads
        self.streams = streams
        self.gpu_memory_budget = gpu_memory_budget
        #: The update overlaps the next forward (the framework's ``overlap`` is on): with no ``gpu_memory_budget`` its
        #: staging is sized within what was spare at the forward/backward peak too (:meth:`device_budget`).
        self.overlapping = False
        #: The most device bytes held at once during the last forward and backward (``max_memory_allocated`` over
        #: them); None until the framework measures it.
        self.forward_backward_peak: int | None = None
        #: This machine's calibrated rates (a ``HardwareRates``), once the scheduler has measured them.
        self.rates = None

    def use_rates(self, rates: object) -> None:
        """The scheduler measured this machine's rates (a ``HardwareRates``): plans are fitted with them."""
        self.rates = rates

    def overlap_forward(self, overlapping: bool) -> None:
        """Whether the update overlaps the next forward (its staging then also fits what the forward leaves)."""
        self.overlapping = overlapping

    def record_forward_backward_peak(self, peak: int | None) -> None:
        """The most device bytes held at once during the last forward and backward."""
        self.forward_backward_peak = peak

    def limit(self, gpu_memory_budget: int | None) -> None:
        """Hold the update within ``gpu_memory_budget`` bytes of device memory (None: what is free when it begins)."""
        self.gpu_memory_budget = gpu_memory_budget

    def peak_bandwidth(self) -> tuple[float, float] | None:
        """Calibrated peak (host-to-device, device-to-host) bytes/s, once the scheduler has measured them."""
        rates = self.rates
        return (rates.h2d_bps, rates.d2h_bps) if rates is not None else None

    def device_budget(self) -> int | None:
        """Bytes the update may use on the device now; None means no limit (a CPU device).

        An explicit ``gpu_memory_budget``, or else the memory free now (the activations backward just freed, and
        what the caching allocator holds unused, count as free) less :data:`FREE_MEMORY_MARGIN`. When the update
        overlaps the next forward (:attr:`overlapping`), its staging may still be allocated while that forward's
        activations grow, so it also stays within what was spare at the last forward/backward peak
        (:attr:`forward_backward_peak`), less the same margin."""
        if self.gpu_memory_budget is not None:
            return self.gpu_memory_budget
        memory = self.streams.device_memory()
        if memory is None:
            return None
        free, capacity = memory
        if self.overlapping and self.forward_backward_peak is not None:
            free = min(free, capacity - self.forward_backward_peak)
        return int(max(0, free) * (1.0 - FREE_MEMORY_MARGIN))

    def device_bytes(self, plan: Plan, buffers: int) -> int:
        """Device memory ``plan`` needs during the update with ``buffers`` staging buffers
        (:func:`~lightning_dos.model.budget_fit.plan_device_bytes`)."""
        return plan_device_bytes(self.sizes, plan, buffers, self.footprint, self.lp_bytes if self.lp_downloads else 0)

    def fit_to_budget(self, plan: Plan, budget: int | None) -> Plan:
        """``plan`` shrunk until it fits ``budget`` (:func:`~lightning_dos.model.budget_fit.fit_to_budget`, with the
        calibrated rates once the scheduler has them)."""
        return fit_to_budget(
            self.sizes, plan, budget, footprint=self.footprint, lp_bytes=self.lp_bytes,
            lp_downloads=self.lp_downloads, rates=self.rates,
        )  # fmt: skip
