"""The whole iteration: forward, backward and the optimizer update, overlapped as each ``overlap`` mode runs them.

One rank's steady-state iteration, from the start of backward to the start of the next backward, given the
update's own schedule (:class:`UpdateTimeline`: when each sub-group's 16-bit result lands, how long the CPU works
on each host sub-group) and the forward and backward times. Layers are spread over the sub-groups by their
elements, in parameter order (ZeRO-3's flat partitions follow it): the next forward needs sub-group ``i`` when it
has done the share of its work that the sub-groups before ``i`` hold, and backward, visiting layers in reverse,
makes sub-group ``i``'s gradient final when it has done the share of the sub-groups from ``i`` on.

- ``off``: forward, backward, then the whole update.
- ``forward``: the update starts when backward ends and the next forward runs beside it, each sub-group's layers
  waiting for its landing; the next backward waits for the whole update (it writes the gradients it reads).
- ``auto``: ``forward``, and during backward the CPU updates each host sub-group as soon as its gradient is final
  (the last sub-groups first); those it started before backward ended are not updated again after it.

Not modelled: the GPU's compute shared by the forward and the device sub-groups' updates (the device sub-groups
come first and finish early), and DeepSpeed's own work between the phases. Pure arithmetic: no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_dos.engine.perfmodel import HardwareRates, device_bytes, predict, rates_for
from lightning_dos.engine.plan import Place, Plan
from lightning_dos.engine.update_rules import ADAM_FP32, Footprint

#: The modes :func:`iteration_s` times, in its result's order.
MODES = ("off", "forward", "auto")


@dataclass(frozen=True)
class UpdateTimeline:
    """One update's schedule, in seconds from its start.

    Attributes:
        land_s: per sub-group, when its 16-bit result has landed (host sub-groups: their 16-bit upload; device
            ones: their cast on the device, which the engine's landing event follows; their download home goes on
            beside the next forward).
        host_s: per sub-group, the CPU seconds of its update (0 for device sub-groups).
        upload_s: per sub-group, seconds from the end of its host update to its landing (0 for device ones).
        device_end_s: when the device side is over (uploads, updates, downloads).
        total_s: when the update is over.
    """

    land_s: tuple[float, ...]
    host_s: tuple[float, ...]
    upload_s: tuple[float, ...]
    device_end_s: float
    total_s: float


def iteration_s(
    sizes: Sequence[int], plan: Plan, timeline: UpdateTimeline, forward_s: float, backward_s: float
) -> dict[str, float]:
    """Iteration time of each mode in :data:`MODES` for ``plan``'s update over sub-groups of ``sizes``."""
    total = sum(sizes)
    before = list(itertools.accumulate(sizes, initial=0))
    forward_share = [forward_s * n / total for n in sizes]
    # Backward makes sub-group i final once it has done the layers of sub-groups i, i + 1, ... (the last first).
    final_at = [backward_s * (total - before[i]) / total for i in range(len(sizes))]
    off = forward_s + backward_s + timeline.total_s
    forward = backward_s + _forward_beside_update(timeline.land_s, forward_share, timeline.total_s)
    land, end = _auto_update(plan, timeline, final_at, backward_s)
    auto = backward_s + _forward_beside_update(land, forward_share, end)
    return {"off": off, "forward": forward, "auto": auto}


def _forward_beside_update(land_s: Sequence[float], forward_share: Sequence[float], update_end_s: float) -> float:
    """From the update's start: the next forward, each sub-group's layers after its landing, and the update's end,
    whichever comes last (the next backward waits for both)."""
    done = 0.0
    for landed, work in zip(land_s, forward_share, strict=True):
        done = max(done, landed) + work
    return max(done, update_end_s)


def _auto_update(
    plan: Plan, timeline: UpdateTimeline, final_at: Sequence[float], backward_s: float
) -> tuple[list[float], float]:
    """Landing times and the end of the update under ``auto``, from the end of backward (negative: before it)."""
    host = [i for i, place in enumerate(plan.places) if place == Place.HOST]
    cpu, early = 0.0, {}
    for i in sorted(host, reverse=True):  # the order backward makes gradients final
        start = max(cpu, final_at[i])
        if start >= backward_s:  # taken after backward's end: the rest of the step updates it
            break
        cpu = start + timeline.host_s[i]
        early[i] = cpu + timeline.upload_s[i] - backward_s
    # After backward: the device side as scheduled, the remaining host sub-groups in order once the CPU is free.
    cpu = max(0.0, cpu - backward_s)
    land = list(timeline.land_s)
    for i in host:
        if i in early:
            land[i] = early[i]
        else:
            cpu += timeline.host_s[i]
            land[i] = cpu + timeline.upload_s[i]
    host_end = max((land[i] for i in host), default=0.0)
    return land, max(timeline.device_end_s, host_end)


def iteration_plan(
    sizes: Sequence[int],
    rates: HardwareRates,
    lp_bytes: int,
    buffers: int,
    forward_s: float,
    backward_s: float,
    mode: str,
    *,
    footprint: Footprint = ADAM_FP32,
    resident: Sequence[int] = (),
) -> Plan:
    """The streamed/host placement that minimises ``mode``'s predicted iteration (not the update alone), through
    ``buffers`` staging buffers (what fits the device, as the update-only plan found), the sub-groups in
    ``resident`` staying resident: the best of every count of streamed sub-groups placed first (the next forward
    needs them first; backward makes their gradients final last, so the host ones are updated during backward under
    ``auto``) or last among the others, then improved a sub-group at a time (:func:`_refined`)."""
    n, fixed, best = len(sizes), set(resident), None
    free = [i for i in range(n) if i not in fixed]

    def predicted(places: Sequence[Place]) -> float:
        plan = Plan(tuple(places), max(1, buffers))
        timeline = predicted_timeline(sizes, plan, rates, lp_bytes, footprint=footprint)
        return iteration_s(sizes, plan, timeline, forward_s, backward_s)[mode]

    for streamed, first in itertools.product(range(len(free) + 1), (True, False)):
        device = set(free[:streamed] if first else free[len(free) - streamed :])
        places = tuple(Place.RESIDENT if i in fixed else Place.DEVICE if i in device else Place.HOST for i in range(n))
        seconds = predicted(places)
        if best is None or seconds < best[0]:
            best = (seconds, places)
    return Plan(_refined(best[1], best[0], free, predicted), max(1, buffers))


#: Predictions :func:`_refined` may make (each one pass over the sub-groups): about 0.2 s at 50 sub-groups and 1 s
#: at 200 on a 2-core CPU, paid at each re-plan (every 50th iteration with overlap on).
REFINE_PREDICTIONS = 1000


def _refined(
    places: tuple[Place, ...],
    seconds: float,
    free: Sequence[int],
    predicted: Callable[[Sequence[Place]], float],
    limit: int = REFINE_PREDICTIONS,
) -> tuple[Place, ...]:
    """``places`` improved by single moves among the ``free`` sub-groups while one shortens the ``predicted``
    iteration: one sub-group between streamed and host, or two neighbours trading places. Each round takes its
    best move (the first on a tie, so the result is deterministic); it stops when none shortens the prediction
    or after ``limit`` predictions.

    Why not only the best count of streamed sub-groups placed first: after backward the CPU and the upload link
    both deliver sub-groups to the next forward, the CPU one per host update and the link one per streamed upload,
    each several times slower than the forward uses them. Streamed sub-groups spread among the later host ones
    keep both busy until the end (with clipping, when the host updates nothing during backward, by several
    percent: 20B on ``paper-h100x4`` at forward 1 s + backward 2 s, 3.73 s -> 3.63 s simulated)."""
    current, used = list(places), 0
    while used < limit:
        moves = []
        for k, i in enumerate(free):
            flipped = list(current)
            flipped[i] = Place.HOST if current[i] == Place.DEVICE else Place.DEVICE
            moves.append(flipped)
            if k + 1 < len(free) and current[i] != current[free[k + 1]]:
                traded = list(current)
                traded[i], traded[free[k + 1]] = current[free[k + 1]], current[i]
                moves.append(traded)
        best = None
        for move in moves[: limit - used]:
            candidate = predicted(move)
            if candidate < seconds * (1 - 1e-9) and (best is None or candidate < best[0]):
                best = (candidate, move)
        used += len(moves)
        if best is None:
            break
        seconds, current = best
    return tuple(current)


def shortest_iteration_plan(
    sizes: Sequence[int],
    rates: HardwareRates,
    lp_bytes: int,
    update_best: Plan,
    forward_s: float,
    backward_s: float,
    mode: str,
    *,
    footprint: Footprint = ADAM_FP32,
) -> Plan:
    """Of ``update_best`` (the plan that minimises the update alone) and :func:`iteration_plan` with the same
    resident sub-groups through as many staging buffers, if it needs no more device memory, the one whose
    predicted ``mode`` iteration is shorter (``update_best`` on a tie): what ``gpu_fraction="auto"`` runs once
    forward and backward are measured."""
    if mode not in MODES[1:]:
        return update_best
    buffers, resident = update_best.device_buffers, update_best.resident_indices
    candidate = iteration_plan(
        sizes, rates, lp_bytes, buffers, forward_s, backward_s, mode, footprint=footprint, resident=resident
    )
    if device_bytes(sizes, candidate, footprint=footprint) > device_bytes(sizes, update_best, footprint=footprint):
        return update_best

    def iteration(plan: Plan) -> float:
        timeline = predicted_timeline(sizes, plan, rates, lp_bytes, footprint=footprint)
        return iteration_s(sizes, plan, timeline, forward_s, backward_s)[mode]

    return candidate if iteration(candidate) < iteration(update_best) else update_best


def predicted_timeline(
    sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int, *, footprint: Footprint = ADAM_FP32
) -> UpdateTimeline:
    """The performance model's :class:`UpdateTimeline` for ``plan``: :func:`~lightning_dos.engine.perfmodel.predict`'s
    own arithmetic, kept per sub-group."""
    total = predict(sizes, plan, rates, lp_bytes, footprint=footprint).time_s
    rates = rates_for(rates, footprint)
    streaming = bool(plan.streamed_indices)
    up = rates.duplex_h2d_bps if streaming else rates.h2d_bps
    down = rates.duplex_d2h_bps if streaming else rates.d2h_bps
    land = [0.0] * len(sizes)
    host = [0.0] * len(sizes)
    upload = [0.0] * len(sizes)
    h2d_free = compute_free = d2h_free = 0.0
    for i in plan.resident_indices:
        h2d_free += footprint.resident_up * sizes[i] / up
        compute_free = max(compute_free, h2d_free) + sizes[i] / rates.device_adam_eps
        land[i] = compute_free
    slots = [0.0] * max(1, plan.device_buffers)
    for j, i in enumerate(plan.streamed_indices):
        n, slot = sizes[i], j % len(slots)
        h2d_free = max(h2d_free, slots[slot]) + footprint.streamed_up * n / up
        compute_free = max(compute_free, h2d_free) + n / rates.device_adam_eps
        d2h_free = slots[slot] = max(d2h_free, compute_free) + footprint.streamed_down * n / down
        land[i] = compute_free  # the 16-bit cast is on the device (the engine lands it there)
    device_end = max(h2d_free, compute_free, d2h_free)
    cpu = lp_free = 0.0
    per_element = 1.0 / rates.host_adam_eps + 1.0 / rates.host_cast_eps
    for i in plan.host_indices:
        host[i] = sizes[i] * per_element
        cpu += host[i]
        lp_free = max(lp_free, cpu) + lp_bytes * sizes[i] / up
        land[i], upload[i] = lp_free, lp_free - cpu
    return UpdateTimeline(tuple(land), tuple(host), tuple(upload), device_end, total)
