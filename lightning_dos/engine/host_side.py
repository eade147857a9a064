"""Host sub-groups: the update on the CPU, one pass per sub-group, and the 16-bit result's upload.

Each host sub-group is unscaled, updated and cast in one pass (``kernels.host_update``), into the pinned 16-bit
staging ring the upload reads (or straight into the 16-bit partition when that lives on the host). Under
``overlap="auto"`` the host sub-groups whose gradients backward makes final are updated before backward ends
(speculatively, with their untouched state kept, when the step's gradient factor is not known yet:
:mod:`lightning_dos.engine.speculation`).
"""

from __future__ import annotations

import time

import torch

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import TornStateError, UpdateProgress
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kernels import host_update, step_tensor
from lightning_dos.engine.streams import Streams
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.step_report import StepReport


class HostSubGroups:
    """The host side of an update (a part of :class:`~lightning_dos.engine.loop.InterleavedUpdate`, which holds
    the state it reads)."""

    def _update_as_gradients_arrive(
        self, plan: Plan, inputs: StepInputs, progress: UpdateProgress, arrivals: GradientArrivals
    ) -> StepReport:
        """Update the plan's host sub-groups as backward reports their gradients final, until backward ends; return
        what was done (``skipped`` when the step is skipped or abandoned, which must find nothing changed).

        With ``inputs.speculative`` each of them is updated out of place into a spare slot (:class:`SpareSlabs`), and
        backward's end commits or drops those updates (:meth:`_settle_speculation`); without it, they are final at
        once."""
        self.streams.start_timeline(self._step_timing)
        report = self._new_report(plan, inputs)
        self.updated_early = early = []
        self._early_tail = None
        speculating = inputs.speculative and self.spare.slots > 0
        step_tensors: dict[int, torch.Tensor] = {}
        taking, error = True, None
        while (arrival := arrivals.next()) is not None:
            index, landed = arrival
            if not taking or plan.places[index] != Place.HOST or index in plan.after_backward:
                continue
            if self._file_backed(index):
                continue  # read from its file after backward, with the rest of the step (never speculated on)
            # DeepSpeed copied the gradient on its own stream: the host reads it once that copy has landed.
            self.streams.host_wait(landed)
            began = time.perf_counter()  # the step's update time counts this work, not the waits for backward
            try:
                if index in self.resident:
                    # Its state was resident on the device last step (this plan moves it home): current only there.
                    self._evict([index])
                # A finite sum means every element is finite (one NaN or infinity makes it NaN or infinite), and it
                # allocates nothing the size of the gradient. A finite gradient whose sum overflows only stops the
                # early updates: the rest of the step still updates it, exactly.
                if not bool(torch.isfinite(self._slices(self.sub_groups[index], inputs)[2].sum())):
                    # The global norm will not be finite either: DeepSpeed skips the step, so update nothing more.
                    taking = False
                    continue
                if speculating:
                    taking = self._speculate(index, inputs, step_tensors)
                    report.speculated += 1 if taking else 0
                else:
                    landed = self._update_host_sub_group(index, inputs, report, step_tensors)
                    self._land(index, landed)
                    early.append(index)
                    self._early_tail = landed if landed is not None else self._early_tail
            except BaseException as failure:  # noqa: BLE001 - raised once backward is over (see below)
                # Finishing the step (recovery) needs every gradient final: wait for the end of backward first.
                taking, error = False, failure
            report.update_s += time.perf_counter() - began
        if self.spare.pending:
            began = time.perf_counter()
            self._settle_speculation(inputs, report, arrivals)
            report.update_s += time.perf_counter() - began
        elif arrivals.proceed == GradientArrivals.RUN and arrivals.inv_grad_scale is not None:
            inputs.inv_grad_scale = arrivals.inv_grad_scale
        if arrivals.proceed == GradientArrivals.RUN:
            if error is not None:
                raise error
            report.early = tuple(early)  # the list the commits appended to as well
            return report
        if progress.touched:
            abandoned = arrivals.proceed == GradientArrivals.ABANDON
            why = (
                "backward failed, so the step cannot be completed,"
                if abandoned
                else "the gradient norm is not finite, so DeepSpeed skips the step,"
            )
            self.torn = (
                f"lightning-dos: {why} after overlap='auto' had updated sub-groups {sorted(early)} of optimizer step "
                f"{self.steps_taken} during backward; the optimizer state in this process mixes two steps, so it "
                "refuses to step or to be checkpointed. Resume from the last checkpoint with overlap='forward', "
                "which starts the update only once backward is over and the norm is known."
            )
            raise TornStateError(self.torn) from error
        if arrivals.proceed == GradientArrivals.ABANDON:
            self.steps_taken -= 1  # backward never ended: the step was not taken
        report.skipped = True
        return report

    def _speculate(self, index: int, inputs: StepInputs, step_tensors: dict[int, torch.Tensor]) -> bool:
        """Update host sub-group ``index`` with the guessed factor, out of place: from its current state into the
        other of its two places (a spare slot, or its home span when it is held in one), its 16-bit result kept in
        the slot (nothing the framework reads changes); False when no slot is free (the sub-group, and any later
        one, waits for the step after backward)."""
        sg = self.sub_groups[index]
        param, states, grad, _ = self._slices(sg, inputs)
        target = self.spare.begin(index, *self._home(sg))
        if target is None:
            return False
        out_param, out_states, lp = target
        ring = self.pool.lp_staging
        if ring is not None and ring.free > 0:
            # The 16-bit result goes where its upload will read it, held until the commit: no copy then. (Nothing
            # else takes ring slots during backward; past the ring's size the result waits in the spare slot.) No
            # host wait for the slot's last upload: that was an earlier step's, and every step ends waiting for its
            # last upload on the lp_h2d stream (the mutation test finds no race without one).
            slot, lp, _ = ring.acquire(sg.numel)
            self.spare.staged[index] = slot, lp
        if sg.ds_group not in step_tensors:
            step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
        hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
        try:
            with self.streams.lane("host_speculate", index, self.footprint.master * sg.numel):
                host_update(
                    self.rule, param, grad, states, step, hyper, inputs.inv_grad_scale, lp, out=(out_param, out_states)
                )
        except BaseException:
            self._discard_speculation(index)  # its current state was only read
            raise
        if self.on_point is not None:  # a test seam only: speculation records no progress (nothing is final yet)
            self.on_point("speculated", index)
        return True

    def _settle_speculation(self, inputs: StepInputs, report: StepReport, arrivals: GradientArrivals) -> None:
        """Backward is over: commit the speculated sub-groups when the step runs with the factor they were updated
        with, else drop their speculative results, their current state untouched (clipped, loss scale changed:
        they are updated again after backward with the real factor; skipped or abandoned: nothing of the step
        remains). Committed in the order they were made (their 16-bit results hold slots of the staging ring, given
        back in the order taken), before the step's device side is launched, which the next forward waits for."""
        real = arrivals.inv_grad_scale
        commit = arrivals.proceed == GradientArrivals.RUN and (real is None or real == inputs.inv_grad_scale)
        report.committed = commit
        if not commit:
            self._discard_speculated()
            if real is not None:
                inputs.inv_grad_scale = real
            return
        started = time.perf_counter()
        try:
            for index in list(self.spare.pending):
                landed = self._commit(index, inputs, report)
                self._land(index, landed)
                self.updated_early.append(index)
                self._early_tail = landed if landed is not None else self._early_tail
            report.commit_s = time.perf_counter() - started
        except BaseException:
            # Those not committed yet keep their current state: the recovery updates them like any other
            # sub-group the interrupted step had not reached.
            self._discard_speculated()
            raise

    def _discard_speculated(self) -> None:
        for index in list(self.spare.pending):
            self._discard_speculation(index)

    def _discard_speculation(self, index: int) -> None:
        staged = self.spare.staged.pop(index, None)
        if staged is not None:  # its ring slot is free at once: its last upload landed in an earlier step
            self.pool.lp_staging.release(staged[0], None)
        self.spare.discard(index)

    def _commit(self, index: int, inputs: StepInputs, report: StepReport) -> object:
        """Sub-group ``index``'s speculative update is the step's: it becomes the current state (no copy) and its
        16-bit result goes to the parameters as a host update's would; return when it lands."""
        sg = self.sub_groups[index]
        _, _, _, lp = self._slices(sg, inputs)
        staged = self.spare.staged.pop(index, None)
        if staged is not None:  # the result is in the ring slot its upload reads
            self.spare.commit(index)
            report.host_elements += sg.numel
            try:
                self._reached_together(("unscaled", "updated"), index)
            except BaseException:
                self.pool.lp_staging.release(staged[0], None)  # the recovery casts and uploads it anew
                raise
            return self._upload_staged(index, lp, staged[1], staged[0], report)
        result = self.spare.speculative_lp(index, sg.numel)
        streams = self.streams
        staging, slot = lp, 0
        if self.pool.lp_staging is not None:
            slot, staging, last_read = self.pool.lp_staging.acquire(sg.numel)
            streams.host_wait(last_read)  # the host is about to overwrite what the slot's previous upload reads
        # Read before the commit: a held sub-group's result is in the slot the commit frees.
        staging.copy_(result)
        self.spare.commit(index)
        report.host_elements += sg.numel
        if staging is lp:
            self._reached_together(("unscaled", "updated", "done"), index)
            return None
        self._reached_together(("unscaled", "updated"), index)
        return self._upload_staged(index, lp, staging, slot, report)

    def _run_host_side(
        self, order: list[int], inputs: StepInputs, streams: Streams, report: StepReport, skip: set[int]
    ) -> list:
        """The update on the CPU for every host sub-group in ``order`` not in ``skip`` (updated during backward
        already), each followed by an asynchronous 16-bit upload; return the last upload (backward's phase's included:
        they all share the ``lp_h2d`` stream)."""
        step_tensors: dict[int, torch.Tensor] = {}
        last_upload = self._early_tail if skip else None
        for index in order:
            if index not in skip:
                landed = self._update_host_sub_group(index, inputs, report, step_tensors)
                self._land(index, landed)
                last_upload = landed if landed is not None else last_upload
        return [last_upload] if last_upload is not None else []

    def _update_host_sub_group(
        self, index: int, inputs: StepInputs, report: StepReport, step_tensors: dict[int, torch.Tensor]
    ) -> object:
        """Host sub-group ``index``'s update, 16-bit cast and upload; return when its 16-bit result lands."""
        streams = self.streams
        sg = self.sub_groups[index]
        if self._file_backed(index):  # updated in the staging slab it is read into, and written back from there
            self._load_file_backed(index)
        elif self.files is not None:  # streamed file-backed sub-groups whose download landed go back to their file
            self._store_landed_downloads()
        param, states, grad, lp = self._slices(sg, inputs)
        if sg.ds_group not in step_tensors:
            step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
        # The 16-bit partition is in host memory already (CPU device, parameter offload): cast straight into
        # it; otherwise into a slot of the pinned staging ring the upload reads, free once the upload that
        # last read it has landed. Unscale, update and cast in one pass over memory.
        staging, slot = lp, 0
        if self.pool.lp_staging is not None:
            slot, staging, last_read = self.pool.lp_staging.acquire(sg.numel)
            # The host is about to overwrite what the slot's previous upload reads.
            streams.host_wait(last_read)
        hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
        try:
            with streams.lane("host_adam", index, self.footprint.master * sg.numel):
                host_update(self.rule, param, grad, states, step, hyper, inputs.inv_grad_scale, staging)
            report.host_elements += sg.numel
            # One pass unscaled, updated and (on a CPU device) cast it: every point is recorded before any
            # hook runs, so an interruption at any of them finds the sub-group's true progress.
            self._reached_together(("unscaled", "updated", "done") if staging is lp else ("unscaled", "updated"), index)
            self._done_with(index)  # the upload reads the 16-bit staging, not the state: a file-backed one goes back
        except BaseException:
            if staging is not lp:  # nothing will upload from the slot: free it (its last upload was waited for)
                self.pool.lp_staging.release(slot, None)
            raise
        if staging is lp:
            return None
        return self._upload_staged(index, lp, staging, slot, report)

    def _upload_staged(
        self, index: int, lp: torch.Tensor, staging: torch.Tensor, slot: int, report: StepReport
    ) -> object:
        """Upload host sub-group ``index``'s 16-bit result from its slot of the staging ring on the ``lp_h2d`` stream;
        the slot is free again once the upload has landed, which is returned."""
        streams = self.streams
        with streams.lane("lp_upload", index, self.lp_bytes * lp.numel(), streams.lp_h2d):
            lp.copy_(staging, non_blocking=True)
        uploaded = streams.record(streams.lp_h2d)
        self.pool.lp_staging.release(slot, uploaded)
        self._reached("done", index)
        report.h2d_bytes += self.lp_bytes * lp.numel()
        return uploaded
