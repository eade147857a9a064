"""The performance model: predicts the update phase of a plan (:mod:`lightning_dos.model.plan_search` chooses the
plan that minimises it).

It mirrors what the engine does (:mod:`lightning_dos.engine.loop`), per rank:

- host sub-group of n elements: CPU update and cast (``n / host_adam_eps + n / host_cast_eps``), then an
  upload of ``lp_bytes * n`` on its own stream;
- streamed sub-group: upload master weights, states and gradient, device update, download master weights and
  states, through ``device_buffers`` staging slots (a slot is reused once its download is done);
- resident sub-group: upload its gradient and update on the device; master weights, states and gradient held
  in device memory all the time.

The bytes per element come from a :class:`~lightning_dos.model.update_rules.Footprint` (the optimizer's rule
and its dtypes; every function takes one as ``footprint``, Adam with fp32 state by default: 16 bytes up and 12
down per streamed element, 4 up per resident one, 16 on the device). The update rates of a
:class:`HardwareRates` are those of Adam with fp32 state (what profiles hold, and calibration reports); the
update is memory-bound, so another rule's or dtype's throughput is that one scaled by the bytes each element
touches (:func:`rates_for`). A calibration of the engine's own rule converts its measurement to that unit
and back, so for the rule measured the model uses exactly the measured rate.

Device work is queued first and runs while the CPU works through the host sub-groups; the update ends when
the last of them finishes. When the plan streams, both PCIe directions are busy at once and each runs at its
duplex rate; the link as a whole needs at least its bytes' worth of time, at the duplex rates while both
directions have bytes left and the solo rate after (:func:`link_seconds`). On a CPU "device" (no accelerator)
host and device work share the same cores, so they add up.

Contention: while a plan has host sub-groups, the host update runs beside the copies and both share the host's
memory bandwidth, so every copy runs at ``overlap_copy_speed`` of its rate for the whole phase (the plans worth
running balance the two, which then run side by side nearly to the end); the host rates are measured with copies
running. Where the training thread runs beside the update (``overlap``), the update runs at ``overlap_host_speed``
of its rate and the training thread at ``overlap_launch_speed`` of its own (:func:`overlapped`,
:func:`beside_update_s`). All three are 1.0 (nothing charged) in profiles that do not measure them.

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import ADAM_FP32, Footprint


@dataclass(frozen=True)
class HardwareRates:
    """What one rank's hardware does per second.

    Attributes:
        host_adam_eps: host Adam throughput (fp32 master weights and moments), elements/s (with the threads this
            rank gets); other rules and dtypes are scaled from it (:func:`rates_for`).
        host_cast_eps: host fp32 -> 16-bit cast throughput, elements/s.
        device_adam_eps: device Adam throughput (fp32 state), elements/s; 0 means there is no accelerator.
        h2d_bps: pinned host-to-device bandwidth alone, bytes/s.
        d2h_bps: pinned device-to-host bandwidth alone, bytes/s.
        duplex_h2d_bps: host-to-device bandwidth while device-to-host runs too, bytes/s.
        duplex_d2h_bps: device-to-host bandwidth while host-to-device runs too, bytes/s.
        shared_cpu: True when the "device" is the CPU itself, so host and device work do not overlap.
        overlap_copy_speed: the copies' rate while the host update runs beside them, as a share of their rates
            above (1.0: not slowed, the default for profiles measured before it was). They share the host's memory
            bandwidth: the update streams 28 bytes per element and the write-allocate, the DMA reads and writes
            pinned memory. Calibration measures pinned copies both ways at once on CUDA; on a CPU "device", which
            has no DMA copies, a host memcpy of the same size (what the engine's transfers are there).
            :func:`overlapped` charges it wherever host update and copies run at once.
        overlap_host_speed: the host update's rate while the training thread runs beside it (the next forward or
            backward, with ``overlap`` on), as a share of ``host_adam_eps`` and ``host_cast_eps`` (which are
            measured, on CUDA, while copies run both ways). 1.0: not slowed.
        overlap_launch_speed: the training thread's rate beside the host update, as a share of its rate alone:
            measured on a loop of launch-bound work (on a GPU tiny kernel launches, on a CPU small torch ops),
            which is what ZeRO-3's forward and backward are at the sizes offload trains, bound by its Python
            hooks. 1.0: not slowed. :func:`beside_update_s` charges it.
    """

    host_adam_eps: float
    host_cast_eps: float
    device_adam_eps: float
    h2d_bps: float
    d2h_bps: float
    duplex_h2d_bps: float
    duplex_d2h_bps: float
    shared_cpu: bool = False
    overlap_copy_speed: float = 1.0
    overlap_host_speed: float = 1.0
    overlap_launch_speed: float = 1.0

    def to_dict(self) -> dict[str, float | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HardwareRates:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown hardware rate(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**{k: (bool(v) if k == "shared_cpu" else float(v)) for k, v in data.items()})

    def scaled(self, factor: float) -> HardwareRates:
        """Every rate times ``factor`` (a machine that is uniformly slower or faster; the shares of
        :data:`OVERLAP_SPEEDS`, ratios of rates, stay as they are)."""
        kept = ("shared_cpu", *OVERLAP_SPEEDS)
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.name not in kept})

    @property
    def host_s_per_element(self) -> float:
        """CPU seconds one element's host update takes: the update rule, then the cast to 16 bits."""
        return 1.0 / self.host_adam_eps + 1.0 / self.host_cast_eps


#: The :class:`HardwareRates` fields that are shares of another rate under contention, not rates.
OVERLAP_SPEEDS = ("overlap_copy_speed", "overlap_host_speed", "overlap_launch_speed")


def overlapped(rates: HardwareRates, *, beside_training: bool = False) -> HardwareRates:
    """The rates a phase runs at in which the host update and the copies run at once: every copy rate (alone and
    duplex, both ways) times ``overlap_copy_speed`` and, ``beside_training`` (the training thread's forward or
    backward runs too, as under ``overlap``), the host update's rates times ``overlap_host_speed``.

    The shares applied are set to 1.0 in what is returned, so rates passed through twice are charged once. On a
    CPU "device" (``shared_cpu``) the copies are the CPU's own work, added to the host's rather than beside it:
    only the training thread's share applies there."""
    copy = 1.0 if rates.shared_cpu else rates.overlap_copy_speed
    host = rates.overlap_host_speed if beside_training else 1.0
    return replace(
        rates,
        host_adam_eps=rates.host_adam_eps * host,
        host_cast_eps=rates.host_cast_eps * host,
        h2d_bps=rates.h2d_bps * copy,
        d2h_bps=rates.d2h_bps * copy,
        duplex_h2d_bps=rates.duplex_h2d_bps * copy,
        duplex_d2h_bps=rates.duplex_d2h_bps * copy,
        overlap_copy_speed=1.0 if not rates.shared_cpu else rates.overlap_copy_speed,
        overlap_host_speed=1.0 if beside_training else rates.overlap_host_speed,
    )


def beside_update_s(seconds: float, rates: HardwareRates) -> float:
    """How long training-thread work (forward, backward) that takes ``seconds`` alone takes beside the host update:
    slowed to ``overlap_launch_speed`` (its launches and ZeRO-3's hooks share the cores with the update's threads)."""
    return seconds / rates.overlap_launch_speed


@dataclass(frozen=True)
class Prediction:
    """The model's account of one update phase.

    Attributes:
        time_s: predicted update time, fill and drain included.
        peak_device_bytes: device memory the plan needs (resident state plus staging buffers).
        h2d_bytes: bytes uploaded.
        d2h_bytes: bytes downloaded.
        host_s: time the CPU is busy.
        device_s: time the device pipeline takes, transfers included.
    """

    time_s: float
    peak_device_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    host_s: float
    device_s: float


def update_bytes(footprint: Footprint) -> int:
    """Bytes one element of the update touches in memory: the gradient read, the master weights and every
    state tensor read and written (28 for Adam with fp32 state; the 16-bit cast is counted apart)."""
    return footprint.master + 2 * footprint.optimizer_state


def rates_for(rates: HardwareRates, footprint: Footprint = ADAM_FP32) -> HardwareRates:
    """``rates`` with the host and device update throughputs of ``footprint``'s rule and dtypes.

    The update streams its operands from memory (host slabs far beyond any cache; device Adam is bandwidth
    bound too), so its time per element is taken proportional to :func:`update_bytes`: Lion or Adagrad with
    fp32 state (20 bytes) run at 1.4x Adam's elements/s, Adam with bf16 master weights and states (14 bytes) at
    2x. An approximation for a rule other than the one calibrated: :func:`adam_equivalent` makes a measured
    rule's own rate come back exactly.
    """
    if footprint == ADAM_FP32:
        return rates
    factor = update_bytes(ADAM_FP32) / update_bytes(footprint)
    return replace(rates, host_adam_eps=rates.host_adam_eps * factor, device_adam_eps=rates.device_adam_eps * factor)


def adam_equivalent(rates: HardwareRates, footprint: Footprint = ADAM_FP32) -> HardwareRates:
    """The inverse of :func:`rates_for`: rates whose update throughputs were measured for ``footprint``, in the
    unit :class:`HardwareRates` keeps them (Adam with fp32 state)."""
    if footprint == ADAM_FP32:
        return rates
    factor = update_bytes(footprint) / update_bytes(ADAM_FP32)
    return replace(rates, host_adam_eps=rates.host_adam_eps * factor, device_adam_eps=rates.device_adam_eps * factor)


def device_bytes(sizes: Sequence[int], plan: Plan, *, footprint: Footprint = ADAM_FP32, lp_slot: int = 0) -> int:
    """Device memory ``plan`` needs during the update, as the engine allocates it: ``footprint.device`` bytes per
    element of every resident sub-group and staging buffer (and ``lp_slot`` more for the 16-bit cast's slot, when
    the 16-bit parameters live on the host), plus the update's temporaries (``footprint.temporaries``) for its
    largest device sub-group: the kernels run one at a time on the engine's compute stream, so one sub-group's
    temporaries are allocated at once, whatever the number of buffers."""
    streamed = [sizes[i] for i in plan.streamed_indices]
    resident = [sizes[i] for i in plan.resident_indices]
    buffers = min(plan.device_buffers, len(streamed))
    stored = (footprint.device + lp_slot) * (sum(resident) + buffers * max(streamed, default=0))
    return stored + footprint.temporaries * max(streamed + resident, default=0)


def link_seconds(h2d_bytes: float, d2h_bytes: float, rates: HardwareRates) -> float:
    """Least time the link needs to carry these bytes: both directions at their duplex rates while both have
    bytes left, then the rest at the solo rate of the direction that still has some.

    (Charging every byte at the duplex rate, as this model once did, overstates plans whose uploads outlast
    their downloads by up to 15%: the replay of the engine's schedule on a virtual node showed it.)"""
    if d2h_bytes <= 0:
        return h2d_bytes / rates.h2d_bps
    if h2d_bytes <= 0:
        return d2h_bytes / rates.d2h_bps
    both = min(h2d_bytes / rates.duplex_h2d_bps, d2h_bytes / rates.duplex_d2h_bps)
    h2d_left = h2d_bytes - both * rates.duplex_h2d_bps
    d2h_left = d2h_bytes - both * rates.duplex_d2h_bps
    return both + max(0.0, h2d_left) / rates.h2d_bps + max(0.0, d2h_left) / rates.d2h_bps


def predict(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    lp_bytes: int,
    lp_on_host: bool = False,
    *,
    footprint: Footprint = ADAM_FP32,
) -> Prediction:
    """Predict the update phase of ``plan`` over sub-groups of ``sizes`` elements.

    ``lp_on_host``: the 16-bit parameters live in host memory (parameter offload), so host sub-groups upload
    nothing and device sub-groups download their 16-bit result as well. ``footprint``: the optimizer's rule and
    dtypes (bytes moved and held per element, update rates as :func:`rates_for` scales them)."""
    return predict_scaled(sizes, plan, rates_for(rates, footprint), lp_bytes, lp_on_host, footprint)


def predict_scaled(
    sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int, lp_on_host: bool, footprint: Footprint
) -> Prediction:
    """:func:`predict` with ``rates`` already those of ``footprint`` (:func:`rates_for`)."""
    if plan.host_indices:  # the host update runs beside the copies for the whole phase (:func:`overlapped`)
        rates = overlapped(rates)
    streamed_up, streamed_down, resident_up = footprint.streamed_up, footprint.streamed_down, footprint.resident_up
    streaming = bool(plan.streamed_indices)
    up = rates.duplex_h2d_bps if streaming else rates.h2d_bps
    down = rates.duplex_d2h_bps if streaming else rates.d2h_bps
    h2d_free = compute_free = d2h_free = 0.0
    h2d_bytes = d2h_bytes = 0
    lp_down = lp_bytes if lp_on_host else 0
    for i in plan.resident_indices:  # the engine queues resident work first
        h2d_free += resident_up * sizes[i] / up
        compute_free = max(compute_free, h2d_free) + sizes[i] / rates.device_adam_eps
        h2d_bytes += resident_up * sizes[i]
        if lp_down:
            d2h_free = max(d2h_free, compute_free) + lp_down * sizes[i] / down
            d2h_bytes += lp_down * sizes[i]
    slots_free = [0.0] * max(1, plan.device_buffers)
    for j, i in enumerate(plan.streamed_indices):
        n, slot = sizes[i], j % len(slots_free)
        h2d_free = max(h2d_free, slots_free[slot]) + streamed_up * n / up
        compute_free = max(compute_free, h2d_free) + n / rates.device_adam_eps
        d2h_free = slots_free[slot] = max(d2h_free, compute_free) + (streamed_down + lp_down) * n / down
        h2d_bytes += streamed_up * n
        d2h_bytes += (streamed_down + lp_down) * n
    device_s = max(h2d_free, compute_free, d2h_free)
    host_s, lp_free = 0.0, 0.0
    per_element = rates.host_s_per_element
    for i in plan.host_indices:
        host_s += sizes[i] * per_element
        if not rates.shared_cpu and not lp_on_host:  # a 16-bit upload follows each host sub-group
            lp_free = max(lp_free, host_s) + lp_bytes * sizes[i] / up
            h2d_bytes += lp_bytes * sizes[i]
    if rates.shared_cpu:
        time_s = device_s + host_s
    else:
        # Host uploads and device uploads share the link: it needs at least all the bytes' worth of time.
        time_s = max(device_s, host_s, lp_free, link_seconds(h2d_bytes, d2h_bytes, rates))
    return Prediction(time_s, device_bytes(sizes, plan, footprint=footprint), h2d_bytes, d2h_bytes, host_s, device_s)


#: Device memory kept free for the caching allocator's fragmentation when the update's budget is derived.
FREE_MEMORY_MARGIN = 0.10


def planning_budget(gpu_memory_budget: int | None, free_after_backward: int | None) -> tuple[int | None, bool]:
    """The device bytes ``"auto"`` plans the update in, and whether it may keep sub-groups resident, as the
    strategy decides them.

    With an explicit ``gpu_memory_budget`` (memory spare at the forward/backward peak): that budget, holding
    resident state and the update's streaming buffers together. Without one: the memory free after backward
    less :data:`FREE_MEMORY_MARGIN`, for streaming buffers alone, freed at the update's end; nothing resident,
    since resident state would be held through the next forward and backward, which need that memory.
    None for ``free_after_backward``: no limit.
    """
    if gpu_memory_budget is not None:
        return gpu_memory_budget, True
    if free_after_backward is None:
        return None, False
    return int(free_after_backward * (1.0 - FREE_MEMORY_MARGIN)), False


def floor(
    total_elements: int,
    rates: HardwareRates,
    lp_bytes: int,
    budget_bytes: int | None = None,
    points: int = 201,
    shares: Sequence[tuple[float, float]] = (),
    resident_up_bytes: int | None = None,
    *,
    footprint: Footprint = ADAM_FP32,
) -> tuple[float, float]:
    """The first-order floor of the update phase (reference notes), with the engine's byte counts.

    A share r of the elements streams (``footprint.streamed_up`` bytes up, ``streamed_down`` down: 16 and 12 for
    Adam in fp32), a share q stays resident (``resident_up`` bytes up, 4; at most what ``budget_bytes`` holds at
    ``footprint.device`` bytes each, none without a budget, as in the reference), the rest is updated on the host:
    T(r, q) = max((1-r-q)N/U_host, link(N(16r + 4q + lp(1-r-q)) up, 12rN down), (r+q)N/U_dev), with the link's
    time as :func:`link_seconds` gives it, searched on a grid plus the exact ``shares`` (r, q) given (those of
    schemes the floor is compared with, so that it is below each of them wherever their own prediction is
    above T at their share). ``resident_up_bytes``: bytes a resident element uploads (0 for a scheme whose
    gradients stay on the device, as TwinFlow's do; None: ``footprint.resident_up``). With no accelerator (a CPU
    "device") there is no upload and no device: T = N/U_host. Update rates as :func:`rates_for` scales them.
    Returns the device share r + q at the minimum, and the minimum.
    """
    rates = rates_for(rates, footprint)
    if resident_up_bytes is None:
        resident_up_bytes = footprint.resident_up
    n = float(total_elements)
    host = rates.host_s_per_element
    if rates.shared_cpu:  # the parameters live on the CPU too: the cast writes them, nothing is uploaded
        return (0.0, n * host)
    best = (0.0, n * max(host, lp_bytes / rates.h2d_bps))
    if rates.device_adam_eps <= 0 or n == 0:
        return best

    def t_of(r: float, q: float) -> float:
        up_bytes = n * (footprint.streamed_up * r + resident_up_bytes * q + lp_bytes * (1 - r - q))
        return max(
            n * (1 - r - q) * host,
            link_seconds(up_bytes, n * footprint.streamed_down * r, rates),
            n * (r + q) / rates.device_adam_eps,
        )

    q_max = min(1.0, budget_bytes / (footprint.device * n)) if budget_bytes else 0.0
    grid = [
        ((1 - q) * ri / (points - 1), q)
        for q in (q_max * qi / max(1, points - 1) for qi in range(points if q_max > 0 else 1))
        for ri in range(points)
    ]
    for r, q in [*grid, *shares]:
        t = t_of(r, q)
        if t < best[1]:
            best = (r + q, t)
    return best


def least_update_s(elements: float, rates: HardwareRates, lp_bytes: int, *, footprint: Footprint = ADAM_FP32) -> float:
    """A lower bound on the time any split of ``elements`` between host updates and streaming through the device
    takes, with nothing on the device beforehand: :func:`floor`'s T(r, 0) minimised exactly, not on a grid.

    The host's time falls with the streamed share r while the link's (:func:`link_seconds`, non-decreasing in the
    bytes of either direction) and the device's rise, so the minimum of the larger is where they cross; bisection
    brackets it, and the bound returned is the larger of the two sides' values at the bracket's ends, which the
    crossing cannot be below."""
    rates = rates_for(rates, footprint)
    n = max(0.0, float(elements))
    host = n * rates.host_s_per_element
    if rates.shared_cpu:
        return host
    if rates.device_adam_eps <= 0:
        return max(host, n * lp_bytes / rates.h2d_bps)

    def host_s(r: float) -> float:
        return host * (1.0 - r)

    def device_s(r: float) -> float:
        up = n * (footprint.streamed_up * r + lp_bytes * (1.0 - r))
        return max(link_seconds(up, n * footprint.streamed_down * r, rates), n * r / rates.device_adam_eps)

    if host_s(0.0) <= device_s(0.0):
        return device_s(0.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if host_s(mid) > device_s(mid) else (lo, mid)
    return max(device_s(lo), host_s(hi))
