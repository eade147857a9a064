"""``DeepOptimizerStatesStrategy``: Lightning's DeepSpeed strategy with the Deep Optimizer States engine.

It always runs ZeRO stage 3 with the optimizer offloaded to pinned host memory, and after
``deepspeed.initialize`` hands the update phase to the engine (through :mod:`lightning_dos.integration.zero3`).
Unlike Lightning's stock strategy it also runs on ``accelerator="cpu"``: the engine's device side then
runs on the CPU device, slower but computing exactly the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dos.engine.streams import Streams
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import quiet
from lightning_dos.host.cores import HostPlacement
from lightning_dos.host.disk import check_nvme_path
from lightning_dos.host.host_threads import apply_host_threads, leave_training_core
from lightning_dos.host.ranks import Calibration, calibrate_together, reduce_min_over_ranks
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from lightning_dos.integration.held_signals import DeliverHeldSignals
from lightning_dos.integration.nvme_tier import (
    NvmeTier,
    check_host_budget,
    take_nvme_tier,
)
from lightning_dos.integration.optimizers import SUPPORTED, check_optimizer, rule_of
from lightning_dos.integration.overlap_mode import (
    plan_for_speculation,
    reserve_speculation,
    resolve_overlap,
)
from lightning_dos.integration.preflight import (
    HostFigure,
    config_footprint,
)
from lightning_dos.integration.settings import (
    DEEPSPEED_SUB_GROUP_SIZE,
    DESCRIPTION,
    check_arguments,
    check_master_dtypes,
    merge_required_config,
    validated_fraction,
)
from lightning_dos.integration.startup_checks import StartupChecks
from lightning_dos.integration.zero3 import (
    ZeRO3Adapter,
    load_zero3_weights_for_evaluation,
)
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import FractionSpec, auto_sub_group_size, coarse_share_warning
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.planning.calibrate import HOST_BUFFER_BYTES, Contention, calibrate, calibration_numel
from lightning_dos.planning.scheduler import PlacementScheduler

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LRSchedulerConfig
    from torch.optim import Optimizer

    from lightning_dos.engine.loop import InterleavedUpdate


class DeepOptimizerStatesStrategy(StartupChecks, DeepSpeedCPUStrategy):
    """ZeRO-3, the optimizer in host memory, updated on CPU and accelerator at once.

    Every iteration, a share of the optimizer's sub-groups streams to the accelerator and is updated
    there while the CPU updates the rest (Deep Optimizer States, Maurya et al. 2024). The result is plain
    Adam's whatever the placement: bit for bit on CPU, to float precision on a GPU (where the host and
    device fused kernels round differently).

    The update is atomic. SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 that arrive during it are held and
    delivered once Lightning has recorded the step (in ``on_train_batch_end``, before any other callback),
    so a handler that saves a checkpoint, such as Lightning's SLURM auto-requeue handler, saves a whole
    step; the delay is at most one update phase plus Lightning's bookkeeping of the step. A second SIGINT
    or SIGTERM in that time ends the process at once, even from an update hung in native code. A checkpoint
    saved from another thread waits for the update to end, so its optimizer state is whole (Lightning
    reads its own loop counters before that, unsynchronised: save resumable checkpoints from the training
    thread, as callbacks and signal handlers do). An exception inside the update leaves the
    state pre-step or post-step and says which (:class:`~lightning_dos.engine.atomic.UpdateInterrupted`).

    Args:
        gpu_fraction: share of the optimizer state's elements updated on the accelerator each iteration:
            ``"auto"`` (the performance model chooses; everything on the host when there is no accelerator),
            a number in [0, 1] (that share of elements, in whole sub-groups spread evenly), or ``"stride:K"``
            (the paper's rule: sub-group x on the accelerator when (x + 1) % K == 0).
        sub_group_size: elements per optimizer sub-group (the unit of placement and of streaming), or
            ``"auto"``: sized from the rank's partition so that placement can be fine (about 32 sub-groups, none
            under 1,048,576 elements nor over the paper's 1e8); the choice is logged once when fitting starts.
            An explicit size that leaves a fixed ``gpu_fraction`` far from the asked share is warned about.
        gpu_memory_budget: bytes of accelerator memory spare at the forward/backward peak that the engine may
            hold: ``"auto"`` may then keep optimizer state resident on the accelerator across iterations, and
            resident state plus the update's streaming buffers stay inside it. None (the default): nothing is
            kept on the accelerator between updates; each update's streaming buffers are sized from the memory
            free after backward (with overlap on, also within what was spare at the last forward/backward peak),
            less a 10% margin, and given back to torch's caching allocator once its device side is issued; the
            next forward begins only once they are given back (the host side still overlaps it).
        streams_factory: builds the engine's streams for the model's device; None (the default) uses the
            real ones. Tests and tools pass ``lightning_dos.sim``'s simulated accelerator here to check the
            engine's stream ordering on CPU; it is never chosen automatically.
        overlap: what the optimizer update overlaps, not what it computes: on CPU every mode gives bit-identical
            results; on a GPU placement depends on the mode, timings and free memory, so modes agree to float
            precision, and bit for bit only for the same placement. ``"auto"`` (the
            default): ``"forward"``, and the step begins during backward: each host sub-group is updated on a
            background thread as soon as backward has made its gradient final (the last layers' first),
            speculatively (see ``speculation_memory``); where it cannot (no speculation memory, optimizer state on
            NVMe) it runs as ``"forward"`` and says why once.
            ``"forward"``: the step returns while the update runs (host sub-groups on a background thread,
            device work on the engine's streams), and every all-gather of the next forward first waits for
            exactly the sub-groups holding the parameters it gathers; the next backward, evaluation, checkpoints,
            DeepSpeed's accessors and teardown wait for the whole update.
            ``"off"``: the step returns once the update is over.
        speculation_memory: host bytes per rank for speculative updates, which let ``overlap="auto"`` begin the
            update during backward: each host sub-group whose gradient is final is updated as if the step were taken
            and not clipped, out of place into a spare slot, its current state untouched; backward's end keeps the
            update (most steps) or drops it (a step DeepSpeed skips, its gradient norm not finite: nothing of it
            remains; a clipped step: updated again with the real factor), so every outcome is bit-identical to
            ``overlap="off"``. ``"auto"``: up to half the host memory the pre-flight finds spare, at most one slot
            per sub-group (about the optimizer state's size again); a number of bytes: that much (counted by the
            pre-flight); 0: off (``"auto"`` then runs as ``"forward"``). A run whose steps are all clipped stops
            speculating by itself (and says so).
        host_threads: torch threads of each rank for host Adam and casts. ``"auto"``: the CPUs the local
            ranks may use are split into disjoint sets, one per rank (its accelerator's NUMA node first, where
            sysfs tells), each rank is bound to its set and runs one thread per physical core of it; a binding
            the launcher already made disjoint is kept; with ``overlap`` on an accelerator, one thread fewer (a core
            for the training thread) where measured faster. A number: that many threads, binding left as launched.
        accelerator: the accelerator, usually chosen by the Trainer.
        stage: ZeRO stage; only 3 is valid (kept so that configs written for DeepSpeedStrategy parse).
        offload_optimizer: must stay True: the optimizer state lives in host memory.
        offload_optimizer_device: ``"cpu"``: the optimizer state lives in host memory; ``"nvme"``: the sub-groups
            past ``host_memory_budget`` keep theirs in one swap file per rank under ``nvme_path`` (a keyword argument
            of Lightning's ``DeepSpeedStrategy``, or the config's ``offload_optimizer.nvme_path``), read before
            their update and written back after it through DeepSpeed's async I/O op (``libaio``: the config's
            ``aio.block_size``, ``aio.queue_depth`` and ``aio.intra_op_parallelism`` apply). The result is the
            same bits as ``"cpu"``.
        host_memory_budget: with ``offload_optimizer_device="nvme"``, bytes of master weights and optimizer state
            each rank keeps in host memory (the first sub-groups; the rest on NVMe): ``"auto"`` (the default): 90%
            of what the pre-flight finds spare once everything else is counted; 0: all of it on NVMe. Ignored
            with ``"cpu"``.
        offload_parameters: also offload the 16-bit parameters to host memory (ZeRO-Infinity style).
        offload_params_device: ``"cpu"`` when ``offload_parameters`` is set (NVMe is not supported).
        config: a DeepSpeed config dict or JSON path; merged with what the engine requires (ZeRO-3, CPU
            optimizer offload, pinned memory), conflicting keys are refused. When given, DeepSpeed
            settings among these arguments are ignored, as in Lightning.
        logging_level: DeepSpeed's log level.
        parallel_devices: devices to run on, usually set by the Trainer.
        cluster_environment: the cluster environment, usually set by the Trainer.
        precision_plugin: precision plugin, usually set by the Trainer.
        process_group_backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPU, by default.
        timeout: collective-operation timeout.
        **kwargs: any other argument of Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`.
    """

    strategy_name = "dos"

    def __init__(
        self,
        gpu_fraction: float | str = "auto",
        sub_group_size: int | str = "auto",
        gpu_memory_budget: int | None = None,
        streams_factory: Callable[[torch.device], Streams] | None = None,
        host_threads: int | str = "auto",
        overlap: str = "auto",
        speculation_memory: int | str = "auto",
        host_memory_budget: int | str = "auto",
        accelerator: Accelerator | None = None,
        stage: int = 3,
        offload_optimizer: bool = True,
        offload_optimizer_device: str = "cpu",
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        config: str | Path | dict[str, Any] | None = None,
        logging_level: int = logging.WARN,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        quiet.install()  # the pinned libraries' known per-step deprecations and start-up chatter
        self.fraction: FractionSpec = validated_fraction(gpu_fraction)
        check_arguments(
            sub_group_size=sub_group_size,
            gpu_memory_budget=gpu_memory_budget,
            host_threads=host_threads,
            overlap=overlap,
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_optimizer_device=offload_optimizer_device,
            offload_parameters=offload_parameters,
            offload_params_device=offload_params_device,
            streams_factory=streams_factory,
            speculation_memory=speculation_memory,
            deepspeed_kwargs=kwargs,
        )
        #: What the update overlaps: "off", "forward" or "auto" (as asked; see ``dos_adapter.overlap`` for what runs).
        self.overlap = overlap
        self.speculation_memory = speculation_memory
        #: Host bytes this rank may hold for speculative updates, decided by the pre-flight (0: none).
        self._speculation_bytes = 0
        # Pinned host memory is what makes the engine's transfers asynchronous, so it is always on;
        # LightningCLI passes the parent's default (False) along, which is not a user's choice to honour.
        kwargs.pop("pin_memory", None)
        self.sub_group_size = sub_group_size
        self.gpu_memory_budget = gpu_memory_budget
        self.streams_factory = streams_factory
        self.host_threads = host_threads
        #: This rank's host threads and cores, once the process group is up.
        self.dos_host_placement: HostPlacement | None = None
        user_config = DeepSpeedStrategy._load_config(self, config)  # resolves a JSON path or the env var
        deepspeed_size = DEEPSPEED_SUB_GROUP_SIZE if sub_group_size == "auto" else sub_group_size
        user_zero = user_config.get("zero_optimization") if isinstance(user_config, dict) else None
        #: What the engine's sub-groups are sized by: a DeepSpeed config's own value wins, as it always has.
        self.engine_sub_group_size: int | str = (
            int(user_zero["sub_group_size"])
            if isinstance(user_zero, dict) and "sub_group_size" in user_zero
            else sub_group_size
        )
        super().__init__(
            accelerator=accelerator,
            stage=3,
            offload_optimizer=True,
            offload_optimizer_device=offload_optimizer_device,
            offload_parameters=offload_parameters,
            offload_params_device=offload_params_device,
            pin_memory=True,
            sub_group_size=deepspeed_size,
            config=user_config,
            logging_level=logging_level,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        check_host_budget(host_memory_budget)
        #: The NVMe tier the config asks for (``offload_optimizer.device: nvme``), taken out of DeepSpeed's config.
        self.dos_nvme: NvmeTier | None = take_nvme_tier(self.config, host_memory_budget)
        if self.dos_nvme is not None:  # a missing or unusable directory, named now (its room is counted at setup)
            check_nvme_path(self.dos_nvme.path)
        self.config = merge_required_config(self.config, deepspeed_size)
        self.dos_adapter: ZeRO3Adapter | None = None
        #: Chooses each step's plan (and predicts its update time) once fitting has started.
        self.dos_scheduler: PlacementScheduler | None = None
        #: Elements per host calibration buffer, sized from the rank's partition once the model is known.
        self._calibration_numel = HOST_BUFFER_BYTES // 4
        #: This rank's calibration (when, what it measured, what every rank uses), once fitting has started.
        self.dos_calibration: Calibration | None = None
        self._callbacks_of: list[Callback] | None = None
        #: This rank's pre-flight host-memory figure, once fitting has started (None before).
        self.dos_host_figure: HostFigure | None = None

    # -- public handles ---------------------------------------------------------------------------

    @property
    def dos_engine(self) -> InterleavedUpdate | None:
        """The engine, once ``fit`` has set the strategy up (None before, and outside fitting)."""
        return self.dos_adapter.engine if self.dos_adapter is not None else None

    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        assert self.lightning_module is not None
        one = f"DeepOptimizerStatesStrategy runs exactly one ({SUPPORTED})"
        try:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        except RuntimeError as error:
            if "multiple optimizers" not in str(error):
                raise
            raise DOSConfigError(f"configure_optimizers returned several optimizers; {one}") from error
        if len(optimizers) != 1:
            raise DOSConfigError(f"configure_optimizers returned {len(optimizers)} optimizers; {one}")
        if len(schedulers) > 1:
            raise DOSConfigError(f"configure_optimizers returned {len(schedulers)} LR schedulers; use at most one")
        check_optimizer(optimizers[0])
        check_master_dtypes(self.config, optimizers[0])
        return optimizers[0], schedulers[0] if schedulers else None

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        #: The optimizer configure_optimizers returned: its param groups hold each step's hyperparameters.
        self._dos_user_optimizer = optimizer
        if optimizer is not None:
            self._check_host_memory(model, optimizer)
            # Calibrate now, before DeepSpeed and the engine allocate the optimizer state: the measuring
            # buffers are freed by then, so they never add to the run's peak host memory (and on a GPU
            # the measurement sees a device with nothing else on it).
            elements = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
            partition = -(-elements // max(1, self.world_size))
            self._calibration_numel = calibration_numel(partition)
            # Every rank at once, as they share the node during the update; all then use the slowest rates.
            device, numel = self.root_device, self._calibration_numel
            footprint = config_footprint(self.config, rule_of(optimizer))
            size = self.engine_sub_group_size
            sub_group = auto_sub_group_size(partition) if size == "auto" else int(size)

            def measure() -> HardwareRates:
                contention = None
                if self.host_threads == "auto" and self.overlap != "off" and self.dos_host_placement is not None:
                    # Before calibrating: the update's rates are then measured on the threads it will run on.
                    self.dos_host_placement, contention = leave_training_core(
                        self.dos_host_placement, self.global_rank, device, numel, footprint, sub_group
                    )
                return _calibrated_rates(device, numel, footprint, contention, sub_group)

            self.dos_calibration = calibrate_together(measure, reduce_min_over_ranks(device))
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Once the process group is up (the local ranks' affinities are gathered through it), before host work.
        self.dos_host_placement = apply_host_threads(
            self.host_threads, self.local_rank, self.global_rank, self.root_device
        )

    def _on_optimizer_ready(self, ds_optimizer: Any) -> None:
        self.dos_adapter = adapter = ZeRO3Adapter(
            ds_optimizer,
            sub_group_size=self.engine_sub_group_size,
            gpu_memory_budget=self.gpu_memory_budget,
            streams_factory=self.streams_factory,
            optimizer=getattr(self, "_dos_user_optimizer", None),
            overlap=resolve_overlap(self.overlap, ds_optimizer, self._speculation_bytes, self.speculation_memory),
            nvme=self.dos_nvme,
            rank=self.global_rank,
        )
        spare = reserve_speculation(adapter, ds_optimizer, self._speculation_bytes)
        if spare and self.dos_host_figure is not None:  # counted with the rest of the rank's host memory
            self.dos_host_figure.items.append(("spare slots for speculative updates", spare))
        sizes = adapter.engine.sizes
        if self.engine_sub_group_size == "auto":
            rank_zero_info(
                f"lightning-dos: sub_group_size='auto' chose {adapter.sub_group_size:,} elements:\n"
                f"{len(sizes)} sub-group(s) over this rank's {sum(sizes):,} optimizer elements"
            )
        coarse = coarse_share_warning(
            self.fraction, sizes, adapter.sub_group_size, auto=self.engine_sub_group_size == "auto"
        )
        if coarse is not None:
            rank_zero_warn(coarse)
        numel, calibrated = self._calibration_numel, self.dos_calibration
        self.dos_scheduler = PlacementScheduler(
            self.fraction,
            self.dos_adapter.engine,
            calibrate=lambda device: calibrated.agreed if calibrated else _calibrated_rates(device, numel),
            # "auto" plans from inputs agreed by every rank, so all ranks run the same plan; on DeepSpeed's
            # data-parallel group, where its own collectives run (the adapter plans on the training thread, outside
            # backward, at points every rank reaches in the same order).
            reduce_min=reduce_min_over_ranks(self.root_device, adapter.process_group),
            # What the plan minimises: the update alone, or the iteration it overlaps.
            overlap=adapter.overlap,
            drive=self.dos_nvme.drive if self.dos_nvme is not None else None,
        )
        self.dos_adapter.planner = self.dos_scheduler
        plan_for_speculation(self.dos_scheduler, adapter)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint; for ``validate``/``test``/``predict`` read the weights without an optimizer.

        Fitting resumes through DeepSpeed as usual (weights, optimizer state, the engine's slabs). Evaluation
        builds an engine with no optimizer, for which DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint, so the
        fp32 master weights are read from the checkpoint's partitions instead (see
        :func:`~lightning_dos.integration.zero3.load_zero3_weights_for_evaluation`).
        """
        from lightning.pytorch.trainer.states import TrainerFn

        module = self.lightning_module
        if self.load_full_weights or module is None or module.trainer.state.fn == TrainerFn.FITTING:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.pytorch.strategies.deepspeed import _validate_checkpoint_directory

        _validate_checkpoint_directory(checkpoint_path)
        return load_zero3_weights_for_evaluation(
            module, str(checkpoint_path), rank=self.global_rank, strict=module.strict_loading
        )

    # -- an update is never torn: signals and checkpoints wait for the step to be recorded ---------

    def setup(self, trainer: pl.Trainer) -> None:
        if self.dos_adapter is not None:
            # The last fit's swap file, kept for a checkpoint saved after it, goes before this run's pre-flight counts
            # the drive's room: the DeepSpeed engine it belonged to is replaced.
            self.dos_adapter.engine.close_files()
        super().setup(trainer)
        if self.dos_adapter is None:
            return
        # Signals held during the update are delivered once Lightning has recorded the step (progress
        # counters, LR schedule), so that a checkpoint their handlers save is wholly post-step.
        self.dos_adapter.deliver_after_step = False
        if not any(isinstance(callback, DeliverHeldSignals) for callback in trainer.callbacks):
            trainer.callbacks.insert(0, DeliverHeldSignals())
        self._callbacks_of = trainer.callbacks

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.dos_adapter is not None:
            # Some iterations' forward and backward are timed for the placement (gpu_fraction="auto", overlap on).
            self.dos_adapter.forward_begins()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        # Lightning's automatic loop has already divided the loss by ``accumulate_grad_batches``; DeepSpeed's
        # ``engine.backward`` would divide it again (``scale_wrt_gas``), so gradients would reach the optimizer k
        # times smaller than under plain Lightning: clipping would act at k times the user's threshold and Adam's
        # eps would weigh k times more. Scale once, as plain Lightning does. (Manual optimization allows no
        # accumulation, so there the flag changes nothing.)
        kwargs.setdefault("scale_wrt_gas", False)
        if self.dos_adapter is not None:
            # Backward writes the host gradient buffers the update in flight reads (overlap): it waits first.
            self.dos_adapter.settle()
            self.dos_adapter.before_backward()
        result = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.dos_adapter is not None:
            self.dos_adapter.after_backward()
        return result

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        # From another thread, wait for an update in flight; from inside it, refuse clearly.
        adapter = self.dos_adapter
        if adapter is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        with adapter.reading_state("saving a checkpoint"):
            try:
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            finally:
                adapter.engine.release_file_copies()  # file-backed state read for the checkpoint leaves host memory

    def on_exception(self, exception: BaseException) -> None:
        if self.dos_adapter is not None:
            # An update in flight ends before anything (OnExceptionCheckpoint) reads the state; what interrupted
            # it was raised at a wait point already, or is superseded by the exception being handled.
            with contextlib.suppress(BaseException):
                self.dos_adapter.finish_update(abandon=True)
            self.dos_adapter.release_signals()
        super().on_exception(exception)

    def teardown(self) -> None:
        adapter = self.dos_adapter
        if adapter is not None:
            adapter.finish_update(abandon=True)  # nothing may run on the state while it is given back
            adapter.release_signals()
            adapter.deliver_after_step = True
            # Resident optimizer state comes home (the host slabs are the state of record after fit) and any
            # device staging an interrupted update left is given back.
            adapter.engine.release_device_memory()
            # The swap file's name goes, its staging slabs too; its records stay readable, through a descriptor
            # kept open, for a checkpoint saved after fit (as stock NVMe offload allows) until the next fit.
            adapter.keep_files_after_fit()
            # Pinned memory is given back now, not when the garbage collector finds this strategy: sweeps and
            # notebooks fit again in the same process.
            adapter.engine.pool.release_host()
        callbacks = self._callbacks_of
        if callbacks is not None:
            callbacks[:] = [c for c in callbacks if not isinstance(c, DeliverHeldSignals)]
            self._callbacks_of = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Replaces the builder the package registered before this module was loaded (see lightning_dos._register).
        strategy_registry.register("dos", cls, description=DESCRIPTION, override=True)


@functools.lru_cache(maxsize=8)
def _calibrated_rates(
    device: torch.device,
    numel: int,
    footprint: Footprint = ADAM_FP32,
    contention: Contention | None = None,
    sub_group: int | None = None,
) -> HardwareRates:
    """This machine's rates for ``device`` on host buffers of ``numel`` elements, for the engine's rule and dtypes,
    measured once per process, size and footprint (they do not change between fits), with ``contention`` when
    measured already."""
    return calibrate(device, numel, footprint=footprint, contention=contention, sub_group=sub_group)


if "dos" not in StrategyRegistry or StrategyRegistry["dos"]["strategy"] is not DeepOptimizerStatesStrategy:
    DeepOptimizerStatesStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DOSConfigError",
    "DeepOptimizerStatesStrategy",
]
