"""Streamed sub-groups: state uploaded, updated on the device and downloaded within one update.

Each streamed sub-group goes upload -> update and cast -> download through one of a few staging buffers, allocated
for the update on the upload stream (their first user) and given back to the caching allocator once the device
side is issued, recorded on every stream that still uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_dos.engine.context import StepContext, UpdateSetup
from lightning_dos.engine.in_flight import UpdateLanding
from lightning_dos.engine.kernels import SubGroupTensors, UpdateStep, step_tensor
from lightning_dos.engine.pool import DeviceBuffer
from lightning_dos.model.plan import Plan


@dataclass(frozen=True)
class StreamedLane:
    """The device side of an update: every streamed sub-group through the staging buffers, given what the engine's
    parts share (``setup``) and where each 16-bit result is landed for its readers (``landing``)."""

    setup: UpdateSetup
    landing: UpdateLanding

    def allocate(self, plan: Plan) -> list[DeviceBuffer] | None:
        """This update's streaming buffers (the plan fits the budget already); None when the device is out of
        memory."""
        device_ids = plan.streamed_indices
        if not device_ids:
            return []
        count = min(plan.device_buffers, len(device_ids))
        try:
            # On h2d, their first user: the allocator may hand out a block whose previous owner's work is still
            # queued on the allocating stream, which the uploads are then ordered after (torch's CUDA sanitizer
            # reports an upload into a block allocated on another stream).
            with self.setup.streams.on(self.setup.streams.h2d):
                return self.setup.pool.staging_for(count, max(self.setup.sub_groups[i].numel for i in device_ids))
        except torch.OutOfMemoryError:
            return None

    def launch(self, ctx: StepContext, buffers: list[DeviceBuffer]) -> list:
        """Queue upload -> update + cast -> download for every device sub-group; return the tail events."""
        streams, inputs, report, homes, setup = ctx.streams, ctx.inputs, ctx.report, ctx.homes, self.setup
        step_tensors: dict[int, torch.Tensor] = {}
        slot_free: list = [None] * len(buffers)
        for j, index in enumerate(ctx.plan.streamed_indices):
            sg = self.setup.sub_groups[index]
            n, slot = sg.numel, j % len(buffers)
            buf = buffers[slot]
            homes.load_streamed(index)  # a file-backed one's staging slab is its home: uploaded from, downloaded into
            param, states, grad, lp = homes.slices(sg, inputs)
            d_param, d_grad = buf.param[:n], buf.grad[:n]
            d_states = tuple(t[:n] for t in buf.states)
            # Reuse the slot only after the download of its previous sub-group has finished.
            streams.wait(streams.h2d, slot_free[slot])
            with streams.lane("upload", index, self.setup.footprint.streamed_up * n, streams.h2d):
                for dst, src in zip((d_param, *d_states, d_grad), (param, *states, grad)):
                    dst.copy_(src, non_blocking=True)
            uploaded = streams.record(streams.h2d)
            # The update reads what the upload wrote.
            streams.wait(streams.compute, uploaded)
            with streams.lane("device_adam", index, self.setup.footprint.master * n, streams.compute):
                if sg.ds_group not in step_tensors:
                    step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], self.setup.device)
                hyper = inputs.hypers[sg.param_group]
                step = step_tensors[sg.ds_group]
                update_step = UpdateStep(step, hyper, inputs.inv_grad_scale, inputs.steps[sg.ds_group])
                ctx.device_update(setup.rule, SubGroupTensors(d_param, d_grad, d_states), update_step)
                ctx.reached("computed", index)
            # Cast on the device, straight into DeepSpeed's 16-bit partition: no 16-bit upload needed
            # (into the buffer's 16-bit slot instead when that partition lives on the host; it comes down below).
            with streams.lane("cast", index, self.setup.lp_bytes * n, streams.compute):
                (buf.lp[:n] if buf.lp is not None else lp).copy_(d_param)
            computed = streams.record(streams.compute)
            # The download must not start before the update and the cast have finished with the buffer.
            streams.wait(streams.d2h, computed)
            down = self.setup.footprint.streamed_down * n + (self.setup.lp_bytes * n if buf.lp is not None else 0)
            with streams.lane("download", index, down, streams.d2h):
                ctx.reached("downloading", index, (d_param, *d_states))
                pairs = list(zip((param, *states), (d_param, *d_states)))
                if buf.lp is not None:
                    pairs.append((lp, buf.lp[:n]))
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                ctx.reached("done", index)
            slot_free[slot] = streams.record(streams.d2h)
            homes.download_issued(index, slot_free[slot])  # a file-backed one is written back once its state is home
            # The next forward reads only the 16-bit result: cast on the device, it is there once the compute stream
            # has run the cast; the state's download home (which the next backward and checkpoints wait for, with
            # the whole update) need not hold the forward back. Cast into the buffer, it is there once downloaded.
            self.landing.land(index, computed if buf.lp is None else slot_free[slot])
            report.h2d_bytes += self.setup.footprint.streamed_up * n
            report.d2h_bytes += down
            report.device_elements += n
        return [e for e in slot_free if e is not None]

    def release_staging(self, buffers: list[DeviceBuffer]) -> None:
        """Give this update's staging buffers back to the caching allocator as soon as its device side is issued
        (``buffers`` is emptied: the engine keeps no reference). Work queued on them may still be running, so each
        block is first recorded on the streams that use it (``record_stream``): the allocator hands it out again
        only once that work has run, whatever stream asks for it next (the next forward's, on which it was
        allocated, would otherwise get it at once). Nothing else is held between updates but resident state,
        which only an explicit budget plans."""
        streams = self.setup.streams
        for buf in buffers:
            for tensor in (buf.param, buf.grad, *buf.states, *(() if buf.lp is None else (buf.lp,))):
                for stream in (streams.h2d, streams.compute, streams.d2h):
                    streams.record_stream(tensor, stream)
        buffers.clear()
        self.setup.pool.release_staging()
        buf = tensor = None  # the loop's names held the last buffer: it goes back now, not when this returns
        self.landing.device_side_issued()  # the next forward, waiting for this (wait_device_side), may allocate now
