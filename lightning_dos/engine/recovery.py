"""Finishing an interrupted update on the host, so that every sub-group is updated exactly once.

When an exception stops the update loop part-way (the device ran out of memory mid-stream, a kernel
failed, a hook raised), some sub-groups are post-step and the rest pre-step. Undoing the finished ones
would need a copy of their pre-step state, which costs as much memory traffic as the update itself,
every step. Finishing the others is cheap and needs nothing kept: the host has every sub-group's state
and gradient. :func:`finish_on_host` does that, guided by :class:`~lightning_dos.engine.atomic.UpdateProgress`:

- a streamed sub-group whose download home had begun is post-step on the device: its download is
  completed from the staging buffer (which no later sub-group has reused yet);
- a resident sub-group updated on the device only needs its 16-bit cast; one not yet updated comes
  home and is updated on the host;
- everything else runs host Adam, skipping the in-place unscale of a gradient already unscaled and the
  Adam of state already updated.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lightning_dos.engine.atomic import POST_STEP, PRE_STEP, TornStateError, UpdateInterrupted, UpdateProgress
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kernels import host_update, step_tensor
from lightning_dos.engine.pool import BufferPool
from lightning_dos.engine.streams import Streams
from lightning_dos.model.plan import Place, Plan, SubGroup
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import UpdateRule


class InterruptedEngine(Protocol):
    """What recovery uses of :class:`~lightning_dos.engine.loop.InterleavedUpdate` (typed here, so this module
    does not import the loop that calls it)."""

    sub_groups: list[SubGroup]
    sizes: tuple[int, ...]
    steps_taken: int
    torn: str | None
    last_report: StepReport | None
    pool: BufferPool
    streams: Streams
    lp_downloads: bool
    rule: UpdateRule
    resident: dict[int, Any]

    def _slices(self, sg: SubGroup, inputs: StepInputs) -> Sequence[torch.Tensor]: ...

    def _evict(self, indices: list[int]) -> None: ...

    def _done_with(self, index: int) -> None: ...


def settle_interrupted_update(
    engine: InterruptedEngine, error: BaseException, inputs: StepInputs, progress: UpdateProgress
) -> StepReport:
    """Leave the state pre-step or post-step after ``error`` interrupted the update, and say which.

    Nothing changed yet: pre-step, raised as :class:`UpdateInterrupted`. Otherwise the remaining
    sub-groups are finished on the host: post-step, raised as :class:`UpdateInterrupted`, except for a
    device out-of-memory error, after which the step simply completes (with a warning). If even the host
    cannot finish, the engine is marked torn and refuses to step or be checkpointed (:class:`TornStateError`).
    """
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    step = engine.steps_taken
    out_of_memory = isinstance(error, torch.OutOfMemoryError)
    if not progress.touched and not out_of_memory:
        engine.steps_taken -= 1
        _release_staging_once_idle(engine)
        raise UpdateInterrupted(
            f"lightning-dos: {what} interrupted optimizer step {step} before any state changed; "
            "the optimizer state is pre-step (the step was not taken)",
            PRE_STEP,
            error,
        ) from error
    try:
        finished = finish_on_host(engine, inputs, progress)
    except BaseException as second:  # noqa: BLE001 - reported with the first error
        engine.torn = (
            f"lightning-dos: {what} interrupted optimizer step {step} after sub-groups {sorted(progress.done)} "
            f"were updated, and finishing the others on the host failed too ({type(second).__name__}: {second}); "
            "the optimizer state in this process mixes two steps, so it refuses to step or to be checkpointed. "
            "Resume from the last checkpoint."
        )
        raise TornStateError(engine.torn) from error
    places = progress.places or (Place.HOST,) * len(engine.sub_groups)
    report = StepReport(
        step,
        Plan(tuple(places)),
        engine.sizes,
        predicted_s=inputs.predicted_s,
        predicted_iteration_s=inputs.predicted_iteration_s,
    )
    report.fallback_host = finished
    report.host_elements = sum(engine.sizes[i] for i in finished)
    engine.last_report = report
    engine.pool.release_staging()
    message = (
        f"lightning-dos: {what} interrupted optimizer step {step}; the remaining {len(finished)} sub-group(s) "
        "were finished on the host, so the optimizer state is post-step (every sub-group updated exactly once)"
    )
    if out_of_memory:
        warnings.warn(
            f"{message}. Training goes on; lower gpu_fraction or gpu_memory_budget to avoid this.",
            RuntimeWarning,
            stacklevel=4,
        )
        return report
    raise UpdateInterrupted(message, POST_STEP, error) from error


def _release_staging_once_idle(engine: InterruptedEngine) -> None:
    """Give the update's staging buffers back once the work queued on them has finished (uploads may be in
    flight before any sub-group is touched); a device that cannot even synchronise keeps them until teardown."""
    try:
        engine.streams.device_synchronize()
    except Exception:  # noqa: BLE001 - the caller raises the error that interrupted the update
        return
    engine.pool.release_staging()


def finish_on_host(engine: InterruptedEngine, inputs: StepInputs, progress: UpdateProgress) -> list[int]:
    """Bring every sub-group of the interrupted update to post-step; return those finished here.

    Raises whatever the device raises when work already queued on it cannot complete (the caller then
    knows the state cannot be made whole in this process).
    """
    # Work already queued lands first: downloads in flight, casts into the 16-bit partitions.
    engine.streams.device_synchronize()
    places = progress.places or (Place.HOST,) * len(engine.sub_groups)
    finished = []
    for index, sg in enumerate(engine.sub_groups):
        if index in progress.done:
            continue
        param, states, grad, lp = engine._slices(sg, inputs)
        device_views = progress.downloading.get(index)
        if device_views is not None:
            for dst, src in zip((param, *states), device_views, strict=True):
                dst.copy_(src)
            if engine.lp_downloads:  # the 16-bit result's download may not have been queued yet
                lp.copy_(param)
        elif index in engine.resident and places[index] == Place.RESIDENT and index in progress.updated:
            lp.copy_(engine.resident[index].param)
        else:
            if index in engine.resident:
                engine._evict([index])  # its pre-step state comes home (unchanged) before host Adam
            if index not in progress.updated:
                step = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
                # A gradient already unscaled in place is not unscaled twice.
                inv = 1.0 if index in progress.unscaled else inputs.inv_grad_scale
                host_update(engine.rule, param, grad, states, step, inputs.hypers[sg.param_group], inv)
                progress.reached("unscaled", index)
                progress.reached("updated", index)
            lp.copy_(param)
        progress.reached("done", index)
        engine._done_with(index)  # a file-backed sub-group goes back to its file: one at a time in host memory
        finished.append(index)
    engine.streams.device_synchronize()
    return finished


def take_on_host(engine: InterruptedEngine, inputs: StepInputs, interrupted: UpdateInterrupted) -> UpdateInterrupted:
    """Take, whole on the host, a step that ``interrupted`` stopped before it changed anything, when the caller has
    already counted it (an update overlapping what follows the step: the framework went on as if it were taken).
    Return the post-step :class:`UpdateInterrupted` to report; raise :class:`TornStateError` if the host fails too
    (the state is then pre-step while the framework counts the step: it must not be checkpointed)."""
    engine.steps_taken += 1
    step = engine.steps_taken
    try:
        finished = finish_on_host(engine, inputs, UpdateProgress())
    except BaseException as second:  # noqa: BLE001 - reported with the first error
        engine.steps_taken -= 1
        engine.torn = (
            f"lightning-dos: {interrupted.error!r} interrupted optimizer step {step} before any state changed, and "
            f"taking it on the host failed too ({type(second).__name__}: {second}); the training loop has counted "
            "that step, so the optimizer state in this process is one step behind it and refuses to step or to be "
            "checkpointed. Resume from the last checkpoint."
        )
        raise TornStateError(engine.torn) from interrupted.error
    all_host = Plan((Place.HOST,) * len(engine.sub_groups))
    report = StepReport(
        step, all_host, engine.sizes, predicted_s=inputs.predicted_s, predicted_iteration_s=inputs.predicted_iteration_s
    )
    report.fallback_host = finished
    report.host_elements = sum(engine.sizes)
    engine.last_report = report
    engine.pool.release_staging()
    return UpdateInterrupted(
        f"{interrupted} The training loop had counted that step (the update overlapped what follows it), so it "
        "was taken whole on the host instead: the optimizer state is post-step.",
        POST_STEP,
        interrupted.error,
    )
