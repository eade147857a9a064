"""The placement that minimises the whole iteration (not the update alone) under an overlap mode.

``gpu_fraction="auto"`` runs it once forward and backward are measured (:mod:`lightning_dos.model.auto_plan`): the
best of every count of streamed sub-groups placed first or last in the order the next forward needs them, under
``"auto"`` the spread placements and those leaving every host sub-group for after backward, then improved a
sub-group at a time, each candidate timed by :func:`~lightning_dos.model.iteration.mode_iteration_s`. Pure
arithmetic: no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from lightning_dos.model.iteration import Speculation, mode_iteration_s
from lightning_dos.model.overlap import MODES
from lightning_dos.model.perfmodel import device_bytes, rates_for
from lightning_dos.model.plan import Place, Plan, even_plan
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem


def iteration_plan(
    problem: UpdateProblem,
    buffers: int,
    phases: TrainingPhases,
    *,
    resident: Sequence[int] = (),
    speculation: Speculation | None = None,
    order: Sequence[int] = (),
) -> Plan:
    """The streamed/host placement of ``problem`` that minimises ``phases.mode``'s predicted iteration (not the update
    alone), through ``buffers`` staging buffers (what fits the device, as the update-only plan found), the sub-groups
    in ``resident`` staying resident: the best of every count of streamed sub-groups placed first (the next forward
    needs them first; backward makes their gradients final last, so the host ones are updated during backward under
    ``auto``) or last among the others and, under ``auto``, of the spread placements (:func:`_spread_candidates`),
    then improved a sub-group at a time (:func:`_refined`); "first", "last" and "spread" in ``order`` (the order the
    next forward needs them; empty: index order), which the plan keeps."""
    sizes, mode = problem.sizes, phases.mode
    n, fixed, order = len(sizes), set(resident), tuple(order)
    free = [i for i in (order or range(n)) if i not in fixed]
    roles = [RESIDENT if i in fixed else HOST for i in range(n)]

    def predicted(candidate: Sequence[str]) -> float:
        return mode_iteration_s(problem, _plan_of(candidate, buffers, order), phases, speculation=speculation)

    candidates = []
    # Under "auto", the host sub-groups are also tried all left for after backward (as "forward" runs them): the
    # gradients backward makes final first are those the next forward needs last, and with a large sub-group the
    # forward needs first made final at backward's very end (a GPT's embeddings), updating during backward can only
    # delay the update after it (20B on paper-h100x4 in its recorded order: 3.97 s predicted without these, the
    # forward's 3.62 s with them).
    host_roles = (HOST, LATE) if mode == "auto" else (HOST,)
    for streamed, first, host in itertools.product(range(len(free) + 1), (True, False), host_roles):
        device = set(free[:streamed] if first else free[len(free) - streamed :])
        candidates.append([DEVICE if i in device else (host if i in free else role) for i, role in enumerate(roles)])
    if mode == "auto":
        per_element = rates_for(problem.rates, problem.footprint).host_s_per_element
        if speculation is not None:  # a speculative update may cost more than one in place (torch's kernels)
            per_element *= 1 + speculation.copy_share
        candidates += _spread_candidates(sizes, roles, free, phases.backward_s, per_element)
    best = min(((predicted(c), c) for c in candidates), key=lambda pair: pair[0])
    return _plan_of(_refined(best[1], best[0], free, predicted, late=mode == "auto"), buffers, order)


#: A sub-group's role in a placement being searched: streamed, resident, a host sub-group, and (under ``auto``) a
#: host sub-group left for after backward (:attr:`~lightning_dos.model.plan.Plan.after_backward`).
DEVICE, RESIDENT, HOST, LATE = "streamed", "resident", "host", "late"
_PLACE_OF = {DEVICE: Place.DEVICE, RESIDENT: Place.RESIDENT, HOST: Place.HOST, LATE: Place.HOST}


def _plan_of(roles: Sequence[str], buffers: int, order: tuple[int, ...] = ()) -> Plan:
    after = frozenset(i for i, role in enumerate(roles) if role == LATE)
    return Plan(tuple(_PLACE_OF[role] for role in roles), max(1, buffers), after, order)


#: Counts of streamed sub-groups :func:`_spread_candidates` tries for each count of host sub-groups updated during
#: backward (all of them when there are fewer).
SPREAD_COUNTS = 30


def _spread_candidates(
    sizes: Sequence[int], roles: Sequence[str], free: Sequence[int], backward_s: float, per_element: float
) -> list[list[str]]:
    """Placements for ``auto`` that spread the CPU's work during backward over the whole partition.

    Backward makes the last sub-groups' gradients final first, and the CPU can update only part of the partition
    before backward ends (``per_element`` CPU seconds each). If it updated the first that came, the sub-groups the
    next forward reaches last would all be done, and the forward would wait for every other sub-group before running
    through them. Spread instead - every few sub-groups one the CPU updates during backward, the others streamed or
    left to the CPU after backward, each spread too - the forward finds something ready all along. Tried: as many
    host sub-groups during backward as the CPU has time for, two fewer to two more, and for each every count of
    streamed ones (up to :data:`SPREAD_COUNTS` counts)."""
    if not free:
        return []
    per_sub_group = per_element * sum(sizes[i] for i in free) / len(free)
    fits = round(backward_s / per_sub_group) if per_sub_group > 0 else len(free)
    candidates = []
    for early_count in range(max(1, fits - 2), min(len(free), fits + 2) + 1):
        early = _spread(free, early_count)
        rest = [i for i in free if i not in early]
        counts = sorted({round(k * len(rest) / SPREAD_COUNTS) for k in range(SPREAD_COUNTS + 1)})
        for streamed_count in counts if len(rest) > SPREAD_COUNTS else range(len(rest) + 1):
            device = _spread(rest, streamed_count)
            placed = {**dict.fromkeys(rest, LATE), **dict.fromkeys(device, DEVICE), **dict.fromkeys(early, HOST)}
            candidates.append([placed.get(i, role) for i, role in enumerate(roles)])
    return candidates


def _spread(indices: Sequence[int], count: int) -> set[int]:
    """``count`` of ``indices`` spread evenly, as :func:`~lightning_dos.model.plan.even_plan` spreads them."""
    if not indices or count <= 0:
        return set()
    return {indices[i] for i in even_plan(len(indices), count / len(indices)).device_indices}


#: Predictions :func:`_refined` may make (each one pass over the sub-groups): a whole re-plan takes about 0.3-0.4 s at
#: 50 sub-groups and 1.2-1.3 s at 219 on a 2-core CPU, paid at each re-plan (every 50th iteration with overlap on).
REFINE_PREDICTIONS = 1000


def _refined(
    roles: Sequence[str],
    seconds: float,
    free: Sequence[int],
    predicted: Callable[[Sequence[str]], float],
    limit: int = REFINE_PREDICTIONS,
    late: bool = False,
) -> list[str]:
    """``roles`` improved by single moves among the ``free`` sub-groups while one shortens the ``predicted``
    iteration: one sub-group between streamed and host (and, with ``late``, between a host sub-group updated during
    backward and one left for after it), or two neighbours trading roles. Each round takes its best move (the first
    on a tie, so the result is deterministic); it stops when none shortens the prediction or after ``limit``
    predictions.

    Why not only the best count of streamed sub-groups placed first: after backward the CPU and the upload link
    both deliver sub-groups to the next forward, the CPU one per host update and the link one per streamed upload,
    each several times slower than the forward uses them. Streamed sub-groups spread among the later host ones
    keep both busy until the end (with clipping, when the host updates nothing during backward, by several
    percent: 20B on ``paper-h100x4`` at forward 1 s + backward 2 s, 3.73 s -> 3.63 s simulated)."""
    choices = (DEVICE, HOST, LATE) if late else (DEVICE, HOST)
    current, used = list(roles), 0
    while used < limit:
        moves = []
        for k, i in enumerate(free):
            for role in choices:
                if role != current[i] and (late or current[i] != LATE):
                    moved = list(current)
                    moved[i] = role
                    moves.append(moved)
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
    return current


def shortest_iteration_plan(
    problem: UpdateProblem,
    update_best: Plan,
    phases: TrainingPhases,
    *,
    speculation: Speculation | None = None,
    budget: int | None = None,
) -> Plan:
    """Of ``update_best`` (the plan that minimises the update alone) and :func:`iteration_plan` with the same
    resident sub-groups through as many staging buffers, if it needs no more device memory than ``update_best`` or
    the ``budget`` (device bytes the update may use; None: no limit), the one whose predicted ``phases.mode``
    iteration is shorter (``update_best`` on a tie): what ``gpu_fraction="auto"`` runs once forward and backward are
    measured; with ``speculation`` (clipping), ``auto``'s iteration at its commit rate. (Sub-groups differ in size by
    a few elements, so a candidate streaming other ones may need a few bytes more than ``update_best`` and still
    fit.)"""
    if phases.mode not in MODES[1:]:
        return update_best
    buffers, resident = update_best.device_buffers, update_best.resident_indices
    candidate = iteration_plan(
        problem, buffers, phases, resident=resident, speculation=speculation, order=update_best.order
    )
    sizes, footprint = problem.sizes, problem.footprint
    needed = device_bytes(sizes, candidate, footprint=footprint)
    if needed > device_bytes(sizes, update_best, footprint=footprint) and budget is not None and needed > budget:
        return update_best

    def iteration(plan: Plan) -> float:
        return mode_iteration_s(problem, plan, phases, speculation=speculation)

    return candidate if iteration(candidate) < iteration(update_best) else update_best
