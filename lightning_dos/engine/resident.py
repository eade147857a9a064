"""Resident sub-groups: optimizer state kept on the device between steps (within an explicit budget).

A resident sub-group's master weights and states are uploaded once, updated on the device every step from an
uploaded (or kept, :mod:`~lightning_dos.engine.kept_gradients`) gradient, and downloaded only when they leave the
device, or when a checkpoint or an accessor reads the host slabs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kernels import step_tensor
from lightning_dos.engine.streams import Streams
from lightning_dos.model.plan import Plan
from lightning_dos.model.step_report import StepReport


class ResidentSubGroups:
    """Bringing state onto the device, updating it there, and home again (a part of
    :class:`~lightning_dos.engine.loop.InterleavedUpdate`, which holds the state it reads)."""

    def _make_resident(self, plan: Plan, streams: Streams) -> Plan:
        """Bring the plan's new resident sub-groups' state up; those that do not fit go to the host."""
        failed = []
        for index in plan.resident_indices:
            if index in self.resident:
                continue
            sg = self.sub_groups[index]
            try:
                with streams.on(streams.h2d):  # its first user (see _allocate)
                    buf = self.pool.allocate_resident(sg.numel)
            except torch.OutOfMemoryError:
                self._warn_fallback("resident optimizer state could not be allocated (out of memory)")
                failed.append(index)
                continue
            span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
            with streams.on(streams.h2d):
                for dst, slab in zip((buf.param, *buf.states), (self.pool.param, *self.pool.states)):
                    dst.copy_(slab[span], non_blocking=True)
            self.resident[index] = buf
        return plan.with_host(failed) if failed else plan

    def _run_resident(self, plan: Plan, inputs: StepInputs, streams: Streams, report: StepReport) -> list:
        """Upload only the gradient, update on the device, cast into the 16-bit partition; only that cast
        comes down, and only when the 16-bit parameters live on the host. Returns the tail events."""
        step_tensors: dict[int, torch.Tensor] = {}
        last_download = None
        for index in plan.resident_indices:
            sg, buf = self.sub_groups[index], self.resident[index]
            _, _, grad, lp = self._slices(sg, inputs)
            kept = self.kept.gradient(index, self.resident)
            if kept is None:
                with streams.lane("upload", index, self.footprint.master * sg.numel, streams.h2d):
                    buf.grad.copy_(grad, non_blocking=True)
                report.h2d_bytes += self.footprint.master * sg.numel
            uploaded = streams.record(streams.h2d)
            # The update reads the gradient (and, the first time, the state) the h2d stream brought up.
            streams.wait(streams.compute, uploaded)
            with streams.lane("device_adam", index, self.footprint.master * sg.numel, streams.compute):
                if sg.ds_group not in step_tensors:
                    step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], self.device)
                hyper = inputs.hypers[sg.param_group]
                self.device_update(
                    self.rule, buf.param, buf.grad, buf.states, step_tensors[sg.ds_group], hyper, inputs.inv_grad_scale,
                    step_number=inputs.steps[sg.ds_group],
                )  # fmt: skip
                self._reached("updated", index)
            with streams.lane("cast", index, self.lp_bytes * sg.numel, streams.compute):
                # Into the buffer's 16-bit slot when the 16-bit partition lives on the host (parameter offload).
                (buf.lp if buf.lp is not None else lp).copy_(buf.param)
            self._reached("done", index)
            if buf.lp is not None:
                last_download = self._download_lp(index, buf.lp, lp, report)
            self._land(index, last_download if buf.lp is not None else streams.record(streams.compute))
            report.device_elements += sg.numel
        return [last_download] if last_download is not None else []

    def _download_lp(self, index: int, device_lp: torch.Tensor, lp: torch.Tensor, report: StepReport) -> object:
        """Bring a device-cast 16-bit result down into the host-resident 16-bit partition (parameter offload)."""
        streams = self.streams
        # The download reads the cast the compute stream has just queued.
        streams.wait(streams.d2h, streams.record(streams.compute))
        with streams.lane("download", index, self.lp_bytes * lp.numel(), streams.d2h):
            lp.copy_(device_lp[: lp.numel()], non_blocking=True)
        report.d2h_bytes += self.lp_bytes * lp.numel()
        return streams.record(streams.d2h)

    def _download_resident(self, indices: list[int]) -> None:
        """Copy resident state into the host slabs and wait for it (the host reads them next)."""
        if not indices:
            return
        streams = self.streams
        # No device-side wait: this runs between steps or before a step issues any work, and every step
        # ends with the host waiting on all its streams' tails, so the compute stream's last writes to the
        # resident state are complete before this download is issued (the stream-race test checks it).
        with streams.on(streams.d2h):
            for index in indices:
                sg, buf = self.sub_groups[index], self.resident[index]
                span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
                for slab, src in zip((self.pool.param, *self.pool.states), (buf.param, *buf.states)):
                    slab[span].copy_(src, non_blocking=True)
                self._reached("flush", index)
        streams.host_wait(streams.record(streams.d2h))

    def _evict(self, indices: list[int]) -> None:
        """Bring resident state home and free it on the device."""
        self._download_resident(indices)
        for index in indices:
            self.kept.forget(index)
            self.pool.release_resident(self.resident.pop(index))

    @property
    def state_off_slabs(self) -> bool:
        """Whether some sub-group's current state may not be in the slabs (resident on the device, held in a spare
        slot, or in a swap file): a reader of the slabs must :meth:`flush_resident` first."""
        return bool(self.resident or self.spare.held or self.files is not None)

    def flush_resident(self, indices: Sequence[int] | None = None) -> None:
        """Make the host slabs current (a checkpoint or an accessor is about to read them): resident state is
        copied down and stays resident; state held in spare slots comes home. ``indices`` limits it to those
        sub-groups (None: all)."""
        chosen = list(self.resident) if indices is None else [i for i in indices if i in self.resident]
        self._download_resident(chosen)
        self._bring_home(list(self.spare.held) if indices is None else indices)
        self.materialize_files(indices)  # file-backed state is read into its spans (release_file_copies: back)

    def _bring_home(self, indices: Sequence[int]) -> None:
        """Copy the state of these sub-groups held in spare slots (committed speculative updates) back to the slabs
        (no update may be in flight: the copy is the host's, after every step's end)."""
        for index in indices:
            if index in self.spare.held:
                self.spare.bring_home(index, *self._home(self.sub_groups[index]))

    def drop_resident(self, indices: Sequence[int] | None = None) -> None:
        """Forget resident device state and state held in spare slots because the host slabs were just overwritten
        (a checkpoint load, an accessor's write); the next step uses the new values. ``indices`` limits it (None:
        all)."""
        chosen = list(self.resident) if indices is None else [i for i in indices if i in self.resident]
        for index in chosen:
            self.kept.forget(index)
            self.pool.release_resident(self.resident.pop(index))
        for index in list(self.spare.held) if indices is None else [i for i in indices if i in self.spare.held]:
            self.spare.forget(index)
        if self.files is not None:  # loaded file-backed spans were written: they go back to the file
            self.files.mark_written(indices)
