"""``DeepOptimizerStatesStrategy``: Lightning's DeepSpeed strategy with the Deep Optimizer States engine.

It always runs ZeRO stage 3 with the optimizer offloaded to pinned host memory, and after
``deepspeed.initialize`` hands the update phase to the engine (through :mod:`lightning_dos.integration.zero3`).
Unlike Lightning's stock strategy it also runs on ``accelerator="cpu"``: the engine's device side then
runs on the CPU device, slower but computing exactly the same thing.
"""

from __future__ import annotations

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

from lightning_dos.engine.streams import Streams
from lightning_dos.errors import DOSConfigError
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from lightning_dos.integration.held_signals import DeliverHeldSignals
from lightning_dos.integration.optimizers import SUPPORTED
from lightning_dos.integration.settings import DESCRIPTION
from lightning_dos.integration.setup import DOSSetup, begin, shows_setup
from lightning_dos.integration.zero3 import load_zero3_weights_for_evaluation

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LRSchedulerConfig
    from torch.optim import Optimizer


@shows_setup
class DeepOptimizerStatesStrategy(DeepSpeedCPUStrategy):
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
        #: The engine's settings and this run's engine (shared with Fabric's strategy); its fields are shown as
        #: read-only properties of the same names (``dos_adapter``, ``dos_engine``, ``dos_scheduler``, ...).
        self.dos_setup: DOSSetup
        self.dos_setup, _, deepspeed = begin(self, locals(), functools.partial(DeepSpeedStrategy._load_config, self))
        super().__init__(precision_plugin=precision_plugin, **deepspeed, **kwargs)
        self.config = self.dos_setup.required_config(self.config, host_memory_budget)
        self._callbacks_of: list[Callback] | None = None

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
        self.dos_setup.check_optimizer(optimizers[0])
        return optimizers[0], schedulers[0] if schedulers else None

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        if optimizer is not None:
            self.dos_setup.prepare(model, optimizer)
        engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        if ds_optimizer is not None:  # the Trainer's training forward drives the adapter's forward_begins
            self.dos_setup.watch_forward(engine)
        return engine, ds_optimizer

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.dos_setup.apply_host_threads()

    def _on_optimizer_ready(self, ds_optimizer: Any) -> None:
        self.dos_setup.attach(ds_optimizer)

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

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        # Lightning's automatic loop has already divided the loss by ``accumulate_grad_batches``; DeepSpeed's
        # ``engine.backward`` would divide it again (``scale_wrt_gas``), so gradients would reach the optimizer k
        # times smaller than under plain Lightning: clipping would act at k times the user's threshold and Adam's
        # eps would weigh k times more. Scale once, as plain Lightning does. (Manual optimization allows no
        # accumulation, so there the flag changes nothing.)
        kwargs.setdefault("scale_wrt_gas", False)
        with self.dos_setup.backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        # From another thread, wait for an update in flight; from inside it, refuse clearly.
        with self.dos_setup.saving():
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def on_exception(self, exception: BaseException) -> None:
        # An update in flight ends before anything (OnExceptionCheckpoint) reads the state.
        self.dos_setup.on_exception()
        super().on_exception(exception)

    def teardown(self) -> None:
        # Pinned memory is given back now, not when the garbage collector finds this strategy (sweeps and notebooks
        # fit again in the same process); the swap file's records stay readable for a checkpoint saved after fit.
        self.dos_setup.release(keep_files=True)
        callbacks = self._callbacks_of
        if callbacks is not None:
            callbacks[:] = [c for c in callbacks if not isinstance(c, DeliverHeldSignals)]
            self._callbacks_of = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Replaces the builder the package registered before this module was loaded (see lightning_dos._register).
        strategy_registry.register("dos", cls, description=DESCRIPTION, override=True)


if "dos" not in StrategyRegistry or StrategyRegistry["dos"]["strategy"] is not DeepOptimizerStatesStrategy:
    DeepOptimizerStatesStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DOSConfigError",
    "DeepOptimizerStatesStrategy",
]
