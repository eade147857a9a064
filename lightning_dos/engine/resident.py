"""Resident sub-groups: optimizer state kept on the device between steps (within an explicit budget).

A resident sub-group's master weights and states are uploaded once, updated on the device every step from an
uploaded (or kept, :mod:`~lightning_dos.engine.kept_gradients`) gradient, and downloaded only when they leave the
device, or when a checkpoint or an accessor reads the host slabs.

Two threads use the set: the update's (it brings state up, updates it, evicts it) and, during backward, the training
thread (:meth:`ResidentSet.keep_gradient` copies a final gradient into a resident buffer). A lock keeps the second
from copying into a buffer the first has just evicted and given back: an update begun during backward evicts a
sub-group the plan moved home as soon as its gradient is final, while backward goes on keeping the gradients of others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from lightning_dos.engine.context import StepContext, UpdateSetup
from lightning_dos.engine.in_flight import UpdateLanding
from lightning_dos.engine.kept_gradients import KeptGradients
from lightning_dos.engine.kernels import SubGroupTensors, UpdateStep, step_tensor
from lightning_dos.engine.pool import DeviceBuffer


class ResidentSet:
    """The sub-groups whose state lives on the device across iterations, and the gradients backward kept for them.
    Their buffers come from the engine's pool (``setup``); their 16-bit results are handed to readers by ``landing``.
    """

    def __init__(self, setup: UpdateSetup, landing: UpdateLanding) -> None:
        self.setup, self.landing = setup, landing
        self.pool, self.streams, self.sub_groups = setup.pool, setup.streams, setup.sub_groups
        #: Sub-groups whose state lives on the device across iterations, by index (guarded by ``_lock``).
        self._buffers: dict[int, DeviceBuffer] = {}
        #: Resident sub-groups whose gradient this backward wrote into their device buffer.
        self.kept = KeptGradients(setup.sub_groups)
        self._lock = threading.Lock()

    def __contains__(self, index: object) -> bool:
        return index in self._buffers

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def buffers(self) -> dict[int, DeviceBuffer]:
        """A copy of the resident buffers, by sub-group."""
        with self._lock:
            return dict(self._buffers)

    @property
    def indices(self) -> list[int]:
        with self._lock:
            return list(self._buffers)

    def make_resident(self, ctx: StepContext) -> list[int]:
        """Bring the plan's new resident sub-groups' state up; return those that do not fit (out of memory), which
        the step updates on the host."""
        failed = []
        streams = ctx.streams
        for index in ctx.plan.resident_indices:
            if index in self._buffers:
                continue
            sg = self.sub_groups[index]
            try:
                with streams.on(streams.h2d):  # its first user (see StreamedLane.allocate)
                    buf = self.pool.allocate_resident(sg.numel)
            except torch.OutOfMemoryError:
                failed.append(index)
                continue
            span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
            with streams.on(streams.h2d):
                for dst, slab in zip((buf.param, *buf.states), (self.pool.param, *self.pool.states)):
                    dst.copy_(slab[span], non_blocking=True)
            with self._lock:
                self._buffers[index] = buf
        return failed

    def run(self, ctx: StepContext) -> list:
        """Upload only the gradient, update on the device, cast into the 16-bit partition; only that cast comes down,
        and only when the 16-bit parameters live on the host. Returns the tail events."""
        streams, report, inputs, setup = ctx.streams, ctx.report, ctx.inputs, self.setup
        step_tensors: dict[int, torch.Tensor] = {}
        last_download = None
        for index in ctx.plan.resident_indices:
            sg, buf = self.sub_groups[index], self._buffers[index]
            _, _, grad, lp = ctx.homes.slices(sg, inputs)
            kept = self.kept.gradient(index, self._buffers)
            if kept is None:
                with streams.lane("upload", index, self.setup.footprint.master * sg.numel, streams.h2d):
                    buf.grad.copy_(grad, non_blocking=True)
                report.h2d_bytes += self.setup.footprint.master * sg.numel
            uploaded = streams.record(streams.h2d)
            # The update reads the gradient (and, the first time, the state) the h2d stream brought up.
            streams.wait(streams.compute, uploaded)
            with streams.lane("device_adam", index, self.setup.footprint.master * sg.numel, streams.compute):
                if sg.ds_group not in step_tensors:
                    step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], self.setup.device)
                hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
                update_step = UpdateStep(step, hyper, inputs.inv_grad_scale, inputs.steps[sg.ds_group])
                ctx.device_update(setup.rule, SubGroupTensors(buf.param, buf.grad, buf.states), update_step)
                ctx.reached("updated", index)
            with streams.lane("cast", index, self.setup.lp_bytes * sg.numel, streams.compute):
                # Into the buffer's 16-bit slot when the 16-bit partition lives on the host (parameter offload).
                (buf.lp if buf.lp is not None else lp).copy_(buf.param)
            ctx.reached("done", index)
            if buf.lp is not None:
                last_download = self._download_lp(index, buf.lp, lp, ctx)
            self.landing.land(index, last_download if buf.lp is not None else streams.record(streams.compute))
            report.device_elements += sg.numel
        return [last_download] if last_download is not None else []

    def _download_lp(self, index: int, device_lp: torch.Tensor, lp: torch.Tensor, ctx: StepContext) -> object:
        """Bring a device-cast 16-bit result down into the host-resident 16-bit partition (parameter offload)."""
        streams = ctx.streams
        # The download reads the cast the compute stream has just queued.
        streams.wait(streams.d2h, streams.record(streams.compute))
        with streams.lane("download", index, self.setup.lp_bytes * lp.numel(), streams.d2h):
            lp.copy_(device_lp[: lp.numel()], non_blocking=True)
        ctx.report.d2h_bytes += self.setup.lp_bytes * lp.numel()
        return streams.record(streams.d2h)

    def download(self, indices: Sequence[int], reached: Callable[[str, int], None]) -> None:
        """Copy these sub-groups' resident state into the host slabs and wait for it (the host reads them next);
        ``reached("flush", index)`` follows each copy's issue."""
        chosen = [i for i in indices if i in self._buffers]
        if not chosen:
            return
        streams = self.streams
        # No device-side wait: this runs between steps or before a step issues any work, and every step
        # ends with the host waiting on all its streams' tails, so the compute stream's last writes to the
        # resident state are complete before this download is issued (the stream-race test checks it).
        with streams.on(streams.d2h):
            for index in chosen:
                sg, buf = self.sub_groups[index], self._buffers[index]
                span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
                for slab, src in zip((self.pool.param, *self.pool.states), (buf.param, *buf.states)):
                    slab[span].copy_(src, non_blocking=True)
                reached("flush", index)
        streams.host_wait(streams.record(streams.d2h))

    def evict(self, indices: Sequence[int], reached: Callable[[str, int], None]) -> None:
        """Bring resident state home and free it on the device."""
        chosen = [i for i in indices if i in self._buffers]
        self.download(chosen, reached)
        self.drop(chosen)

    def drop(self, indices: Sequence[int] | None = None) -> None:
        """Forget resident device state (None: all), without bringing it home."""
        with self._lock:
            chosen = list(self._buffers) if indices is None else [i for i in indices if i in self._buffers]
            for index in chosen:
                self.kept.forget(index)
                self.pool.release_resident(self._buffers.pop(index))

    def updated_copy(self, index: int) -> torch.Tensor:
        """Resident sub-group ``index``'s master weights on the device."""
        return self._buffers[index].param

    # -- backward's hand-over of final gradients ------------------------------------------------------------------

    def keep_gradient(self, flat: int, offset: int, grad: torch.Tensor) -> None:
        """Backward made ``grad`` final: the gradient of elements ``[offset, offset + grad.numel())`` of flat
        partition ``flat``, on the device (DeepSpeed's reduced partition at the accumulation boundary). Copy the
        part each resident sub-group holds into that sub-group's device gradient slot, on the caller's current
        stream, so that the step reads it there and does not upload the host copy (which DeepSpeed still makes:
        a sub-group the step moves home, or finishes on the host after a failure, reads that one).

        A sub-group uses its kept gradient only if this backward wrote every one of its elements into the buffer
        it still has at the step (padding or a parameter without a gradient leave it to the host copy); the
        end-of-backward event on that stream (:meth:`backward_ended`) orders these copies before the update reads
        them."""
        with self._lock:
            self.kept.keep(flat, offset, grad, self._buffers)

    def forget_kept(self) -> None:
        """Forget the gradients kept so far (a new backward begins, or a step read or skipped them)."""
        with self._lock:
            self.kept.forget()

    def kept_slots(self) -> list[torch.Tensor]:
        """The device gradient slots written since the last step, of buffers still resident."""
        with self._lock:
            return self.kept.slots(self._buffers)
