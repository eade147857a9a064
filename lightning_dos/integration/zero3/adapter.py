"""The one place that touches DeepSpeed's private ZeRO-3 optimizer attributes.

DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3.step`` runs a prologue (partition parameters, overflow
check, gradient norm, loss-scale update), then updates sub-groups one after another on the CPU with a
blocking cast and copy each, then an epilogue. The adapter keeps DeepSpeed's prologue and epilogue
and replaces the loop in between with the engine. It also moves the fp32 master weights and the Adam
moments into the engine's pinned slabs, as views that DeepSpeed's own checkpointing still finds in
their usual places, so a DeepSpeed checkpoint holds the engine's state and reloads into it.

Everything here is checked at start-up: a DeepSpeed release that renamed any of it fails with an
error naming the version, before the first step.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import POST_STEP, PRE_STEP, TornStateError, UpdateInFlightError, UpdateInterrupted
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.engine.recovery import take_on_host
from lightning_dos.engine.streams import Streams
from lightning_dos.host.hostmem import return_freed_memory
from lightning_dos.host.signals import SignalHold
from lightning_dos.integration.optimizers import (
    check_optimizer,
    hyper_of,
    initial_state,
    rule_of,
    state_dtype,
    state_keys,
    uses_tensor_step,
)
from lightning_dos.integration.phases import IterationPhases
from lightning_dos.model.overlap import AUTO, OFF, Overlap, check_overlap, overlaps_forward
from lightning_dos.model.plan import Plan, auto_sub_group_size
from lightning_dos.model.step_report import StepReport

#: The private attributes and methods of DeepSpeed's ZeRO-3 optimizer the adapter relies on.
REQUIRED_ATTRIBUTES = (
    "optimizer",
    "fp16_groups",
    "fp16_partitioned_groups_flat",
    "fp32_partitioned_groups_flat",
    "sub_group_to_group_id",
    "offload_optimizer",
    "swap_optimizer",
    "partial_offload",
    "loss_scale",
    "clip_grad",
    "overflow",
    "timers",
    "_pre_step",
    "_partition_all_parameters",
    "_overflow_check_and_loss_scale_update",
    "_loss_scale_update_and_overflow_cleanup",
    "_get_norm_groups",
    "_unflatten_partitioned_parameters",
    "_post_step",
    "state_dict",
    "load_state_dict",
    "refresh_fp32_params",
    "grad_position",
    "get_param_id",
    "get_full_hp_param",
    "set_full_hp_param",
    "get_local_fp32_param",
    "set_local_hp_param",
    "dtype",
    "step",
    "parameter_offload",
    "persistent_parameters",
    "dp_process_group",
    "independent_gradient_partition_epilogue",
)
#: Attributes the adapter uses when DeepSpeed has them and does without otherwise (each read guarded): the boundary
#: gradient copy it watches to keep resident sub-groups' gradients on the device (without: they are uploaded from
#: the host copy, and overlap="auto" runs as "forward"), unmanaged accumulation's boundary (without: nothing to
#: mark), the reduce stream the end-of-backward event is recorded on (without: the caller's stream), and feature
#: flags that only some versions have (without: the feature is not there, or parameters are not offloaded).
OPTIONAL_ATTRIBUTES = (
    "_offload_grad_partition_at_boundary",
    "finalize_gradient_accumulation_boundary",
    "reduce_and_partition_stream",
    "offload_param",
    "use_muon",
    "zenflow",
    "torch_autocast_gradscaler",
)
TESTED_DEEPSPEED = "0.19.5 to 0.19.8"
#: While adopting DeepSpeed's fp32 partitions, hand freed heap memory back after about this many bytes.
TRIM_EVERY_BYTES = 256 << 20

#: Planner signature: given the step about to run, return its plan and the predicted update time. A planner may
#: also have ``wants_phases`` (True when its plan depends on forward and backward times) and
#: ``observe_phases(forward_s, backward_s)``, which the adapter then calls with measured times.
Planner = Callable[[int], tuple[Plan, float | None]]

#: A planner that wants forward and backward times gets them from the 2nd iteration and every this many after
#: it: those iterations begin with no update in flight (their forward waits for nothing), which costs one
#: unoverlapped update each time.
MEASURE_PHASES_EVERY = 50


class DeepSpeedIncompatibleError(RuntimeError):
    """The installed DeepSpeed lacks something the engine needs."""


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def check_zero3_optimizer(zero_optimizer: object) -> None:
    """Fail with a clear message unless ``zero_optimizer`` is a ZeRO-3 optimizer the adapter understands."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    version = _deepspeed_version()
    if not isinstance(zero_optimizer, DeepSpeedZeroOptimizer_Stage3):
        raise DeepSpeedIncompatibleError(
            f"DeepOptimizerStatesStrategy needs DeepSpeed's ZeRO stage 3 optimizer, got "
            f"{type(zero_optimizer).__name__} (DeepSpeed {version})"
        )
    missing = [name for name in REQUIRED_ATTRIBUTES if not hasattr(zero_optimizer, name)]
    if missing:
        raise DeepSpeedIncompatibleError(
            f"DeepSpeed {version}'s ZeRO-3 optimizer lacks {', '.join(missing)}, which lightning-dos needs; "
            f"it is tested with DeepSpeed {TESTED_DEEPSPEED}. Install a tested version."
        )
    z = zero_optimizer
    if not z.offload_optimizer or z.swap_optimizer:
        raise DeepSpeedIncompatibleError(
            "DeepOptimizerStatesStrategy needs the optimizer offloaded to CPU memory "
            "(zero_optimization.offload_optimizer.device='cpu'); NVMe or no offload is not supported"
        )
    if getattr(z, "use_muon", False) or getattr(z, "zenflow", False) or getattr(z, "torch_autocast_gradscaler", None):
        raise DeepSpeedIncompatibleError(
            "DeepOptimizerStatesStrategy does not combine with DeepSpeed's Muon, ZenFlow or torch-autocast modes"
        )
    if z.partial_offload != 1.0:
        raise DeepSpeedIncompatibleError(
            f"zero_optimization.offload_optimizer.ratio={z.partial_offload} (TwinFlow) conflicts with "
            "DeepOptimizerStatesStrategy, which places sub-groups itself; leave ratio at 1.0"
        )
    if any(flat is None for flat in z.fp16_partitioned_groups_flat):
        raise DeepSpeedIncompatibleError("parameters offloaded to NVMe are not supported; use offload to 'cpu'")
    check_optimizer(z.optimizer)


def _regroup_rebuilt_adagrad(z: object, optimizer: object) -> None:
    """Give DeepSpeed's rebuilt ``torch.optim.Adagrad`` the user's param groups back.

    ZeRO-3 rebuilds a ``torch.optim.Adagrad`` over its flat partitions from the optimizer's defaults alone
    (``initialize_optimizer_states``), so it has one param group, while the sub-groups keep the user's group
    indices: saving a checkpoint then fails with an IndexError (``_set_fp32_optimizer_param_groups``) and every
    group runs the defaults' settings. Rebuilt here with one group per user group, each with its own settings
    and the flat partitions of that group.
    """
    inner = z.optimizer
    groups = optimizer.param_groups
    if not isinstance(inner, torch.optim.Adagrad) or inner is optimizer or len(inner.param_groups) == len(groups):
        return
    flats = z.fp32_partitioned_groups_flat
    members = [[f for i, f in enumerate(flats) if z.sub_group_to_group_id[i] == g] for g in range(len(groups))]
    if not all(members):  # a group with nothing on this rank: torch refuses an empty group; leave DeepSpeed's
        return
    settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    rebuilt = torch.optim.Adagrad([{**s, "params": m} for s, m in zip(settings, members, strict=True)])
    # Its state is keyed by the flat partitions; DeepSpeed's checkpoint code appends them to empty groups.
    for group in rebuilt.param_groups:
        group["params"] = []
    z.optimizer = rebuilt


def engine_device(accelerator_device: str | torch.device, lp_device: torch.device) -> torch.device:
    """The device the engine updates device sub-groups on: the accelerator DeepSpeed runs on.

    The 16-bit partitions say where DeepSpeed keeps the model's parameters, not where it computes: with
    parameter offload they live in host memory while training still runs on the accelerator.

    Args:
        accelerator_device: DeepSpeed's current device (``get_accelerator().current_device_name()``).
        lp_device: the device of the 16-bit partitions (``fp16_partitioned_groups_flat[0].device``).
    """
    if lp_device.type != "cpu":
        return lp_device
    return torch.device(accelerator_device)


def _accelerator_device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def backward_overlap_blocker(zero_optimizer: object) -> str | None:
    """Why the step cannot begin during backward with this ZeRO-3 optimizer (None: it can, exactly).

    A sub-group's update may start once its own gradient is final only when it needs nothing global: gradient
    clipping scales every gradient by the global norm, and fp16 loss scaling may skip the step on any overflow.
    (A non-finite norm in fp32 or bf16 makes DeepSpeed skip the step too: the engine stops at the first non-finite
    gradient it meets, and says so if it had updated anything by then.)"""
    z = zero_optimizer
    if z.clip_grad > 0.0:
        return f"gradient clipping (gradient_clip_val={z.clip_grad:g}) needs the global gradient norm"
    if z.dtype == torch.float16:
        return "fp16 loss scaling may skip the step on an overflow anywhere"
    if getattr(z, "swap_optimizer", False):
        return "the optimizer state is swapped to NVMe"
    if not hasattr(z, "_offload_grad_partition_at_boundary"):
        return f"DeepSpeed {_deepspeed_version()} has no _offload_grad_partition_at_boundary to watch"
    return None


class ZeRO3Adapter:
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
            :func:`backward_overlap_blocker` finds nothing). ``"off"``: the step returns once the update is over.
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
            # DeepSpeed has the boundary copy to watch (0.19.5 to 0.19.8 do).
            keep_resident_grads=hasattr(z, "_offload_grad_partition_at_boundary"),
        )
        freed = 0
        for i in range(len(self.flats)):
            freed += self._adopt_master(i)
            if freed >= TRIM_EVERY_BYTES:  # keep the copy-then-free transient to about this much
                return_freed_memory()
                freed = 0
        # DeepSpeed's replaced partitions (and its start-up temporaries) leave the resident set now.
        return_freed_memory()
        # Registering faults in and pins every page of the slabs: done before, beside DeepSpeed's fp32 master
        # partitions, it made start-up 4 B/param above the pre-flight figure (issue 32, point 5).
        if pin:
            self.engine.pool.register_host(self.engine.streams.host_registrar())
        #: Chooses each step's plan; the strategy installs the scheduler here.
        self.planner: Planner | None = None
        #: Optimizer steps called so far (the engine counts its own on the thread an overlapped update runs on).
        self._steps_called = 0
        #: This iteration's forward and backward marks, when it is measured for the planner.
        self._phases: IterationPhases | None = None
        # Under overlap the update's staging may be allocated beside the next forward: the engine sizes it within
        # what is spare at the forward/backward peak, which is measured every iteration (_measure_peak).
        self.engine.overlapping = overlaps_forward(self.overlap)
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

    # -- overlapping the update with the next forward ---------------------------------------------

    def _sub_groups_of_params(self, params: object) -> list[int]:
        """The engine's sub-groups holding ``params``' partitions (parameters without a gradient hold none)."""
        z, engine, found = self.zero, self.engine, set()
        for param in params:
            key = id(param)
            if key not in self._param_sub_groups:
                position = z.grad_position.get(z.get_param_id(param)) if param.requires_grad else None
                self._param_sub_groups[key] = engine.sub_groups_of(*position) if position is not None else []
            found.update(self._param_sub_groups[key])
        return sorted(found)

    def _wait_before_gathers(self, z: object) -> None:
        """Make every all-gather of ZeRO-3's parameter coordinator wait for the sub-groups it reads.

        The wait sits in the coordinator's all-gather rather than in a module pre-hook so that the parameters it
        prefetches for the modules after the current one are covered too."""
        coordinator = z.parameter_offload.get_param_coordinator()
        name = "_PartitionedParameterCoordinator__all_gather_params"
        gather = getattr(coordinator, name)
        engine = self.engine
        # On a GPU the gather's own stream waits for each sub-group's landing event (the host only waits until it
        # is issued), so the host goes on queueing the forward; elsewhere the host waits.
        stream = getattr(coordinator, "_PartitionedParameterCoordinator__allgather_stream", None)
        stream = stream if engine.device.type == "cuda" and isinstance(stream, torch.cuda.Stream) else None

        def all_gather_params(params: object, forward: bool) -> None:
            # During backward (arrivals open) the sub-groups updated early are those whose gradients are final:
            # backward has used their parameters already and gathers only the others, which nothing writes yet.
            if engine.in_flight and engine.arrivals is None:
                engine.wait_sub_groups(self._sub_groups_of_params(params), stream)
            return gather(params, forward)

        setattr(coordinator, name, all_gather_params)
        # deepspeed.zero.GatheredParameters (users' callbacks, checkpoint helpers) gathers through each parameter's
        # own all_gather, outside the coordinator: it waits for the update in flight's sub-groups too.
        for group in z.fp16_groups:
            for param in group:
                param.all_gather = self._waiting_all_gather(param, param.all_gather)
        self._defer_persistent_gather(z)

    def _defer_persistent_gather(self, z: object) -> None:
        """Leave DeepSpeed's re-gather of its persistent parameters at the end of the step to the next forward.

        DeepSpeed keeps small parameters (below ``stage3_param_persistence_threshold``: norms, biases) whole on
        every rank and re-gathers them all at the end of the step (``_post_step``). They sit in nearly every
        sub-group, so that gather would wait for the whole update in flight. The step's start
        (``_partition_all_parameters``) released them with every other parameter, so when the step's gather is
        left out, the coordinator gathers each when the next forward reaches its module, after waiting for just
        its sub-groups, like any other parameter."""
        engine, post_step = self.engine, z._post_step

        def deferred_post_step(timer_names: object) -> None:
            persistent = z.persistent_parameters
            if not engine.in_flight or not persistent:
                return post_step(timer_names)
            z.persistent_parameters = []  # _post_step's own gather is the only use of the list there
            try:
                return post_step(timer_names)
            finally:
                z.persistent_parameters = persistent

        z._post_step = deferred_post_step

    def _waiting_all_gather(self, owner: object, gather: Callable) -> Callable:
        engine = self.engine

        def all_gather(param_list: object = None, *args: object, **kwargs: object) -> object:
            if engine.in_flight and engine.arrivals is None:
                engine.wait_sub_groups(self._sub_groups_of_params(param_list or [owner]))
            return gather(param_list, *args, **kwargs)

        return all_gather

    # -- beginning the step during backward ------------------------------------------------------

    def _watch_gradients(self, z: object) -> None:
        """At each of DeepSpeed's copies of a reduced gradient partition into the host gradient buffers at the
        accumulation boundary: keep the device copy of resident sub-groups' part (no upload at the step), and under
        ``overlap="auto"`` learn when every element of an engine sub-group is final and hand it to the engine."""
        engine = self.engine
        #: Elements of each sub-group that backward has yet to make final this step (parameters without a gradient
        #: hold none; padding is never written).
        self._expected = [0] * len(engine.sub_groups)
        for flat, offset, numel in z.grad_position.values():
            for index, count in self._overlaps(flat, offset, numel):
                self._expected[index] += count
        self._missing: list[int] = []
        offload = z._offload_grad_partition_at_boundary

        def offload_at_boundary(param: object, grad_buffer: torch.Tensor, *args: object) -> None:
            offload(param, grad_buffer, *args)
            flat, offset, _ = z.grad_position[z.get_param_id(param)]
            if engine.resident:
                # On DeepSpeed's current stream too, so the event below covers it.
                engine.keep_gradient(flat, offset, grad_buffer)
            if self.overlap != AUTO:
                return
            # The copy was issued on DeepSpeed's current (reduce) stream: its event is when the gradient lands.
            landed = engine.streams.record(engine.streams.current)
            if self._early is None:
                self._begin_early()
            for index, count in self._overlaps(flat, offset, grad_buffer.numel()):
                self._missing[index] -= count
                if self._missing[index] == 0:
                    engine.grads_final(index, landed)

        z._offload_grad_partition_at_boundary = offload_at_boundary

    def _mark_backward_ends(self, z: object) -> None:
        """After DeepSpeed's end-of-backward epilogue, record an event on its reduce stream and hand it to the engine
        (:meth:`~lightning_dos.engine.loop.InterleavedUpdate.backward_ended`): every gradient copy into the host buffers
        and every kept gradient (``offload_at_boundary`` copies both on that stream) is queued before it, so the step
        waits for that work alone instead of the whole device. Unmanaged accumulation's boundary copy
        (``finalize_gradient_accumulation_boundary``) is issued on the caller's stream: marked there."""
        engine = self.engine

        def marked(method: Callable, stream: Callable[[], object]) -> Callable:
            def mark_after(*args: object, **kwargs: object) -> object:
                result = method(*args, **kwargs)
                engine.backward_ended(engine.streams.record(stream()))
                return result

            return mark_after

        def reduce_stream() -> object:  # the caller's stream where DeepSpeed has no reduce stream of its own
            has_own = hasattr(z, "reduce_and_partition_stream")
            return z.reduce_and_partition_stream if has_own else engine.streams.current

        z.independent_gradient_partition_epilogue = marked(z.independent_gradient_partition_epilogue, reduce_stream)
        if hasattr(z, "finalize_gradient_accumulation_boundary"):
            z.finalize_gradient_accumulation_boundary = marked(
                z.finalize_gradient_accumulation_boundary, lambda: engine.streams.current
            )

    def _overlaps(self, flat: int, offset: int, numel: int) -> Iterator[tuple[int, int]]:
        """(sub-group, elements) of flat partition ``flat``'s elements ``[offset, offset + numel)`` in each."""
        engine = self.engine
        for index in engine.sub_groups_of(flat, offset, numel):
            sg = engine.sub_groups[index]
            yield index, min(offset + numel, sg.ds_offset + sg.numel) - max(offset, sg.ds_offset)

    def _begin_early(self) -> None:
        """The first gradient of the step is final: take the plan made before backward, read the inputs, start the
        engine's step."""
        self._missing = list(self._expected)
        self._measure_peak()
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None or upcoming[0] != self.engine.steps_taken + 1:
            # Planning here would run the planner's collectives inside backward, in an order no rank agrees on.
            raise RuntimeError(
                "lightning-dos: a step began during backward with no plan made before it; the framework must call "
                "ZeRO3Adapter.before_backward before each backward"
            )
        _, plan, predicted = upcoming
        # No clipping and no fp16 loss scaling (backward_overlap_blocker): the unscale factor needs no norm.
        steps, inputs = self._inputs(predicted, 0.0)
        self._early = (plan, inputs, steps)
        self.signals.hold()  # the update has begun (a no-op off the main thread: see before_backward)
        self.engine.begin_early(lambda arrivals: self._apply(plan, inputs, steps, arrivals))

    def _measure_peak(self, begins: bool = False) -> None:
        """Under overlap, the most device memory held at once over this iteration's forwards and backwards (an
        accumulation's micro-batches together), handed to the engine as it is read (``forward_backward_peak``): the
        window opens at the first forward after a step (``begins``) and is read before and after each backward and
        at the step. On a GPU, ``torch.cuda.max_memory_allocated`` since a reset there (DOSMonitor resets it only at
        the batch's start and before backward, so each read still covers what came since the last)."""
        if self.overlap == OFF:
            return
        streams = self.engine.streams
        if begins:
            if not self._peak_window:
                streams.reset_peak()
                self._peak_window, self._peak = True, 0
            return
        if self._peak_window:
            peak = streams.peak_allocated()
            if peak is not None:
                self._peak = max(self._peak, peak)
                self.engine.forward_backward_peak = self._peak

    def forward_begins(self) -> None:
        """Called on the main thread as each training forward begins. In an iteration measured for the planner
        (see :data:`MEASURE_PHASES_EVERY`), the update in flight is waited for first, so that the forward's time
        is its own."""
        self._measure_peak(begins=True)
        if not getattr(self.planner, "wants_phases", False) or self._steps_called % MEASURE_PHASES_EVERY != 1:
            return
        if self._phases is None:
            self.settle()
            self._phases = IterationPhases(self.engine.device)
        self._phases.forward_begins()

    def before_backward(self) -> None:
        """Called on the main thread before each backward: the step may begin during it, so signals are held from
        here (on an accelerator backward's hooks run on other threads, and the main thread runs Python handlers
        only once backward returns, inside DeepSpeed's backward, where they would cut the begun step short).

        Under overlap="auto" the step's plan is made here, once per step (the first micro-batch's backward),
        on the training thread (the previous update is over): the planner's collectives must not run inside
        backward, where each rank reaches a gradient hook when its own buckets fill, and its re-plan holds the GIL.
        It plans in the device memory free at the update (sampled at the previous step), not what backward's
        activations leave free here."""
        self._measure_peak()
        if self.overlap == AUTO:
            step = self.engine.steps_taken + 1
            if self._upcoming is None or self._upcoming[0] != step:
                self._upcoming = (step, *self._plan_now())
        if self._phases is not None:
            self._phases.backward_begins()
        # Gradients kept by an earlier backward belong to a step that was read or dropped already.
        self.engine.discard_kept_gradients()
        if self.overlap == AUTO:
            self.signals.hold()

    def after_backward(self) -> None:
        """Called after each backward that returned: with no step begun (not an accumulation boundary), the
        signals held since :meth:`before_backward` are delivered now."""
        self._measure_peak()
        if self._phases is not None:
            self._phases.backward_ends()
        if self.overlap == AUTO and not self.engine.in_flight:
            self.deliver()

    def _hand_over_phases(self) -> None:
        """At the step of a measured iteration, give the planner its forward and backward times (zeros when a
        micro-batch missed a mark: every rank hands over at the same step, for the ranks plan together)."""
        phases, self._phases = self._phases, None
        if phases is not None:
            self.planner.observe_phases(*(phases.seconds() or (0.0, 0.0)))

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

    def _wrap_state_access(self, z: object) -> None:
        """Keep host slabs and resident device state consistent around DeepSpeed's checkpoint code."""
        engine = self.engine
        save, load, refresh = z.state_dict, z.load_state_dict, z.refresh_fp32_params

        def state_dict() -> dict:
            with self.reading_state("the optimizer's state_dict"):
                engine.flush_resident()  # the checkpoint reads the host slabs
                self._copy_group_settings(self.hyper_source, self.inner)  # the checkpoint holds the live settings
                return save()

        def load_state_dict(*args: object, **kwargs: object) -> None:
            self._wait_if_main()
            with engine.guard.reading("loading the optimizer's state"):
                load(*args, **kwargs)
                engine.drop_resident()  # the host slabs now hold the loaded state
                engine.torn = None
                self._copy_group_settings(self.inner, self.hyper_source)  # the next step runs the loaded ones

        def refresh_fp32_params() -> None:
            self._wait_if_main()
            with engine.guard.reading("refreshing the fp32 parameters"):
                refresh()
                engine.drop_resident()

        z.state_dict, z.load_state_dict, z.refresh_fp32_params = state_dict, load_state_dict, refresh_fp32_params
        self._wrap_param_accessors(z)

    @staticmethod
    def _copy_group_settings(source: object, target: object) -> None:
        """Copy every param-group setting (not the params) from ``source`` to ``target`` when they are two
        optimizers (DeepSpeed's rebuilt Adagrad and the user's): checkpoints save and load the inner one, while
        the user's LR scheduler and the engine use the user's."""
        if source is target or len(source.param_groups) != len(target.param_groups):
            return
        for theirs, ours in zip(source.param_groups, target.param_groups, strict=True):
            ours.update({key: value for key, value in theirs.items() if key != "params"})

    def _wrap_param_accessors(self, z: object) -> None:
        """Keep DeepSpeed's per-parameter accessors consistent with resident device state.

        ``deepspeed.utils.safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, their local
        variants and the ``safe_set_*`` family all go through these four ZeRO-3 methods, which read and
        write the host slabs. Before a read the parameter's resident sub-groups are brought home; after a
        write their device copies are dropped, so the next step uploads the written values.
        """
        engine = self.engine

        def sub_groups(param: torch.Tensor) -> list[int]:
            flat, offset, numel = z.grad_position[z.get_param_id(param)]
            return engine.sub_groups_of(flat, offset, numel)

        def reading(method: Callable) -> Callable:
            def read(param: torch.Tensor, *args: object, **kwargs: object) -> object:
                # Whole, like a checkpoint: after an update in flight on another thread, never a torn state.
                with self.reading_state("reading a parameter's fp32 or optimizer state"):
                    if engine.resident and param.requires_grad:
                        engine.flush_resident(sub_groups(param))
                    return method(param, *args, **kwargs)

            return read

        def writing(method: Callable) -> Callable:
            def write(value: torch.Tensor, param: torch.Tensor, *args: object, **kwargs: object) -> object:
                self._wait_if_main()
                with engine.guard.reading("writing a parameter's fp32 or optimizer state"):
                    touched = sub_groups(param) if engine.resident and param.requires_grad else []
                    # The rest of each touched sub-group must be current on the host before its copy is dropped.
                    engine.flush_resident(touched)
                    result = method(value, param, *args, **kwargs)
                    engine.drop_resident(touched)
                    return result

            return write

        z.get_full_hp_param = reading(z.get_full_hp_param)
        z.get_local_fp32_param = reading(z.get_local_fp32_param)
        z.set_full_hp_param = writing(z.set_full_hp_param)
        z.set_local_hp_param = writing(z.set_local_hp_param)

    @contextlib.contextmanager
    def reading_state(self, what: str) -> Iterator[None]:
        """Read the optimizer state whole: wait for an update in flight on another thread; refuse from
        inside the update itself, or when an interrupted update left the state torn."""
        self._wait_if_main()
        with self.engine.guard.reading(what):
            if self.engine.torn is not None:
                raise TornStateError(f"{what} refused: {self.engine.torn}")
            yield

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

    def _adopt_master(self, i: int) -> int:
        """Point DeepSpeed's master partition ``i`` at the engine's slab (copying its values in); return the
        bytes of DeepSpeed's own tensor that this frees."""
        view, flat = self.engine.param_view(i), self.flats[i]
        if flat.data.data_ptr() == view.data_ptr():
            return 0
        view.copy_(flat.data.reshape(-1))
        flat.data = view
        return view.numel() * view.element_size()

    def _adopt_state(self, i: int) -> int:
        """Make the inner optimizer's state for partition ``i`` views of the slabs; return its step count.

        Checked every step because loading a checkpoint replaces these tensors with new ones.
        """
        self._adopt_master(i)
        state = self.inner.state[self.flats[i]]
        engine = self.engine
        for name, key in zip(engine.rule.states, state_keys(self.inner), strict=True):
            view, current = engine.state_view(name, i), state.get(key)
            if current is None:
                view.fill_(initial_state(self.inner))
                state[key] = view
            elif current.data_ptr() != view.data_ptr():
                view.copy_(current.reshape(-1))
                state[key] = view
        return int(state.get("step", 0))

    def _store_step(self, i: int, step: int) -> None:
        state = self.inner.state[self.flats[i]]
        state["step"] = torch.tensor(float(step)) if uses_tensor_step(self.inner) else step

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
            # The step begun during backward stops; it raises (torn state) if it had updated anything already.
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
                self.engine.end_backward(True)  # the rest of the step begun during backward runs now
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
                self._interrupted = take_on_host(self.engine, inputs, failure)
        try:
            self._store_steps(steps)
        except BaseException as error:  # noqa: BLE001 - storing is idempotent: finish it, report later
            try:
                self._store_steps(steps, points=False)
            except BaseException as second:  # noqa: BLE001
                self._interrupted = None  # superseded: the state is no longer post-step
                self.engine.torn = (
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


def load_zero3_weights_for_evaluation(
    module: torch.nn.Module, checkpoint_dir: str, rank: int, strict: bool = True
) -> dict:
    """Load a ZeRO-3 checkpoint's fp32 master weights into ``module``'s ZeRO-3 partitions, with no optimizer.

    DeepSpeed 0.19's own ``load_checkpoint`` cannot do this for an inference engine (Lightning's
    ``validate/test/predict(ckpt_path=...)``): without optimizer states it falls back to
    ``optimizer._restore_from_bit16_weights()``, which the optimizer-less ``DeepSpeedZeRoOffload`` lacks,
    and the module states a ZeRO-3 checkpoint holds are empty placeholders. The weights live in the
    per-rank fp32 partitions, so they are read from there, one parameter at a time (memory-mapped, so a
    large model is never materialised whole), and each rank copies its own slice into ``param.ds_tensor``
    in ZeRO-3's layout (rank r holds elements ``[r * p, (r + 1) * p)`` of the flattened parameter). This
    works whatever world size wrote the checkpoint, and casts to the model's dtype exactly as training does.

    Args:
        module: the LightningModule whose parameters DeepSpeed partitioned (``ds_tensor`` set).
        checkpoint_dir: the checkpoint directory Lightning's DeepSpeed strategy wrote.
        rank: this process's rank in the data-parallel group.
        strict: refuse a checkpoint that lacks one of ``module``'s parameters or buffers.

    Returns:
        the checkpoint's client state (what Lightning stored beside the weights: loops, callbacks, ...).
    """
    import contextlib
    import io
    from pathlib import Path

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = Path(checkpoint_dir)
    latest = root / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints its progress
        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag, lazy_mode=True)
    expected = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
    missing = [name for name in expected if name not in state]
    if strict and missing:
        raise KeyError(f"checkpoint {checkpoint_dir} lacks {', '.join(missing)} (DeepSpeed {_deepspeed_version()})")
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name not in state:
                continue
            full = state[name].contiguous().reshape(-1)
            if not hasattr(param, "ds_tensor"):
                param.data.copy_(full.view_as(param))
                continue
            part = param.ds_tensor
            start = min(rank * part.numel(), full.numel())
            piece = full[start : start + part.numel()]
            part.data[: piece.numel()].copy_(piece)
        for name, buffer in module.named_buffers():
            if name in state:
                buffer.copy_(state[name].contiguous())
    model_states = sorted((root / tag).glob("*model_states.pt"))
    if not model_states:
        raise FileNotFoundError(f"{root / tag} holds no DeepSpeed model states; is {checkpoint_dir} a checkpoint?")
    client = torch.load(model_states[0], map_location="cpu", weights_only=False)
    for key in ("module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments"):
        client.pop(key, None)  # the weights, read above; what remains is Lightning's client state
    return client


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
