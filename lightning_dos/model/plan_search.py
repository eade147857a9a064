"""The plan search: the placement whose predicted update (:func:`~lightning_dos.model.perfmodel.predict`) is
shortest and whose device memory fits the budget.

Exhaustive over every placement for a few sub-groups of unequal sizes; otherwise a scan over orders (which
sub-groups become resident, which are streamed, with how many staging buffers) that is exact for equal sizes
and quadratic in the number of sub-groups (docs/performance-model.md).

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import replace

from lightning_dos.model.perfmodel import (
    HardwareRates,
    Prediction,
    link_seconds,
    overlapped,
    predict_scaled,
    rates_for,
)
from lightning_dos.model.plan import Place, Plan, all_host
from lightning_dos.model.update_rules import ADAM_FP32, Footprint

#: Sub-groups of unequal sizes are searched exhaustively up to this many placements (exact for any sizes).
EXHAUSTIVE_LIMIT = 729


def _fitting_buffers(
    streamed: Sequence[int], resident: Sequence[int], budget_bytes: int | None, most: int, *, footprint: Footprint
) -> int:
    """Staging buffers for a placement of sub-groups of ``streamed`` and ``resident`` sizes: as many as fit in
    ``budget_bytes``, at most ``most`` (0: it does not fit).

    More buffers never make the predicted time longer (a streamed sub-group waits for the download of the one
    ``buffers`` places before it, and downloads finish in order), so for a given placement the most that fit
    is optimal; :func:`choose_plan` then drops any that do not shorten the prediction."""
    free = None if budget_bytes is None else budget_bytes - footprint.device * sum(resident)
    if free is not None:
        # The update's temporaries, for its largest device sub-group (device_bytes).
        free -= footprint.temporaries * max([*streamed, *resident, 0])
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
        buffers = _fitting_buffers(streamed, resident, budget_bytes, most, footprint=footprint)
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
        return host, predict_scaled(sizes, host, rates, lp_bytes, lp_on_host, fp)
    places_per_group = (Place.HOST, Place.DEVICE, Place.RESIDENT) if allow_resident else (Place.HOST, Place.DEVICE)
    best_plan, best = host, predict_scaled(sizes, host, rates, lp_bytes, lp_on_host, fp)

    def consider(plan: Plan) -> None:
        nonlocal best_plan, best
        guess = predict_scaled(sizes, plan, rates, lp_bytes, lp_on_host, fp)
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
                # A plan with host sub-groups has its copies slowed by the host update (predict): the scan is exact
                # for those, and overstates only plans with none, each scan's plan then predicted exactly.
                overlapped(rates),
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
        guess = predict_scaled(sizes, fewer, rates, lp_bytes, lp_on_host, fp)
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
