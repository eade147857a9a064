"""The performance model: predicts the update phase of a plan, and chooses the plan that minimises it.

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

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace

from lightning_dos.model.plan import Place, Plan, all_host
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
    """

    host_adam_eps: float
    host_cast_eps: float
    device_adam_eps: float
    h2d_bps: float
    d2h_bps: float
    duplex_h2d_bps: float
    duplex_d2h_bps: float
    shared_cpu: bool = False

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
        """Every rate times ``factor`` (a machine that is uniformly slower or faster)."""
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.name != "shared_cpu"})

    @property
    def host_s_per_element(self) -> float:
        """CPU seconds one element's host update takes: the update rule, then the cast to 16 bits."""
        return 1.0 / self.host_adam_eps + 1.0 / self.host_cast_eps


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
    return _predict(sizes, plan, rates_for(rates, footprint), lp_bytes, lp_on_host, footprint)


def _predict(
    sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int, lp_on_host: bool, footprint: Footprint
) -> Prediction:
    """:func:`predict` with ``rates`` already those of ``footprint`` (:func:`rates_for`)."""
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


#: Sub-groups of unequal sizes are searched exhaustively up to this many placements (exact for any sizes).
EXHAUSTIVE_LIMIT = 729


def _fitting_buffers(
    streamed: Sequence[int],
    resident_elements: int,
    budget_bytes: int | None,
    most: int,
    *,
    footprint: Footprint = ADAM_FP32,
    largest_resident: int = 0,
) -> int:
    """Staging buffers for a placement: as many as fit in ``budget_bytes``, at most ``most`` (0: it does not fit).

    More buffers never make the predicted time longer (a streamed sub-group waits for the download of the one
    ``buffers`` places before it, and downloads finish in order), so for a given placement the most that fit
    is optimal; :func:`choose_plan` then drops any that do not shorten the prediction."""
    free = None if budget_bytes is None else budget_bytes - footprint.device * resident_elements
    if free is not None:
        # The update's temporaries, for its largest device sub-group (device_bytes).
        free -= footprint.temporaries * max(*streamed, largest_resident, 0)
        if free < 0:
            return 0
    if not streamed:
        return 1
    buffers = min(most, len(streamed))
    if free is not None:
        buffers = min(buffers, free // (footprint.device * max(1, max(streamed))))
    return buffers


def _exhaustive(  # noqa: ANN202
    sizes: Sequence[int],
    places_per_group: tuple[Place, ...],
    budget_bytes: int | None,
    most: int,
    footprint: Footprint = ADAM_FP32,
):
    """Every placement, each with the most staging buffers that fit (plans that do not fit are left out)."""
    for combo in itertools.product(places_per_group, repeat=len(sizes)):
        streamed = [sizes[i] for i, p in enumerate(combo) if p == Place.DEVICE]
        resident = [sizes[i] for i, p in enumerate(combo) if p == Place.RESIDENT]
        buffers = _fitting_buffers(
            streamed, sum(resident), budget_bytes, most, footprint=footprint, largest_resident=max(resident, default=0)
        )
        if buffers:
            yield Plan(combo, buffers)


def _host_tail(sizes: Sequence[int], per_element: float, lp_per_element: float) -> tuple[list[float], list[float]]:
    """Host time and 16-bit upload end of the host chain over every suffix of ``sizes`` (as :func:`predict`).

    The chain ``lp = max(lp, host_s) + x`` unrolls to ``max_q (host_s_q + x_q + ... + x_last)``, so one
    backward pass gives every suffix. Returns ``host_s[p]`` and ``lp_free[p]`` for the suffix from ``p``
    (index ``len(sizes)``: the empty suffix)."""
    # Built from C-level maps: this runs twice per resident count in the scan.
    before = list(itertools.accumulate([n * per_element for n in sizes], initial=0.0))  # host time of sizes[:p]
    uploads_back = itertools.accumulate([n * lp_per_element for n in reversed(sizes)])  # of sizes[q:], q from last
    # reach[q]: the latest end over q' >= q of the host time through q' plus the uploads from q' on.
    reach_back = list(itertools.accumulate(map(operator.add, reversed(before), uploads_back), max))
    host_s = [before[-1] - b for b in before]
    lp_free = [*map(operator.sub, reversed(reach_back), before), 0.0]
    return host_s, lp_free


def _streamed_lane(
    start: tuple[float, float],
    sizes: Sequence[int],
    buffers: int,
    up: float,
    down: float,
    adam: float,
    footprint: Footprint = ADAM_FP32,
) -> Iterator[float]:
    """When the device side is done after streaming each prefix of ``sizes`` (as :func:`predict`): a sub-group's
    times never depend on the ones after it, so one pass gives every prefix."""
    h2d_free, compute_free = start
    d2h_free, slots = 0.0, [0.0] * buffers
    streamed_up, streamed_down = footprint.streamed_up, footprint.streamed_down
    for j, n in enumerate(sizes):
        slot = j % buffers
        h2d_free = (h2d_free if h2d_free > slots[slot] else slots[slot]) + streamed_up * n / up
        compute_free = (compute_free if compute_free > h2d_free else h2d_free) + n / adam
        d2h_free = slots[slot] = (d2h_free if d2h_free > compute_free else compute_free) + streamed_down * n / down
        # Downloads end last unless a later stage is still running (the lanes never run backwards).
        yield max(h2d_free, compute_free, d2h_free)


def _resident_lane(
    sizes: Sequence[int], up: float, adam: float, footprint: Footprint = ADAM_FP32
) -> tuple[float, float]:
    """Upload and compute ends of the resident sub-groups of ``sizes``, queued first (as :func:`predict`)."""
    h2d_free = compute_free = 0.0
    for n in sizes:
        h2d_free += footprint.resident_up * n / up
        compute_free = (compute_free if compute_free > h2d_free else h2d_free) + n / adam
    return h2d_free, compute_free


def _scan(
    sizes: Sequence[int],
    rates: HardwareRates,
    budget_bytes: int | None,
    lp_bytes: int,
    resident_order: Sequence[int],
    stream_order: Sequence[int],
    allow_resident: bool,
    max_buffers: int,
    bound: float = float("inf"),
    *,
    footprint: Footprint = ADAM_FP32,
) -> tuple[int, int, int] | None:
    """Best ``(r, k, buffers)`` faster than ``bound`` (None: none is) over the plans where the first ``r`` of
    ``resident_order`` are resident, the first ``k`` of the others in ``stream_order`` stream and the rest run
    on the host, for every ``r`` and ``k``.

    Lanes are evaluated in ``stream_order``: exactly :func:`predict` when that is index order or when sizes are
    equal, an estimate otherwise. Each ``r`` costs a few passes over the sub-groups (the streamed lane is
    extended one sub-group at a time, the host lane read from suffix sums), so the scan is quadratic; it stops
    early where the device side alone, which only grows with ``r`` and ``k``, already takes longer than the best.
    ``rates`` are already those of ``footprint`` (:func:`rates_for`)."""
    fp = footprint
    # Bytes per element as locals: the inner loop below is the planner's hot path.
    streamed_up_b, streamed_down_b = fp.streamed_up, fp.streamed_down
    resident_up_b, device_b, temp_b = fp.resident_up, fp.device, fp.temporaries
    per_element = rates.host_s_per_element
    up, down, adam = rates.duplex_h2d_bps, rates.duplex_d2h_bps, rates.device_adam_eps
    fastest_up, fastest_down = max(up, rates.h2d_bps), max(down, rates.d2h_bps)
    best = (bound, -1, 0, 1)
    for r in range(len(sizes) + 1 if allow_resident else 1):
        chosen = set(resident_order[:r])
        resident = [sizes[i] for i in sorted(chosen)]
        resident_elements = sum(resident)
        largest_resident = max(resident, default=0)
        free = None if budget_bytes is None else budget_bytes - device_b * resident_elements
        if free is not None and free < temp_b * largest_resident:
            continue  # with one sub-group's temporaries (device_bytes)
        alone, start = _resident_lane(resident, rates.h2d_bps, adam, fp), _resident_lane(resident, up, adam, fp)
        if min(max(alone), max(start)) >= best[0]:
            break  # more resident sub-groups only lengthen the resident lane
        rest = [sizes[i] for i in stream_order if i not in chosen]
        rest_elements = sum(rest)
        # k = 0: nothing streams, so the link runs one way at its own rate.
        up_bytes = resident_up_b * resident_elements + lp_bytes * rest_elements
        lower = max(*alone, rest_elements * per_element, up_bytes / rates.h2d_bps)
        if lower < best[0]:  # only then is the host lane's upload end worth a pass
            lp_free_alone = _host_tail(rest, per_element, lp_bytes / rates.h2d_bps)[1][0]
            best = min(best, (max(lower, lp_free_alone), r, 0, 1))
        # k >= 1: both directions are busy, each at its duplex rate. The most buffers that fit are best; they
        # only decrease as k grows (the largest streamed sub-group grows), so each count is one pass.
        host_s, lp_free = _host_tail(rest, per_element, lp_bytes / up)
        if free is None:
            fitting = [max_buffers] * len(rest)
        else:
            largest = itertools.accumulate(rest, max)
            fitting = [
                min(max_buffers, max(0, free - temp_b * max(n, largest_resident)) // (device_b * max(1, n)))
                for n in largest
            ]
        for buffers in sorted(set(fitting) - {0}):
            streamed_up = streamed = 0
            for k, done in enumerate(_streamed_lane(start, rest, buffers, up, down, adam, fp), start=1):
                streamed += rest[k - 1]
                streamed_up = up_bytes + (streamed_up_b - lp_bytes) * streamed
                # The device lane and every byte over the link at its fastest rate only grow with k.
                device_lower = max(done, streamed_up / fastest_up, streamed_down_b * streamed / fastest_down)
                if fitting[k - 1] < buffers or device_lower >= best[0]:
                    break
                link_s = link_seconds(streamed_up, streamed_down_b * streamed, rates)
                time_s = max(done, link_s, host_s[k], lp_free[k])
                if time_s < best[0]:
                    best = (time_s, r, k, min(buffers, k))
    return best[1:] if best[1] >= 0 else None


def choose_plan(
    sizes: Sequence[int],
    rates: HardwareRates,
    budget_bytes: int | None,
    lp_bytes: int,
    allow_resident: bool = False,
    max_buffers: int = 4,
    lp_on_host: bool = False,
    *,
    footprint: Footprint = ADAM_FP32,
) -> tuple[Plan, Prediction]:
    """The plan with the least predicted update time whose device memory fits ``budget_bytes`` (None: no limit).

    Equal sizes: the predicted time then depends only on how many sub-groups are resident, how many stream,
    and the staging buffers, of which the most that fit are best; every count is scanned in quadratic time,
    so the result is the optimum. Unequal sizes: every placement up to :data:`EXHAUSTIVE_LIMIT` of them
    (exact); beyond, the same scan with the sub-groups taken largest or smallest first, each scan's best plan
    then predicted exactly (a heuristic: on random 7-sub-group cases it found the brute-force optimum 5 times
    in 6, and was never more than 10% slower). With no accelerator (``device_adam_eps == 0``) everything stays
    on the host and nothing is searched. ``footprint``: the optimizer's rule and dtypes (see :func:`predict`).
    """
    n = len(sizes)
    host = all_host(n)
    rates = rates_for(rates, footprint)
    fp = footprint
    if n == 0 or rates.device_adam_eps <= 0 or rates.shared_cpu:
        if rates.host_adam_eps <= 0:
            return host, Prediction(0, 0, 0, 0, 0, 0)
        return host, _predict(sizes, host, rates, lp_bytes, lp_on_host, fp)
    places_per_group = (Place.HOST, Place.DEVICE, Place.RESIDENT) if allow_resident else (Place.HOST, Place.DEVICE)
    best_plan, best = host, _predict(sizes, host, rates, lp_bytes, lp_on_host, fp)

    def consider(plan: Plan) -> None:
        nonlocal best_plan, best
        guess = _predict(sizes, plan, rates, lp_bytes, lp_on_host, fp)
        if guess.time_s < best.time_s - 1e-12:
            best_plan, best = plan, guess

    if len(set(sizes)) > 1 and len(places_per_group) ** n <= EXHAUSTIVE_LIMIT:
        for plan in _exhaustive(sizes, places_per_group, budget_bytes, max_buffers, fp):
            consider(plan)
    else:
        for resident_order, stream_order in _scan_orders(sizes, allow_resident):
            # Each scan only looks for plans faster than the best so far, which prunes it much earlier.
            # (The scan's own link model ignores ``lp_on_host``; its plan is then predicted with it.)
            scan = _scan(
                sizes,
                rates,
                budget_bytes,
                lp_bytes,
                resident_order,
                stream_order,
                allow_resident,
                max_buffers,
                bound=best.time_s,
                footprint=fp,
            )
            if scan is not None:
                consider(_plan_of(n, resident_order, stream_order, *scan))
    # Staging buffers that do not shorten the update would only hold device memory.
    while best_plan.device_buffers > 1 and best_plan.streamed_indices:
        fewer = replace(best_plan, device_buffers=best_plan.device_buffers - 1)
        guess = _predict(sizes, fewer, rates, lp_bytes, lp_on_host, fp)
        if guess.time_s > best.time_s:
            break
        best_plan, best = fewer, guess
    return best_plan, best


def _scan_orders(sizes: Sequence[int], allow_resident: bool) -> list[tuple[list[int], list[int]]]:
    """(resident order, stream order) pairs worth scanning: one when sizes are equal (order does not matter)."""
    index_order = list(range(len(sizes)))
    if len(set(sizes)) == 1:
        return [(index_order, index_order)]
    largest_first = sorted(index_order, key=lambda i: (-sizes[i], i))
    smallest_first = sorted(index_order, key=lambda i: (sizes[i], i))
    if not allow_resident:  # a scan is linear then: try every order
        return [([], stream) for stream in (index_order, smallest_first, largest_first)]
    # Of the six pairings of these orders, these three came within 0.3% of the best of all six on 150 random
    # cases (20-60 sub-groups, random rates and budgets; mostly equal sizes or uniform spreads).
    return [(largest_first, smallest_first), (largest_first, largest_first), (smallest_first, largest_first)]


def _plan_of(n: int, resident_order: Sequence[int], stream_order: Sequence[int], r: int, k: int, buffers: int) -> Plan:
    """The plan a scan found: the first ``r`` of ``resident_order`` resident, the next ``k`` of ``stream_order``
    streamed."""
    resident = set(resident_order[:r])
    streamed = set([i for i in stream_order if i not in resident][:k])
    places = tuple(Place.RESIDENT if i in resident else Place.DEVICE if i in streamed else Place.HOST for i in range(n))
    return Plan(places, buffers)


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
