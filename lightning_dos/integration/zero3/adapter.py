"""The ZeRO-3 adapter: it takes over DeepSpeed's ZeRO-3 step (the prologue and epilogue stay DeepSpeed's, the loop
over sub-groups between them is the engine's), adopts DeepSpeed's optimizer state into the engine's slabs at
start-up, and plans each step. Its other jobs are parts of their own (see the package's docstring).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import POST_STEP, PRE_STEP, TornStateError, UpdateInFlightError, UpdateInterrupted
from lightning_dos.engine.file_tier import FileTier
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.engine.streams import Streams
from lightning_dos.host.disk import load_aio
from lightning_dos.host.hostmem import return_freed_memory
from lightning_dos.host.signals import SignalHold
from lightning_dos.integration.nvme_tier import NvmeTier
from lightning_dos.integration.optimizers import (
    hyper_of,
    rule_of,
    state_dtype,
)
from lightning_dos.integration.phases import IterationPhases
from lightning_dos.integration.zero3.backward import BackwardHooks
from lightning_dos.integration.zero3.compat import (
    _accelerator_device,
    _regroup_rebuilt_adagrad,
    check_zero3_optimizer,
    engine_device,
)
from lightning_dos.integration.zero3.gathers import ForwardGathers
from lightning_dos.integration.zero3.need_recording import NeedRecording
from lightning_dos.integration.zero3.state_access import TRIM_EVERY_BYTES, StateAccess
from lightning_dos.model.nvme import staging_slots
from lightning_dos.model.overlap import OFF, Overlap, check_overlap, overlaps_forward
from lightning_dos.model.plan import Plan, auto_sub_group_size
from lightning_dos.model.step_report import StepReport
from lightning_dos.planning.speculation import CommitPolicy

#: Planner signature: given the step about to run, return its plan and the predicted update time. A planner may
#: also have ``wants_phases`` (True when its plan depends on forward and backward times) and
#: ``observe_phases(forward_s, backward_s)``, which the adapter then calls with measured times.
Planner = Callable[[int], tuple[Plan, float | None]]


class ZeRO3Adapter(ForwardGathers, BackwardHooks, NeedRecording, StateAccess):
    """Hands DeepSpeed's ZeRO-3 update phase to an :class:`InterleavedUpdate` engine.

    Args:
        zero_optimizer: ``deepspeed_engine.optimizer`` after ``deepspeed.initialize``.
        sub_group_size: largest number of elements per engine sub-group, or ``"auto"`` to size it from this
            rank's partition (:func:`~lightning_dos.model.plan.auto_sub_group_size`).
        gpu_memory_budget: device bytes the update may use (None: derived from free memory).
        pin: pin the engine's host slabs.
        streams_factory: builds the engine's streams for the model's device; None uses the real ones.
        optimizer: the optimizer ``configure_optimizers`` returned, whose param groups hold the hyperparameters
            (LR schedules change them there). None: DeepSpeed's inner optimizer, which is that same object except
            for ``torch.optim.Adagrad``, which DeepSpeed rebuilds over its flat partitions from the defaults alone.
        overlap: ``"forward"``: :meth:`step` returns while the engine's update runs on a background thread; each
            all-gather of the next forward first waits for the sub-groups holding its parameters, and
            :meth:`finish_update` (called by the framework before backward, evaluation, checkpoints, teardown)
            waits for the whole update. ``"auto"``: ``"forward"``, and the step begins during backward: each
            host sub-group is updated once backward has made its gradient final (only valid when
            :func:`backward_overlap_blocker` finds nothing; speculatively where the strategy reserved spare
            slots, see :attr:`speculative` and :func:`speculation_reason`). ``"off"``: the step returns once the
            update is over.
            (:mod:`lightning_dos.model.overlap`: what runs, after the strategy resolved its setting.)
    """

    def __init__(
        self,
        zero_optimizer: object,
        sub_group_size: int | str,
        gpu_memory_budget: int | None = None,
        pin: bool = True,
        streams_factory: Callable[[torch.device], Streams] | None = None,
        optimizer: object | None = None,
        overlap: Overlap = OFF,
        nvme: NvmeTier | None = None,
        rank: int = 0,
    ) -> None:
        check_zero3_optimizer(zero_optimizer)
        self.overlap = check_overlap(overlap)
        self.zero = z = zero_optimizer
        if optimizer is not None:
            _regroup_rebuilt_adagrad(z, optimizer)
        self.inner = z.optimizer
        #: Where each step's hyperparameters are read.
        self.hyper_source = optimizer if optimizer is not None else z.optimizer
        self.flats: list[torch.Tensor] = list(z.fp32_partitioned_groups_flat)
        lp = z.fp16_partitioned_groups_flat
        numels = [f.numel() for f in self.flats]
        #: The engine's sub-group size in elements ("auto" resolved against this rank's partition).
        self.sub_group_size = auto_sub_group_size(sum(numels)) if sub_group_size == "auto" else int(sub_group_size)
        device = engine_device(_accelerator_device(), lp[0].device)
        self.engine = InterleavedUpdate(
            flat_numels=numels,
            flat_param_groups=[z.sub_group_to_group_id[i] for i in range(len(self.flats))],
            sub_group_size=self.sub_group_size,
            device=device,
            lp_dtype=lp[0].dtype,
            pin=False,  # registered below, once DeepSpeed's fp32 master partitions are gone
            gpu_memory_budget=gpu_memory_budget,
            streams=streams_factory(device) if streams_factory is not None else None,
            # Only offloaded 16-bit parameters are "on the host": on a simulated accelerator the model's own
            # 16-bit partitions sit in CPU memory too, standing for device memory.
            lp_device=lp[0].device if getattr(z, "offload_param", False) else None,
            rule=rule_of(self.inner),
            # DeepSpeed's master_weights_and_grads_dtype: bf16 under bf16_master_weights_and_grads.
            master_dtype=self.flats[0].dtype,
            state_dtype=state_dtype(self.inner, self.flats[0].dtype),
            # Resident sub-groups' gradients are copied on the device as backward makes them final (below), where
            # DeepSpeed has the boundary copy to watch (0.19.5 and later do).
            keep_resident_grads=hasattr(z, "_offload_grad_partition_at_boundary"),
        )
        files = self._open_files(nvme, rank) if nvme is not None else None
        freed = 0
        for i in range(len(self.flats)):
            freed += self._adopt_master(i)
            if files is not None:  # the NVMe tier: the partition's whole state, then its file-backed part to the file
                self._adopt_state(i)
                files.write_spans(sg.index for sg in self.engine.sub_groups if sg.ds_group == i and sg.index in files)
            # Keep the copy-then-free transient to about this much; with the tier, to one partition's state.
            if files is not None or freed >= TRIM_EVERY_BYTES:
                return_freed_memory()
                freed = 0
        if files is not None:
            files.settle()
        # DeepSpeed's replaced partitions (and its start-up temporaries) leave the resident set now.
        return_freed_memory()
        # Registering faults in and pins every page of the slabs: done before, beside DeepSpeed's fp32 master
        # partitions, it made start-up 4 B/param above the pre-flight figure (issue 32, point 5).
        if pin:
            registrar = self.engine.streams.host_registrar()
            self.engine.pool.register_host(registrar)
            self.engine.register_file_staging(registrar)  # streamed file-backed sub-groups move through those slabs
        #: Chooses each step's plan; the strategy installs the scheduler here.
        self.planner: Planner | None = None
        #: Optimizer steps called so far (the engine counts its own on the thread an overlapped update runs on).
        self._steps_called = 0
        #: This iteration's forward and backward marks, when it is measured for the planner.
        self._phases: IterationPhases | None = None
        # Under overlap the update's staging may be allocated beside the next forward: the engine sizes it within
        # what is spare at the forward/backward peak, which is measured every iteration (_measure_peak).
        self.engine.overlap_forward(overlaps_forward(self.overlap))
        self._peak_window = False
        self._peak = 0
        #: SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 arriving during an update are held until :meth:`deliver`.
        self.signals = SignalHold()
        #: Deliver held signals (and raise what interrupted the update) at the end of :meth:`step`. A
        #: framework whose own step bookkeeping comes later (Lightning's progress counters and LR
        #: schedule) sets this False and calls :meth:`deliver` once that bookkeeping is done.
        self.deliver_after_step = True
        self._interrupted: UpdateInterrupted | None = None
        # Shadow bound methods on this instance only: DeepSpeed's engine calls optimizer.step(), and its
        # checkpointing calls state_dict / load_state_dict / refresh_fp32_params.
        z.step = self.step
        self._wrap_state_access(z)
        #: Sub-groups of each parameter (by ZeRO-3's parameter id), filled as parameters are first gathered.
        self._param_sub_groups: dict[int, list[int]] = {}
        if overlaps_forward(overlap):
            self._wait_before_gathers(z)
        # The first training forward and backward say in which order the next forward needs the sub-groups.
        self._record_need_order(z)
        #: Updates begun during backward are speculative (gradient clipping or fp16 loss scaling: the strategy sets
        #: this once it has reserved the engine's spare slots), and the policy that stops them when they never pay.
        self.speculative = False
        self.commit_policy = CommitPolicy()
        #: The step begun during this backward (plan, inputs, step counts); None when none was.
        self._early: tuple[Plan, StepInputs, list[int]] | None = None
        #: Under overlap="auto", the plan made before backward for the step it begins: (step, plan, prediction).
        self._upcoming: tuple[int, Plan, float | None] | None = None
        #: Device bytes the update may use, sampled where the device holds what it holds during the update: at each
        #: step, after backward and before the update allocates; before the first, now (no forward has run).
        self._budget_at_update: int | None = self.engine.device_budget()
        if self.engine.footprint.grads_on_device:
            self._watch_gradients(z)
        self._mark_backward_ends(z)

    def _open_files(self, nvme: NvmeTier, rank: int) -> FileTier | None:
        """Open the rank's swap file for the sub-groups past the host budget (the NVMe tier), before any state is
        adopted: each partition's file-backed sub-groups are written to it as soon as their state is in the slabs
        (master weights and moments adopted), and their pages given back, so that start-up holds no more than a
        partition of the state beyond the host budget."""
        # "auto" is resolved by the strategy's pre-flight; unresolved (an adapter built by hand), nothing goes to files.
        budget = nvme.host_bytes if nvme.host_bytes is not None else nvme.host_budget
        first = self.engine.first_file_backed(budget) if isinstance(budget, int) else len(self.engine.sub_groups)
        # Slabs for the sub-group size, at most as many as the strategy's pre-flight counts (the largest may be less).
        sub_group = min(sum(self.engine.sizes), self.sub_group_size)
        slots = staging_slots(self.engine.footprint.optimizer_state * sub_group, len(self.engine.sub_groups) - first)
        return self.engine.keep_in_files(
            first, nvme.path, rank, load_aio(), slots=slots, write=False, block_size=nvme.block_size,
            queue_depth=nvme.queue_depth, threads=nvme.threads,
        )  # fmt: skip

    # -- overlapping the update with the next forward ---------------------------------------------

    # -- beginning the step during backward ------------------------------------------------------

    def finish_update(self, abandon: bool = False) -> None:
        """Wait for the update in flight (overlap) and raise, here, what interrupted it before any state
        changed (pre-step) or tore it; a post-step interruption is raised by :meth:`deliver`. Main thread only.

        Between a backward that began the step (overlap="auto") and the step itself there is nothing to wait
        for: the step cannot end before it is called. A reader there is refused (the state is neither pre- nor
        post-step), unless ``abandon`` (the framework is handling an exception, or tearing down): the begun step
        then stops, and the state is torn if it had changed anything."""
        if self.engine.arrivals is not None and not abandon:
            raise UpdateInFlightError(
                "lightning-dos: overlap='auto' began this step's update during backward, so between backward and the "
                "optimizer step the optimizer state is neither pre- nor post-step and cannot be read or written; do "
                "it after the step (on_train_batch_end) or use overlap='forward'"
            )
        try:
            self.engine.wait_all()
        except BaseException:
            self.release_signals()
            raise

    def settle(self) -> None:
        """Wait for the update in flight, then deliver what its hold kept (the next backward, evaluation, the
        end of training call this)."""
        self.finish_update()
        self.deliver()

    def _wait_if_main(self) -> None:
        """A reader on the main thread waits for the update in flight here (other threads wait on the guard)."""
        if threading.current_thread() is threading.main_thread():
            self.finish_update()

    def deliver(self) -> None:
        """Deliver the signals held since the last update began, then raise what interrupted it, if anything.

        Call once the step is fully recorded; the state is then post-step everywhere. With an update still in
        flight (overlap) and no signal held, nothing is delivered yet: the hold lasts until :meth:`settle`.
        """
        if self.engine.in_flight:
            if not self.signals.pending:
                return
            self.finish_update()
        failure, self._interrupted = self._interrupted, None
        try:
            self.signals.release()
        finally:
            if failure is not None:
                if isinstance(failure.error, Exception):
                    raise failure
                # Ctrl-C or SystemExit keep their type (Lightning shuts down gracefully on them).
                warnings.warn(str(failure), RuntimeWarning, stacklevel=2)
                raise failure.error

    def release_signals(self) -> None:
        """Deliver held signals only (when the framework is already handling an exception)."""
        if self._interrupted is not None:
            warnings.warn(str(self._interrupted), RuntimeWarning, stacklevel=2)
            self._interrupted = None
        self.signals.release()

    # -- keeping DeepSpeed's tensors as views of the engine's slabs -------------------------------

    # -- the step ------------------------------------------------------------------------------

    def _inverse_grad_scale(self, scaled_norm: torch.Tensor | float) -> float:
        """DeepSpeed's ``unscale_and_clip_grads`` factor, as one float for both sides of the loop."""
        z = self.zero
        combined_scale = z.loss_scale
        if z.clip_grad > 0.0:
            clip = ((scaled_norm / z.loss_scale) + 1e-6) / z.clip_grad
            clip = torch.clamp(torch.as_tensor(clip), min=1.0)
            combined_scale = clip * z.loss_scale
        return float(1.0 / combined_scale)

    @property
    def process_group(self) -> object:
        """DeepSpeed's data-parallel process group, where its gradients are reduced: the planner's collectives run
        on it too, so that every rank enters one communicator in one order (None: the default group)."""
        return self.zero.dp_process_group

    def _plan_now(self) -> tuple[Plan, float | None]:
        """The next step's plan, made in the device memory free at the update (handed to a planner that takes it)."""
        observe = getattr(self.planner, "observe_budget", None)
        if observe is not None:
            observe(self._budget_at_update)
        return self.next_plan()

    def next_plan(self) -> tuple[Plan, float | None]:
        if self.planner is None:
            from lightning_dos.model.plan import all_host

            return all_host(len(self.engine.sub_groups)), None
        return self.planner(self.engine.steps_taken + 1)

    def step(self, closure: object = None) -> None:
        """DeepSpeed 0.19's ZeRO-3 ``step`` with the sub-group loop replaced by the engine."""
        from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
        from deepspeed.runtime.zero.stage3 import OPTIMIZER_STEP_TIMER

        early, self._early = self._early, None
        self._steps_called += 1
        self._measure_peak()
        self._peak_window = False  # the next forward opens the next iteration's window
        self._hand_over_phases()
        if early is None:
            # Signals held by the previous step and not yet delivered by the framework go now: that step is fully
            # recorded by the time the next one begins (and the previous update, if it overlapped, is over).
            self.finish_update()
            self.deliver()
        z = self.zero
        z._pre_step()
        z._partition_all_parameters()
        z._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_norm = None
        if not z.overflow:
            scaled_norm = combine_grad_norm_groups(z._get_norm_groups())
            if is_invalid_grad_norm(scaled_norm):
                z.overflow = True
        # Backward's activations are gone and this step's update has allocated nothing yet: the device memory free
        # here is the update's, which the next plan made before backward (overlap="auto") is made in.
        self._budget_at_update = self.engine.device_budget()
        if early is not None:
            plan, predicted = early[0], early[1].predicted_s
        else:
            upcoming, self._upcoming = self._upcoming, None
            planned = upcoming is not None and upcoming[0] == self.engine.steps_taken + 1
            plan, predicted = (upcoming[1], upcoming[2]) if planned else self._plan_now()
        if z._loss_scale_update_and_overflow_cleanup():
            # fp16 overflow, or a gradient norm that is not finite: the step is skipped on every sub-group.
            if early is None:
                self.engine.skip(plan)
                return
            # The step begun during backward stops: speculative updates are undone; it raises (torn state) if it had
            # updated anything exactly (no clipping) already.
            self.engine.end_backward(False)
            self.finish_update()
            return
        z._global_grad_norm = scaled_norm / z.loss_scale

        timer_names = {OPTIMIZER_STEP_TIMER}
        z.timers(OPTIMIZER_STEP_TIMER).start()
        # A checkpoint saved by a signal handler, or from another thread, sees the state before this
        # point or after the step counts are stored with the weights; nothing in between.
        _run_step_hooks(self.inner, "pre")  # the engine's update is the inner optimizer's step
        self.signals.hold()
        try:
            if early is not None:
                # The rest of the step begun during backward runs now, with the real factor: speculative updates made
                # with another (the step is clipped) are undone and redone.
                self.engine.end_backward(True, inv_grad_scale=self._inverse_grad_scale(scaled_norm))
            else:
                with self.engine.guard.updating():
                    # Read on this thread: the LR schedule changes the hyperparameters right after the step returns.
                    steps, inputs = self._inputs(predicted, scaled_norm)
                    if self.overlap == OFF:
                        self._apply(plan, inputs, steps)
                if self.overlap != OFF:
                    self.engine.start(lambda: self._apply(plan, inputs, steps))
        except BaseException:
            # Pre-step (nothing changed) or torn: the step did not complete, so raise now.
            z.timers(OPTIMIZER_STEP_TIMER).stop()
            self.release_signals()
            raise
        z.timers(OPTIMIZER_STEP_TIMER).stop()
        _run_step_hooks(self.inner, "post")
        z._post_step(timer_names)
        if self.deliver_after_step:
            self.deliver()

    def _inputs(self, predicted: float | None, scaled_norm: torch.Tensor) -> tuple[list[int], StepInputs]:
        """This step's step counts and the engine's inputs (the inner optimizer's state adopted into the slabs)."""
        z = self.zero
        steps = [self._adopt_state(i) + 1 for i in range(len(self.flats))]
        inputs = StepInputs(
            grads=[flat.grad for flat in self.flats],
            lp_targets=list(z.fp16_partitioned_groups_flat),
            hypers=[hyper_of(self.hyper_source, group) for group in self.hyper_source.param_groups],
            steps=steps,
            inv_grad_scale=self._inverse_grad_scale(scaled_norm),
            predicted_s=predicted,
            predicted_iteration_s=getattr(self.planner, "iteration_predicted_s", None),
        )
        return steps, inputs

    def _apply(
        self, plan: Plan, inputs: StepInputs, steps: list[int], arrivals: GradientArrivals | None = None
    ) -> None:
        """The engine's step and the step counts stored with it; an interruption after the first
        change is finished and kept for :meth:`deliver`."""
        try:
            if self.engine.step(plan, inputs, arrivals).skipped:
                return  # begun during backward, then skipped (the norm is not finite) before anything changed
        except UpdateInterrupted as failure:
            if failure.state != PRE_STEP:
                self._interrupted = failure
            elif self.overlap == OFF:
                raise  # the step has not returned: the framework does not count it
            else:
                # Overlapped: the step returned and the framework counted it, so it is taken (on the host).
                self._interrupted = self.engine.take_on_host(inputs, failure)
        try:
            self._store_steps(steps)
        except BaseException as error:  # noqa: BLE001 - storing is idempotent: finish it, report later
            try:
                self._store_steps(steps, points=False)
            except BaseException as second:  # noqa: BLE001
                self._interrupted = None  # superseded: the state is no longer post-step
                self.engine.mark_torn(
                    f"lightning-dos: storing the step counts of optimizer step {self.engine.steps_taken} failed "
                    f"({type(error).__name__}: {error}, then {type(second).__name__}: {second}); the weights are "
                    "post-step but some step counts are not. Resume from the last checkpoint."
                )
                raise TornStateError(self.engine.torn) from error
            if self._interrupted is None:
                self._interrupted = UpdateInterrupted(
                    f"lightning-dos: {type(error).__name__}: {error} interrupted storing the step counts of "
                    f"optimizer step {self.engine.steps_taken}; they were all stored, so the optimizer state "
                    "is post-step",
                    POST_STEP,
                    error,
                )

    def _store_steps(self, steps: list[int], points: bool = True) -> None:
        z = self.zero
        for i, step in enumerate(steps):
            if points and self.engine.on_point is not None:
                self.engine.on_point("step_count", i)
            self._store_step(i, step)
            # The 16-bit partitions were written in place; re-point the parameters' views as DeepSpeed does.
            z._unflatten_partitioned_parameters(i)

    @property
    def last_report(self) -> StepReport | None:
        return self.engine.last_report


# -- evaluation from a checkpoint ------------------------------------------------------------------


def _run_step_hooks(inner: torch.optim.Optimizer, when: str) -> None:
    """The bookkeeping torch does around ``Optimizer.step``, whose body the engine replaces.

    The step hooks registered on the inner optimizer (and globally) run as torch would run them; after the
    step, the flag that an LR scheduler's wrapper of ``inner.step`` sets is set too, so the scheduler does
    not warn that it stepped before the optimizer (it did not: the engine's update is the optimizer step).
    """
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    if when == "pre":
        hooks = [*_global_optimizer_pre_hooks.values(), *inner._optimizer_step_pre_hooks.values()]
    else:
        hooks = [*inner._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()]
        inner._opt_called = True  # what torch.optim.lr_scheduler's step wrapper records
    for hook in hooks:
        hook(inner, (inner,), {})
