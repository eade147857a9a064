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

import torch

from lightning_dos.engine.atomic import POST_STEP, PRE_STEP, TornStateError, UpdateInterrupted
from lightning_dos.engine.context import StepContext, UpdateSetup
from lightning_dos.engine.kernels import SubGroupTensors, UpdateStep, host_update, step_tensor
from lightning_dos.engine.resident import ResidentSet
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.step_report import StepReport


def settle_interrupted_update(
    ctx: StepContext, setup: UpdateSetup, resident: ResidentSet, error: BaseException
) -> tuple[StepReport, str]:
    """Leave the state pre-step or post-step after ``error`` interrupted the step ``ctx`` runs, and say which.

    Nothing changed yet: pre-step, raised as :class:`UpdateInterrupted` (the step was not taken). Otherwise the
    remaining sub-groups are finished on the host: post-step, raised as :class:`UpdateInterrupted`, except for a
    device out-of-memory error, after which the step simply completes: its report is returned, with the warning to
    give. If even the host cannot finish, :class:`TornStateError` says why: the state mixes two steps.
    """
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    step = ctx.report.step
    out_of_memory = isinstance(error, torch.OutOfMemoryError)
    progress = ctx.progress
    if not progress.touched and not out_of_memory:
        _release_staging_once_idle(setup)
        raise UpdateInterrupted(
            f"lightning-dos: {what} interrupted optimizer step {step} before any state changed; "
            "the optimizer state is pre-step (the step was not taken)",
            PRE_STEP,
            error,
        ) from error
    finished = _finish_or_torn(
        ctx, setup, resident, error,
        f"lightning-dos: {what} interrupted optimizer step {step} after sub-groups {sorted(progress.done)} were "
        "updated, and finishing the others on the host failed too ({failure}); the optimizer state in this process "
        "mixes two steps, so it refuses to step or to be checkpointed. Resume from the last checkpoint.",
    )  # fmt: skip
    places = progress.places or (Place.HOST,) * len(setup.sub_groups)
    report = _host_report(ctx, setup, Plan(tuple(places)), finished)
    message = (
        f"lightning-dos: {what} interrupted optimizer step {step}; the remaining {len(finished)} sub-group(s) "
        "were finished on the host, so the optimizer state is post-step (every sub-group updated exactly once)"
    )
    if out_of_memory:
        return report, f"{message}. Training goes on; lower gpu_fraction or gpu_memory_budget to avoid this."
    raise UpdateInterrupted(message, POST_STEP, error, report) from error


def _finish_or_torn(
    ctx: StepContext, setup: UpdateSetup, resident: ResidentSet, cause: BaseException, torn: str
) -> list[int]:
    """:func:`finish_on_host`; if the host fails too, :class:`TornStateError` saying ``torn`` (its ``{failure}``: what
    failed), raised from ``cause``, the error that interrupted the update."""
    try:
        return finish_on_host(ctx, setup, resident)
    except BaseException as second:  # noqa: BLE001 - reported with the first error
        failure = f"{type(second).__name__}: {second}"
        raise TornStateError(torn.replace("{failure}", failure)) from cause


def _host_report(ctx: StepContext, setup: UpdateSetup, plan: Plan, finished: list[int]) -> StepReport:
    """The report of a step finished on the host (``finished``: the sub-groups the recovery updated)."""
    inputs = ctx.inputs
    sizes = tuple(sg.numel for sg in setup.sub_groups)
    report = StepReport(
        ctx.report.step,
        plan,
        sizes,
        predicted_s=inputs.predicted_s,
        predicted_iteration_s=inputs.predicted_iteration_s,
    )
    report.fallback_host = finished
    report.host_elements = sum(sizes[i] for i in finished)
    setup.pool.release_staging()
    return report


def _release_staging_once_idle(setup: UpdateSetup) -> None:
    """Give the update's staging buffers back once the work queued on them has finished (uploads may be in
    flight before any sub-group is touched); a device that cannot even synchronise keeps them until teardown."""
    try:
        setup.streams.device_synchronize()
    except Exception:  # noqa: BLE001 - the caller raises the error that interrupted the update
        return
    setup.pool.release_staging()


def finish_on_host(ctx: StepContext, setup: UpdateSetup, resident: ResidentSet) -> list[int]:
    """Bring every sub-group of the interrupted update to post-step; return those finished here.

    Raises whatever the device raises when work already queued on it cannot complete (the caller then
    knows the state cannot be made whole in this process).
    """
    # Work already queued lands first: downloads in flight, casts into the 16-bit partitions.
    setup.streams.device_synchronize()
    progress, inputs, homes = ctx.progress, ctx.inputs, ctx.homes
    places = progress.places or (Place.HOST,) * len(setup.sub_groups)
    finished = []
    for index, sg in enumerate(setup.sub_groups):
        if index in progress.done:
            continue
        param, states, grad, lp = homes.slices(sg, inputs)
        device_views = progress.downloading.get(index)
        if device_views is not None:
            for dst, src in zip((param, *states), device_views, strict=True):
                dst.copy_(src)
            if setup.lp_downloads:  # the 16-bit result's download may not have been queued yet
                lp.copy_(param)
        elif index in resident and places[index] == Place.RESIDENT and index in progress.updated:
            lp.copy_(resident.updated_copy(index))
        else:
            if index in resident:
                resident.evict([index], ctx.reached)  # its pre-step state comes home (unchanged) before host Adam
            if index not in progress.updated:
                step = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
                # A gradient already unscaled in place is not unscaled twice.
                inv = 1.0 if index in progress.unscaled else inputs.inv_grad_scale
                update_step = UpdateStep(step, inputs.hypers[sg.param_group], inv)
                host_update(setup.rule, SubGroupTensors(param, grad, states), update_step)
                progress.reached("unscaled", index)
                progress.reached("updated", index)
            lp.copy_(param)
        progress.reached("done", index)
        homes.done_with(index)  # a file-backed sub-group goes back to its file: one at a time in host memory
        finished.append(index)
    setup.streams.device_synchronize()
    return finished


def take_on_host(
    ctx: StepContext, setup: UpdateSetup, resident: ResidentSet, interrupted: UpdateInterrupted
) -> tuple[StepReport, UpdateInterrupted]:
    """Take, whole on the host, a step that ``interrupted`` stopped before it changed anything, when the caller has
    already counted it (an update overlapping what follows the step: the framework went on as if it were taken).
    Return its report and the post-step :class:`UpdateInterrupted` to report; raise :class:`TornStateError` if the
    host fails too (the state is then pre-step while the framework counts the step: it must not be checkpointed)."""
    finished = _finish_or_torn(
        ctx, setup, resident, interrupted.error,
        f"lightning-dos: {interrupted.error!r} interrupted optimizer step {ctx.report.step} before any state changed, "
        "and taking it on the host failed too ({failure}); the training loop has counted that step, so the optimizer "
        "state in this process is one step behind it and refuses to step or to be checkpointed. Resume from the last "
        "checkpoint.",
    )  # fmt: skip
    report = _host_report(ctx, setup, Plan((Place.HOST,) * len(setup.sub_groups)), finished)
    return report, UpdateInterrupted(
        f"{interrupted} The training loop had counted that step (the update overlapped what follows it), so it "
        "was taken whole on the host instead: the optimizer state is post-step.",
        POST_STEP,
        interrupted.error,
    )
