"""Host sub-groups: the update on the CPU, one pass per sub-group, and the 16-bit result's upload.

Each host sub-group is unscaled, updated and cast in one pass (``kernels.host_update``), into the pinned 16-bit
staging ring the upload reads (or straight into the 16-bit partition when that lives on the host). Under
``overlap="auto"`` some are updated during backward instead (:mod:`lightning_dos.engine.early`), through the same
:meth:`HostLane.update` or, speculatively, into a spare slot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from lightning_dos.engine.context import StepContext, UpdateSetup
from lightning_dos.engine.in_flight import UpdateLanding
from lightning_dos.engine.kernels import SubGroupTensors, UpdateStep, host_update, step_tensor


@dataclass(frozen=True)
class HostLane:
    """The host side of an update: the CPU's updates and their 16-bit uploads on the ``lp_h2d`` stream, given what
    the engine's parts share (``setup``) and where each 16-bit result is landed for its readers (``landing``)."""

    setup: UpdateSetup
    landing: UpdateLanding

    def run(self, ctx: StepContext, order: Sequence[int], skip: Collection[int], tail: object = None) -> list:
        """The update on the CPU for every host sub-group in ``order`` not in ``skip`` (updated during backward
        already, its last upload ``tail``), each followed by an asynchronous 16-bit upload; return the last upload
        (backward's phase's included: they all share the ``lp_h2d`` stream)."""
        step_tensors: dict[int, torch.Tensor] = {}
        last_upload = tail if skip else None
        for index in order:
            if index not in skip:
                landed = self.update(ctx, index, step_tensors)
                self.landing.land(index, landed)
                last_upload = landed if landed is not None else last_upload
        return [last_upload] if last_upload is not None else []

    def update(self, ctx: StepContext, index: int, step_tensors: dict[int, torch.Tensor]) -> object:
        """Host sub-group ``index``'s update, 16-bit cast and upload; return when its 16-bit result lands."""
        streams, inputs, pool = ctx.streams, ctx.inputs, self.setup.pool
        sg = self.setup.sub_groups[index]
        ctx.homes.load_host(index)  # a file-backed one is updated in the staging slab it is read into
        param, states, grad, lp = ctx.homes.slices(sg, inputs)
        if sg.ds_group not in step_tensors:
            step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
        # The 16-bit partition is in host memory already (CPU device, parameter offload): cast straight into
        # it; otherwise into a slot of the pinned staging ring the upload reads, free once the upload that
        # last read it has landed. Unscale, update and cast in one pass over memory.
        staging, slot = lp, 0
        if pool.lp_staging is not None:
            slot, staging, last_read = pool.lp_staging.acquire(sg.numel)
            # The host is about to overwrite what the slot's previous upload reads.
            streams.host_wait(last_read)
        hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
        try:
            with streams.lane("host_adam", index, self.setup.footprint.master * sg.numel):
                tensors = SubGroupTensors(param, grad, states, staging)
                host_update(self.setup.rule, tensors, UpdateStep(step, hyper, inputs.inv_grad_scale))
            ctx.report.host_elements += sg.numel
            # One pass unscaled, updated and (on a CPU device) cast it: every point is recorded before any
            # hook runs, so an interruption at any of them finds the sub-group's true progress.
            ctx.reached_together(("unscaled", "updated", "done") if staging is lp else ("unscaled", "updated"), index)
            ctx.homes.done_with(
                index
            )  # the upload reads the 16-bit staging, not the state: a file-backed one goes back
        except BaseException:
            if staging is not lp:  # nothing will upload from the slot: free it (its last upload was waited for)
                pool.lp_staging.release(slot, None)
            raise
        if staging is lp:
            return None
        return self.upload_staged(ctx, index, lp, staging, slot)

    def upload_staged(self, ctx: StepContext, index: int, lp: torch.Tensor, staging: torch.Tensor, slot: int) -> object:
        """Upload host sub-group ``index``'s 16-bit result from its slot of the staging ring on the ``lp_h2d`` stream;
        the slot is free again once the upload has landed, which is returned."""
        streams, lp_bytes = ctx.streams, self.setup.lp_bytes
        with streams.lane("lp_upload", index, lp_bytes * lp.numel(), streams.lp_h2d):
            lp.copy_(staging, non_blocking=True)
        uploaded = streams.record(streams.lp_h2d)
        self.setup.pool.lp_staging.release(slot, uploaded)
        ctx.reached("done", index)
        ctx.report.h2d_bytes += lp_bytes * lp.numel()
        return uploaded
