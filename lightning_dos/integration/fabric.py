"""``DOSFabricStrategy``: ``Fabric(strategy="dos")``, the Deep Optimizer States engine in a user's own Lightning Fabric
loop.

The same set-up as the Trainer's strategy (:class:`~lightning_dos.integration.setup.DOSSetup`) on Fabric's
:class:`~lightning.fabric.strategies.DeepSpeedStrategy`, on ``accelerator="cpu"`` as well as on GPUs. The loop calls
``fabric.backward(loss)`` and ``optimizer.step()``; DeepSpeed accumulates gradients over the config's
``gradient_accumulation_steps`` micro-batches (call ``optimizer.step()`` after each: it steps at the boundary) and
clips at ``gradient_clipping``. See docs/fabric.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed

from lightning_dos.engine.streams import Streams
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import quiet
from lightning_dos.host.extensions import announce_op_builds
from lightning_dos.host.rank_exit import settle_collectives_at_exit
from lightning_dos.integration.cpu_strategy import check_deepspeed_accelerator_is_cpu, check_fp16_runs_here
from lightning_dos.integration.metrics import engine_peak, step_metrics
from lightning_dos.integration.optimizers import SUPPORTED
from lightning_dos.integration.settings import DESCRIPTION, refuse
from lightning_dos.integration.setup import DOSSetup, begin, initialize_deepspeed, release_adapter, shows_setup

if TYPE_CHECKING:
    from torch.optim import Optimizer

#: Said for a second optimizer or a second ``fabric.setup``.
ONE = f"strategy='dos' trains one model with one optimizer ({SUPPORTED}): call fabric.setup(model, optimizer) once"
#: Said for ``fabric.clip_gradients``.
CLIP = (
    "fabric.clip_gradients is not available with strategy='dos' (DeepSpeed clips inside its step): set "
    "DOSFabricStrategy(gradient_clipping=<max norm>) or the DeepSpeed config's 'gradient_clipping' instead"
)


@shows_setup
class DOSFabricStrategy(DeepSpeedStrategy):
    """``Fabric(strategy="dos")``: ZeRO-3 with the optimizer in host memory, updated on CPU and accelerator at once,
    for a user's own Fabric loop.

    Every argument of :class:`~lightning_dos.integration.strategy.DeepOptimizerStatesStrategy` (``gpu_fraction``,
    ``sub_group_size``, ``gpu_memory_budget``, ``streams_factory``, ``host_threads``, ``overlap``,
    ``speculation_memory``, ``host_memory_budget``, ``offload_optimizer_device``, ``config``, ...) means the same
    here; the Trainer's ``gradient_clip_val`` is this strategy's ``gradient_clipping``.

    ``fabric.save`` and ``fabric.load`` read and write the state only once the update in flight has landed (the NVMe
    tier's records included); put an LR scheduler the loop steps in the saved state (Fabric saves and restores it
    as the user's state). :meth:`close` gives pinned memory and the swap file back (a finaliser does when the
    strategy is collected, or at exit). One model and one optimizer; ``fabric.backward(loss)``, not
    ``loss.backward()``; no ``fabric.clip_gradients``.

    Args:
        gradient_clipping: the global gradient norm DeepSpeed clips at (its config's ``gradient_clipping``): None
            (the default) takes the config's value, else 0.0, no clipping, as plain Fabric; a positive number clips
            there. Fabric never sets it, so without this DeepSpeed's own default (1.0) would clip silently.
        gpu_fraction: see ``DeepOptimizerStatesStrategy``.
        sub_group_size: see ``DeepOptimizerStatesStrategy``.
        gpu_memory_budget: see ``DeepOptimizerStatesStrategy``.
        streams_factory: see ``DeepOptimizerStatesStrategy``.
        host_threads: see ``DeepOptimizerStatesStrategy``.
        overlap: see ``DeepOptimizerStatesStrategy``.
        speculation_memory: see ``DeepOptimizerStatesStrategy``.
        host_memory_budget: see ``DeepOptimizerStatesStrategy``.
        accelerator: the accelerator, usually chosen by Fabric.
        stage: ZeRO stage; only 3 is valid.
        offload_optimizer: must stay True.
        offload_optimizer_device: ``"cpu"`` or ``"nvme"`` (with ``nvme_path``).
        offload_parameters: also offload the 16-bit parameters to host memory.
        offload_params_device: ``"cpu"`` when ``offload_parameters`` is set.
        config: a DeepSpeed config dict or JSON path, merged with what the engine requires.
        logging_level: DeepSpeed's log level.
        parallel_devices: devices to run on, usually set by Fabric.
        cluster_environment: the cluster environment, usually set by Fabric.
        precision: the precision plugin, usually set by Fabric.
        process_group_backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPU, by default.
        timeout: collective-operation timeout.
        **kwargs: any other argument of Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy`.
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
        gradient_clipping: float | None = None,
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
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        #: The engine's settings and this run's engine (shared with the Trainer's strategy); its fields are shown as
        #: read-only properties of the same names (``dos_adapter``, ``dos_engine``, ``dos_scheduler``, ...).
        self.dos_setup: DOSSetup
        load = functools.partial(DeepSpeedStrategy._load_config, self)
        self.dos_setup, user_config, deepspeed = begin(self, locals(), load, clip_setting="gradient_clipping")
        clip = _clipping(gradient_clipping, user_config)
        super().__init__(precision=precision, **deepspeed, **kwargs)
        self.config = self.dos_setup.required_config(self.config, host_memory_budget)
        # Written, so that the engine's speculation budget and DeepSpeed's step agree on whether steps are clipped.
        self.config["gradient_clipping"] = clip
        self._finalizer: weakref.finalize | None = None

    # -- running without CUDA, as the Trainer's strategy does ------------------------------------

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_environment()
            return
        check_deepspeed_accelerator_is_cpu()
        check_fp16_runs_here(str(self.precision.precision), self.config)
        # Fabric's DeepSpeedStrategy refuses non-CUDA accelerators here; DDP's set-up calls _setup_distributed.
        DDPStrategy.setup_environment(self)

    def _setup_distributed(self) -> None:
        settle_collectives_at_exit()  # see DeepSpeedCPUStrategy.setup_distributed
        announce_op_builds()
        # Fabric says "initializing deepspeed distributed" on every start, where the Trainer says nothing.
        with _level(logging.getLogger("lightning.fabric.utilities.distributed"), logging.WARNING):
            if self.root_device.type == "cuda":
                super()._setup_distributed()
            else:  # Fabric validates CUDA device indices here, which CPU devices do not have
                reset_seed()
                self._set_world_ranks()
                with quiet.known_prints_dropped():
                    self._init_deepspeed_distributed()
                if not self._config_initialized:
                    self._format_config()
                    self._config_initialized = True
        self.dos_setup.apply_host_threads()

    # -- one model, one optimizer, the engine attached -------------------------------------------

    def setup_module_and_optimizers(
        self, module: torch.nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Any, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise DOSConfigError(f"fabric.setup was given {len(optimizers)} optimizers; {ONE}")
        if self._deepspeed_engine is not None:
            raise DOSConfigError(f"fabric.setup was called again; {ONE}")
        self.dos_setup.check_optimizer(optimizers[0])
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def setup_module(self, module: torch.nn.Module) -> Any:
        if self._deepspeed_engine is not None:
            raise DOSConfigError(f"fabric.setup was called again; {ONE}")
        return super().setup_module(module)

    def _initialize_engine(
        self, model: torch.nn.Module, optimizer: Optimizer | None = None, scheduler: Any = None
    ) -> tuple[Any, Any, Any]:
        setup = self.dos_setup
        if optimizer is not None:
            setup.prepare(model, optimizer)
        index = self.root_device.index
        engine, ds_optimizer, ds_scheduler = initialize_deepspeed(
            self.config, model, optimizer, scheduler, index if index is not None else self.local_rank
        )
        if ds_optimizer is not None:
            setup.attach(ds_optimizer)
            setup.watch_forward(engine)  # the loop's training forward drives the adapter's forward_begins
            assert setup.dos_adapter is not None
            self._finalizer = weakref.finalize(self, release_adapter, setup.dos_adapter, False)
        return engine, ds_optimizer, ds_scheduler

    # -- each iteration ----------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        # DeepSpeed divides the loss by gradient_accumulation_steps (Fabric's loop does not, unlike the Trainer's).
        with self.dos_setup.backward():
            super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # Fabric's optimizer wrapper hands the ZeRO optimizer itself here (its check that DeepSpeed's engine is an
        # optimizer fails), so DeepSpeed would never count micro-batches: no accumulation boundary (every step would
        # take a gradient never reduced), no zeroing, no step count. The engine steps, as under the Trainer.
        engine = self._deepspeed_engine
        if engine is not None and optimizer is engine.optimizer:
            return engine.step()
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise DOSConfigError(CLIP)

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise DOSConfigError(CLIP)

    def last_step_metrics(self) -> dict[str, float]:
        """The last optimizer step's metrics as :class:`~lightning_dos.integration.callbacks.DOSMonitor` logs them
        (``dos/`` keys: the device's share, bytes and rates over the bus, the engine's update time and prediction,
        pinned host memory, speculation), ready for ``fabric.log_dict``; empty before the first step. Reading them
        waits for the update in flight."""
        adapter = self.dos_adapter
        if adapter is None:
            return {}
        adapter.finish_update()
        report = adapter.last_report
        if report is None:
            return {}
        peak = engine_peak(adapter.engine)
        return step_metrics(report, report.update_s, sum(peak) if peak is not None else 0.0)

    # -- checkpoints and the end -------------------------------------------------------------------

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any = None
    ) -> None:
        # The update in flight lands first (from another thread: waited for; from inside it: refused).
        with self.dos_setup.saving():
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        adapter = self.dos_adapter
        if adapter is not None:
            adapter.settle()  # the update in flight writes the weights and state the load replaces: it lands first
        try:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        finally:
            if adapter is not None:
                adapter.engine.release_file_copies()

    @property
    def on_cuda(self) -> bool:
        return self.dos_setup.on_cuda

    def close(self) -> None:
        """End training with this strategy: the update in flight lands (or is abandoned), pinned host memory and
        device staging are given back and the NVMe tier's swap file is removed, now. The weights stay readable.
        Called again, or by the finaliser after it, it does nothing."""
        if self._finalizer is not None:
            self._finalizer()

    def teardown(self) -> None:
        self.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Replaces the builder the package registered before this module was loaded (see lightning_dos._register).
        strategy_registry.register("dos", cls, description=DESCRIPTION, override=True)


@contextlib.contextmanager
def _level(logger: logging.Logger, level: int) -> Iterator[None]:
    """``logger`` at ``level`` at least, for the block."""
    before = logger.level
    logger.setLevel(max(level, before))
    try:
        yield
    finally:
        logger.setLevel(before)


def _clipping(gradient_clipping: float | None, user_config: dict[str, Any] | None) -> float:
    """The ``gradient_clipping`` the DeepSpeed config gets: the argument, else the config's, else 0.0 (none)."""
    if gradient_clipping is not None and (
        isinstance(gradient_clipping, bool)
        or not isinstance(gradient_clipping, (int, float))
        or not gradient_clipping >= 0
    ):
        raise refuse("gradient_clipping", gradient_clipping, "use None, 0.0 (no clipping) or a positive max norm")
    in_config = (user_config or {}).get("gradient_clipping")
    if gradient_clipping is not None and in_config is not None and float(in_config) != float(gradient_clipping):
        raise refuse(
            "gradient_clipping",
            gradient_clipping,
            f"the DeepSpeed config sets gradient_clipping={in_config}: set it in one place",
        )
    chosen = gradient_clipping if gradient_clipping is not None else in_config
    return float(chosen) if chosen is not None else 0.0


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "dos" not in STRATEGY_REGISTRY or STRATEGY_REGISTRY["dos"]["strategy"] is not DOSFabricStrategy:
        DOSFabricStrategy.register_strategies(STRATEGY_REGISTRY)


_register()

__all__ = ["DOSFabricStrategy"]
