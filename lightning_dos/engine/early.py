"""Backward's phase of a step begun during backward (``overlap="auto"``): host sub-groups updated as their gradients
become final, exactly or speculatively.

:func:`update_during_backward` takes each host sub-group as backward reports its gradient final and hands it to one
of two implementations of :class:`EarlyUpdates`: :class:`ExactUpdates` updates it at once (the step's gradient
factor is known: no clipping, no loss scaling), :class:`SpeculativeUpdates` updates it out of place into a spare slot
with a guessed factor, and backward's end commits or drops it (:mod:`lightning_dos.engine.speculation`). What the
phase did comes back in an :class:`EarlyOutcome`; the step (``loop.py``) goes on from there.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

import torch

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import TornStateError
from lightning_dos.engine.context import StepContext
from lightning_dos.engine.host_side import HostLane
from lightning_dos.engine.kernels import SubGroupTensors, UpdateStep, host_update, step_tensor
from lightning_dos.engine.resident import ResidentSet
from lightning_dos.engine.speculation import SpareSlabs
from lightning_dos.model.plan import Place
from lightning_dos.model.step_report import StepReport


@dataclass
class EarlyOutcome:
    """What backward's phase did.

    Attributes:
        report: its report (``skipped`` when the step is skipped or was never taken).
        updated: the sub-groups updated for good, in the order their gradients became final (speculated ones once
            committed).
        tail: the last 16-bit upload they issued (the step's host side ends after it).
        not_taken: backward never ended, so the step was not taken (the step count goes back).
    """

    report: StepReport
    updated: list[int] = field(default_factory=list)
    tail: object = None
    not_taken: bool = False


class EarlyUpdates(abc.ABC):
    """How backward's phase updates a host sub-group whose gradient is final, and what backward's end does to it
    (:class:`ExactUpdates`, :class:`SpeculativeUpdates`)."""

    @abc.abstractmethod
    def update(self, ctx: StepContext, index: int, step_tensors: dict, outcome: EarlyOutcome) -> bool:
        """Update sub-group ``index``; False when nothing more can be taken during backward."""

    def settle(self, ctx: StepContext, arrivals: GradientArrivals, outcome: EarlyOutcome) -> None:
        """Backward is over (``arrivals.proceed``): the step takes the real gradient factor, if backward gave one."""
        if arrivals.proceed == GradientArrivals.RUN and arrivals.inv_grad_scale is not None:
            ctx.inputs.inv_grad_scale = arrivals.inv_grad_scale


class ExactUpdates(EarlyUpdates):
    """The step's factor is known before backward ends: each update is final at once, its 16-bit result uploaded."""

    def __init__(self, host: HostLane) -> None:
        self.host = host

    def update(self, ctx: StepContext, index: int, step_tensors: dict, outcome: EarlyOutcome) -> bool:
        landed = self.host.update(ctx, index, step_tensors)
        self.host.landing.land(index, landed)
        outcome.updated.append(index)
        outcome.tail = landed if landed is not None else outcome.tail
        return True


def update_during_backward(
    ctx: StepContext, arrivals: GradientArrivals, outcome: EarlyOutcome, updates: EarlyUpdates, resident: ResidentSet
) -> EarlyOutcome:
    """Update the plan's host sub-groups as backward reports their gradients final, until backward ends, through
    ``updates``; return ``outcome``, filled in (its report ``skipped`` when the step is skipped or abandoned, which
    must find nothing changed: else :class:`TornStateError`, saying why)."""
    ctx.streams.start_timeline(ctx.timing)
    plan, report = ctx.plan, outcome.report
    step_tensors: dict[int, torch.Tensor] = {}
    taking, error = True, None
    while (arrival := arrivals.next()) is not None:
        index, landed = arrival
        if not taking or plan.places[index] != Place.HOST or index in plan.after_backward:
            continue
        if ctx.homes.file_backed(index):
            continue  # read from its file after backward, with the rest of the step (never speculated on)
        # DeepSpeed copied the gradient on its own stream: the host reads it once that copy has landed.
        ctx.streams.host_wait(landed)
        began = time.perf_counter()  # the step's update time counts this work, not the waits for backward
        try:
            if index in resident:
                # Its state was resident on the device last step (this plan moves it home): current only there.
                resident.evict([index], ctx.reached)
            # A finite sum means every element is finite (one NaN or infinity makes it NaN or infinite), and it
            # allocates nothing the size of the gradient. A finite gradient whose sum overflows only stops the
            # early updates: the rest of the step still updates it, exactly.
            if not bool(torch.isfinite(ctx.homes.slices(ctx.homes.sub_groups[index], ctx.inputs)[2].sum())):
                # The global norm will not be finite either: DeepSpeed skips the step, so update nothing more.
                taking = False
                continue
            taking = updates.update(ctx, index, step_tensors, outcome)
        except BaseException as failure:  # noqa: BLE001 - raised once backward is over (see below)
            # Finishing the step (recovery) needs every gradient final: wait for the end of backward first.
            taking, error = False, failure
        report.update_s += time.perf_counter() - began
    updates.settle(ctx, arrivals, outcome)
    if arrivals.proceed == GradientArrivals.RUN:
        if error is not None:
            raise error
        report.early = tuple(outcome.updated)
        return outcome
    if ctx.progress.touched:
        abandoned = arrivals.proceed == GradientArrivals.ABANDON
        why = (
            "backward failed, so the step cannot be completed,"
            if abandoned
            else "the gradient norm is not finite, so DeepSpeed skips the step,"
        )
        raise TornStateError(
            f"lightning-dos: {why} after overlap='auto' had updated sub-groups {sorted(outcome.updated)} of optimizer "
            f"step {report.step} during backward; the optimizer state in this process mixes two steps, so it "
            "refuses to step or to be checkpointed. Resume from the last checkpoint with overlap='forward', "
            "which starts the update only once backward is over and the norm is known."
        ) from error
    outcome.not_taken = arrivals.proceed == GradientArrivals.ABANDON
    report.skipped = True
    return outcome


class SpeculativeUpdates(EarlyUpdates):
    """The step's factor is a guess until backward ends: each update is written out of place into the other of the
    sub-group's two places (a spare slot, or its home span when a slot holds it), and committed or dropped then.

    Args:
        host: the host lane (a committed result is uploaded as a host update's is).
        spare: the spare slots.
    """

    def __init__(self, host: HostLane, spare: SpareSlabs) -> None:
        self.host, self.spare = host, spare
        self.setup = host.setup

    def update(self, ctx: StepContext, index: int, step_tensors: dict, outcome: EarlyOutcome) -> bool:
        """Update host sub-group ``index`` with the guessed factor, out of place, its 16-bit result kept in the slot
        (nothing the framework reads changes); False when no slot is free (the sub-group, and any later one, waits
        for the step after backward)."""
        sg = self.setup.sub_groups[index]
        param, states, grad, _ = ctx.homes.slices(sg, ctx.inputs)
        target = self.spare.begin(index, *ctx.homes.home(sg))
        if target is None:
            return False
        out_param, out_states, lp = target
        ring = self.setup.pool.lp_staging
        if ring is not None and ring.free > 0:
            # The 16-bit result goes where its upload will read it, held until the commit: no copy then. (Nothing
            # else takes ring slots during backward; past the ring's size the result waits in the spare slot.) No
            # host wait for the slot's last upload: that was an earlier step's, and every step ends waiting for its
            # last upload on the lp_h2d stream (the mutation test finds no race without one).
            slot, lp, _ = ring.acquire(sg.numel)
            self.spare.staged[index] = slot, lp
        inputs = ctx.inputs
        if sg.ds_group not in step_tensors:
            step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
        hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
        try:
            with ctx.streams.lane("host_speculate", index, self.setup.footprint.master * sg.numel):
                tensors = SubGroupTensors(param, grad, states, lp)
                update_step = UpdateStep(step, hyper, inputs.inv_grad_scale)
                host_update(self.setup.rule, tensors, update_step, out=(out_param, out_states))
        except BaseException:
            self._discard(index)  # its current state was only read
            raise
        if ctx.on_point is not None:  # a test seam only: speculation records no progress (nothing is final yet)
            ctx.on_point("speculated", index)
        outcome.report.speculated += 1
        return True

    def settle(self, ctx: StepContext, arrivals: GradientArrivals, outcome: EarlyOutcome) -> None:
        """Backward is over: commit the speculated sub-groups when the step runs with the factor they were updated
        with, else drop their speculative results, their current state untouched (clipped, loss scale changed:
        they are updated again after backward with the real factor; skipped or abandoned: nothing of the step
        remains). Committed in the order they were made (their 16-bit results hold slots of the staging ring, given
        back in the order taken), before the step's device side is launched, which the next forward waits for."""
        if not self.spare.pending:
            super().settle(ctx, arrivals, outcome)
            return
        began = time.perf_counter()
        report, real = outcome.report, arrivals.inv_grad_scale
        commit = arrivals.proceed == GradientArrivals.RUN and (real is None or real == ctx.inputs.inv_grad_scale)
        report.committed = commit
        if not commit:
            self._discard_all()
            if real is not None:
                ctx.inputs.inv_grad_scale = real
        else:
            try:
                for index in list(self.spare.pending):
                    landed = self._commit(ctx, index)
                    self.host.landing.land(index, landed)
                    outcome.updated.append(index)
                    outcome.tail = landed if landed is not None else outcome.tail
                report.commit_s = time.perf_counter() - began
            except BaseException:
                # Those not committed yet keep their current state: the recovery updates them like any other
                # sub-group the interrupted step had not reached.
                self._discard_all()
                raise
            finally:
                report.update_s += time.perf_counter() - began
            return
        report.update_s += time.perf_counter() - began

    def _discard_all(self) -> None:
        for index in list(self.spare.pending):
            self._discard(index)

    def _discard(self, index: int) -> None:
        staged = self.spare.staged.pop(index, None)
        if staged is not None:  # its ring slot is free at once: its last upload landed in an earlier step
            self.setup.pool.lp_staging.release(staged[0], None)
        self.spare.discard(index)

    def _commit(self, ctx: StepContext, index: int) -> object:
        """Sub-group ``index``'s speculative update is the step's: it becomes the current state (no copy) and its
        16-bit result goes to the parameters as a host update's would; return when it lands."""
        sg, pool = self.setup.sub_groups[index], self.setup.pool
        _, _, _, lp = ctx.homes.slices(sg, ctx.inputs)
        staged = self.spare.staged.pop(index, None)
        if staged is not None:  # the result is in the ring slot its upload reads
            self.spare.commit(index)
            ctx.report.host_elements += sg.numel
            try:
                ctx.reached_together(("unscaled", "updated"), index)
            except BaseException:
                pool.lp_staging.release(staged[0], None)  # the recovery casts and uploads it anew
                raise
            return self.host.upload_staged(ctx, index, lp, staged[1], staged[0])
        result = self.spare.speculative_lp(index, sg.numel)
        staging, slot = lp, 0
        if pool.lp_staging is not None:
            slot, staging, last_read = pool.lp_staging.acquire(sg.numel)
            ctx.streams.host_wait(last_read)  # the host is about to overwrite what the slot's previous upload reads
        # Read before the commit: a held sub-group's result is in the slot the commit frees.
        staging.copy_(result)
        self.spare.commit(index)
        ctx.report.host_elements += sg.numel
        if staging is lp:
            ctx.reached_together(("unscaled", "updated", "done"), index)
            return None
        ctx.reached_together(("unscaled", "updated"), index)
        return self.host.upload_staged(ctx, index, lp, staging, slot)
