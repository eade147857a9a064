"""The whole iteration: forward, backward and the optimizer update, overlapped as each ``overlap`` mode runs them.

One rank's steady-state iteration, from the start of backward to the start of the next backward, given the
update's own schedule (:class:`UpdateTimeline`: when each sub-group's 16-bit result lands, how long the CPU works
on each host sub-group) and the forward and backward times. Layers are spread over the sub-groups by their
elements, in the order the next forward needs them (``Plan.order``, recorded in the first forward; index order
where nothing was recorded): the next forward needs a sub-group when it has done the share of its work that the
sub-groups before it in that order hold, and backward, visiting layers in reverse, makes a sub-group's gradient
final when it has done the share of the sub-groups from it on.

- ``off``: forward, backward, then the whole update.
- ``forward``: the update starts when backward ends and the next forward runs beside it, each sub-group's layers
  waiting for its landing; the next backward waits for the whole update (it writes the gradients it reads).
- ``auto``: ``forward``, and during backward the CPU updates each host sub-group as soon as its gradient is final
  (the last sub-groups first); those it started before backward ended are not updated again after it. With
  gradient clipping (:class:`Speculation`) those updates are speculative: each first copies the sub-group's state
  aside; a step that is not clipped lands them when backward ends, a clipped one copies them back and redoes them.

Not modelled: the GPU's compute shared by the forward and the device sub-groups' updates (the device sub-groups
come first and finish early), and DeepSpeed's own work between the phases. Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_dos.model.overlap import MODES
from lightning_dos.model.perfmodel import (
    least_update_s,
    overlapped,
    predict,
    rates_for,
    update_bytes,
)
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.model.update_rules import ADAM_FP32, Footprint


@dataclass(frozen=True)
class UpdateTimeline:
    """One update's schedule, in seconds from its start.

    Attributes:
        land_s: per sub-group, when its 16-bit result has landed (host sub-groups: their 16-bit upload; device
            ones: their cast on the device, which the engine's landing event follows; their download home goes on
            beside the next forward).
        host_s: per sub-group, the CPU seconds of its update (0 for device sub-groups).
        upload_s: per sub-group, seconds its 16-bit upload takes on the link (0 for device ones).
        device_end_s: when the device side is over (uploads, updates, downloads).
        total_s: when the update is over.
    """

    land_s: tuple[float, ...]
    host_s: tuple[float, ...]
    upload_s: tuple[float, ...]
    device_end_s: float
    total_s: float

    def landings(self, host_ready_s: dict[int, float]) -> tuple[list[float], float]:
        """Every sub-group's landing, and when the last work is over, when host sub-group ``i``'s CPU work is done
        at ``host_ready_s[i]`` (the device sub-groups land as :attr:`land_s` has them).

        Host sub-groups' 16-bit uploads go one after another in the CPU's order, each as soon as its CPU work is
        done: they are taken not to wait for the streamed uploads. The virtual node's copy engine
        (:mod:`lightning_dos.sim.replay`) makes one wait for the streamed upload in flight at most, and the
        streamed uploads there run at the solo rate whenever no download is under way, which this model (the
        duplex rate throughout) does not credit; the two roughly cancel (the replay is within a few percent of
        this model for the plans the planner picks). How a GPU's copy engines share the link between two
        upload streams is not measured."""
        land, end = list(self.land_s), self.device_end_s
        host_free = -math.inf
        for index, ready in sorted(host_ready_s.items(), key=lambda item: (item[1], item[0])):  # the CPU's order
            land[index] = host_free = max(host_free, ready) + self.upload_s[index]
            end = max(end, host_free)
        return land, end


@dataclass(frozen=True)
class Speculation:
    """Gradient clipping (or fp16 loss scaling) under ``auto``: the host updates begun during backward are
    speculative (:mod:`lightning_dos.engine.speculation`).

    Attributes:
        commit_rate: the share of steps that are not clipped, whose speculative updates are committed; the others
            restore each speculated sub-group and update it again after backward. At 0 the engine stops
            speculating (its commit policy), so ``auto`` runs as ``forward``.
        copy_share: what a speculative update costs beyond an update in place, in units of its CPU time
            (:func:`speculation_of`): the compiled kernel writes it out of place in its one pass, but the lines it
            writes are not the ones it read, so the CPU reads them first (write-allocate): the state once more;
            torch's kernels copy the state into the spare slot first, the state read and written once.
    """

    commit_rate: float
    copy_share: float


def write_allocate_share(footprint: Footprint = ADAM_FP32) -> float:
    """What an update written out of place costs beyond one in place, in units of its CPU time: the CPU reads each
    line it writes into the other place first, the state's bytes once more over the update's (12 of 28 for Adam in
    fp32)."""
    return footprint.optimizer_state / update_bytes(footprint)


def speculation_of(commit_rate: float, footprint: Footprint = ADAM_FP32, out_of_place: bool = True) -> Speculation:
    """:class:`Speculation` at ``commit_rate`` for ``footprint``'s rule and dtypes: with the compiled kernel
    (``out_of_place``) the state's bytes read once more, as the CPU reads each line it writes into the spare slot
    first (Adam in fp32: 12 more bytes per element over the update's 28; measured 1.39x an update in place on an
    AMD EPYC, AVX2, bench/RESULTS.md); with torch's kernels a copy first (24 more)."""
    if not 0.0 <= commit_rate <= 1.0:
        raise ValueError(f"commit rate {commit_rate} is not in [0, 1]")
    copies = 1 if out_of_place else 2
    return Speculation(commit_rate, copies * write_allocate_share(footprint))


def iteration_s(
    sizes: Sequence[int],
    plan: Plan,
    timeline: UpdateTimeline,
    forward_s: float,
    backward_s: float,
    speculation: Speculation | None = None,
    launch_speed: float = 1.0,
) -> dict[str, float]:
    """Iteration time of each mode in :data:`MODES` for ``plan``'s update over sub-groups of ``sizes``; with
    ``speculation`` (gradient clipping), ``auto`` is the mean over committed and clipped steps at its commit rate.
    ``launch_speed``: the next forward's share of its speed alone while the update runs beside it
    (``HardwareRates.overlap_launch_speed``); the update's own slowdown is ``timeline``'s
    (:func:`predicted_timeline` ``beside_training``). :func:`mode_iteration_s` puts both together."""
    total = sum(sizes)
    sequence = plan.sequence
    forward_share = [forward_s * sizes[i] / total for i in sequence]
    # Backward makes a sub-group final once it has done the layers of it and every sub-group the forward needs
    # after it (the last first).
    final_at = [0.0] * len(sizes)
    after = 0
    for i in reversed(sequence):
        after += sizes[i]
        final_at[i] = backward_s * after / total
    off = forward_s + backward_s + timeline.total_s
    forward = backward_s + _forward_beside_update(
        [timeline.land_s[i] for i in sequence], forward_share, timeline.total_s, launch_speed
    )

    def auto_when(committed: bool | None) -> float:
        land, end = _auto_update(plan, timeline, final_at, backward_s, speculation, committed)
        return backward_s + _forward_beside_update([land[i] for i in sequence], forward_share, end, launch_speed)

    if speculation is None:
        auto = auto_when(None)
    elif speculation.commit_rate == 0.0:
        auto = forward
    else:
        rate = speculation.commit_rate
        auto = rate * auto_when(True) + (1 - rate) * (auto_when(False) if rate < 1.0 else 0.0)
    return {"off": off, "forward": forward, "auto": auto}


def mode_iteration_s(
    problem: UpdateProblem, plan: Plan, phases: TrainingPhases, *, speculation: Speculation | None = None
) -> float:
    """The model's iteration for ``plan`` under ``phases.mode``: the update's schedule (:func:`predicted_timeline`,
    beside the training thread when the mode overlaps it) and the iteration around it (:func:`iteration_s`, the next
    forward slowed beside the update), with the contention ``problem.rates`` measured (``overlap_*_speed``)."""
    beside = phases.mode != MODES[0]
    timeline = predicted_timeline(problem, plan, beside_training=beside)
    launch = problem.rates.overlap_launch_speed if beside else 1.0
    seconds = iteration_s(problem.sizes, plan, timeline, phases.forward_s, phases.backward_s, speculation, launch)
    return seconds[phases.mode]


def iteration_floor(
    problem: UpdateProblem,
    forward_s: float,
    backward_s: float,
    *,
    resident_room: int = 0,
    speculation: Speculation | None = None,
    order: Sequence[int] = (),
) -> dict[str, float]:
    """Per mode in :data:`MODES`, an iteration no placement or schedule can beat under the engine's rules: the
    update's device work begins when backward ends (its staging buffers come from the memory backward frees), a
    host sub-group's update begins once its gradient is final, and the next forward follows backward.

    After backward, whatever is left of the update takes at least :func:`~lightning_dos.model.perfmodel.least_update_s`
    (the CPU and the link both busy to the end, any share streamed, no pipeline filling or draining, no sub-group
    granularity), and the iteration at least forward + backward. Under ``auto`` the CPU may have updated, during
    backward, as many elements as it can from the first gradient's finality to backward's end; resident state
    (up to ``resident_room`` device bytes: a ``gpu_memory_budget``) is charged nothing at all. Each relaxation only
    lowers the bound, so a schedule that the model or the replay times below it would be a fault of theirs.

    With ``speculation`` (gradient clipping), an update during backward costs ``1 + copy_share`` of one in place
    (its write-allocate), and only a committed step keeps it: ``auto``'s bound is the commit rate's mean of the
    committed step's bound and ``forward``'s (a clipped step updates everything after backward), as the model's
    and the replay's ``auto`` are the same mean of their committed and clipped steps."""
    sizes, rates, lp_bytes, footprint = problem.sizes, problem.rates, problem.lp_bytes, problem.footprint
    total = sum(sizes)
    if total == 0:
        return {mode: forward_s + backward_s for mode in MODES}
    left = max(0, total - resident_room // footprint.device)
    per_element = rates_for(rates, footprint).host_s_per_element
    # Backward makes the sub-group the forward needs last final first.
    first_final = backward_s * sizes[order[-1] if order else -1] / total
    if speculation is not None:
        per_element *= 1 + speculation.copy_share
    during_backward = min(left, (backward_s - first_final) / per_element)

    def after_backward(elements: float) -> float:
        return max(forward_s, least_update_s(elements, rates, lp_bytes, footprint=footprint))

    forward = backward_s + after_backward(left)
    auto = backward_s + after_backward(left - during_backward)
    if speculation is not None:
        auto = speculation.commit_rate * auto + (1 - speculation.commit_rate) * forward
    return {
        "off": forward_s + backward_s + least_update_s(left, rates, lp_bytes, footprint=footprint),
        "forward": forward,
        "auto": auto,
    }


def forward_beside_update_s(
    sizes: Sequence[int], land_s: Sequence[float], forward_s: float, update_end_s: float, order: Sequence[int] = ()
) -> float:
    """From the update's start: the next forward, its layers spread over the sub-groups of ``sizes`` by their
    elements in ``order`` (the order it needs them; empty: index order) and each sub-group's after its landing
    (``land_s``), and the update's end (``update_end_s``), whichever comes last (the next backward waits for
    both)."""
    total = sum(sizes) or 1
    sequence = order or range(len(sizes))
    return _forward_beside_update(
        [land_s[i] for i in sequence], [forward_s * sizes[i] / total for i in sequence], update_end_s
    )


def _forward_beside_update(
    land_s: Sequence[float], forward_share: Sequence[float], update_end_s: float, launch_speed: float = 1.0
) -> float:
    """From the update's start: the next forward, each sub-group's layers after its landing (at ``launch_speed`` of
    their speed alone until the update ends), and the update's end, whichever comes last (the next backward waits
    for both)."""
    done = 0.0
    for landed, work in zip(land_s, forward_share, strict=True):
        start = max(done, landed)
        if start >= update_end_s or launch_speed >= 1.0:
            done = start + work
        elif start + work / launch_speed <= update_end_s:
            done = start + work / launch_speed
        else:  # slowed until the update's end, at full speed after it
            done = update_end_s + work - (update_end_s - start) * launch_speed
    return max(done, update_end_s)


def _auto_update(
    plan: Plan,
    timeline: UpdateTimeline,
    final_at: Sequence[float],
    backward_s: float,
    speculation: Speculation | None = None,
    committed: bool | None = None,
) -> tuple[list[float], float]:
    """Landing times and the end of the update under ``auto``, from the end of backward (negative: before it). With
    ``speculation``, the updates during backward are speculative (each costing ``copy_share`` more); a
    ``committed`` step uploads their results once backward ends, a clipped one updates them again after
    backward."""
    host = plan.host_indices  # in the order the next forward needs them
    copy_share = speculation.copy_share if speculation is not None else 0.0
    cpu, ready = 0.0, {}
    for i in reversed([i for i in host if i not in plan.after_backward]):  # the order backward makes them final
        start = max(cpu, final_at[i])
        if start >= backward_s:  # taken after backward's end: the rest of the step updates it
            break
        cpu = start + timeline.host_s[i] * (1 + copy_share)
        ready[i] = cpu - backward_s
    # After backward: the device side as launched, the remaining host sub-groups in order once the CPU is free.
    cpu = max(0.0, cpu - backward_s)
    if speculation is not None and committed:  # committed at backward's end: nothing speculative lands before
        ready = {i: max(0.0, at) for i, at in ready.items()}
    elif speculation is not None:  # clipped: the speculative results are dropped, the sub-groups redone below
        ready = {}
    for i in host:
        if i not in ready:
            cpu += timeline.host_s[i]
            ready[i] = cpu
    return timeline.landings(ready)


def predicted_timeline(problem: UpdateProblem, plan: Plan, *, beside_training: bool = False) -> UpdateTimeline:
    """The performance model's :class:`UpdateTimeline` for ``plan``: :func:`~lightning_dos.model.perfmodel.predict`'s
    rates and byte counts, kept per sub-group, the host sub-groups worked through in order from the update's start
    (:meth:`UpdateTimeline.landings`). Where host sub-groups run beside the copies, the copies at their measured
    share (:func:`~lightning_dos.model.perfmodel.overlapped`), as ``predict`` charges them; ``beside_training`` (the
    update overlaps forward or backward), the host update at its share beside the training thread too."""
    sizes, rates, lp_bytes, footprint = problem.sizes, problem.rates, problem.lp_bytes, problem.footprint
    if plan.host_indices:  # charged once: predict leaves rates it is given charged as they are
        rates = overlapped(rates, beside_training=beside_training)
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
    per_element = rates.host_s_per_element
    ready, cpu = {}, 0.0
    for i in plan.host_indices:
        host[i] = sizes[i] * per_element
        upload[i] = lp_bytes * sizes[i] / up
        cpu += host[i]
        ready[i] = cpu
    timeline = UpdateTimeline(tuple(land), tuple(host), tuple(upload), device_end, total)
    land, _ = timeline.landings(ready)
    return replace(timeline, land_s=tuple(land))
