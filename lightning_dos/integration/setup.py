"""What both ``"dos"`` strategies share: :class:`DOSSetup`, the engine's settings and the run's state, from the
arguments checked before any work to the engine given back.

The Trainer's strategy (:class:`~lightning_dos.integration.strategy.DeepOptimizerStatesStrategy`) and Fabric's
(:class:`~lightning_dos.integration.fabric.DOSFabricStrategy`) each hold one and call it at the same points:
arguments (:meth:`DOSSetup.__init__`), the DeepSpeed config (:meth:`DOSSetup.required_config`), the process group up
(:meth:`DOSSetup.apply_host_threads`), the optimizer checked (:meth:`DOSSetup.check_optimizer`), the host's
pre-flight and calibration before DeepSpeed allocates (:meth:`DOSSetup.prepare`), ``deepspeed.initialize``
(:func:`initialize_deepspeed`), the engine attached (:meth:`DOSSetup.attach`) and the training forward watched
(:meth:`DOSSetup.watch_forward`), each backward (:meth:`DOSSetup.backward`), each checkpoint
(:meth:`DOSSetup.saving`) and the end (:meth:`DOSSetup.release`). The framework's facts (config, ranks, devices)
stay the strategy's: this object reads them from it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dos.engine.streams import Streams
from lightning_dos.host import quiet
from lightning_dos.host.cores import HostPlacement
from lightning_dos.host.disk import check_nvme_path
from lightning_dos.host.host_threads import apply_host_threads, leave_training_core
from lightning_dos.host.ranks import Calibration, calibrate_together, reduce_min_over_ranks
from lightning_dos.integration.nvme_tier import NvmeTier, check_host_budget, take_nvme_tier
from lightning_dos.integration.optimizers import check_optimizer, rule_of
from lightning_dos.integration.overlap_mode import plan_for_speculation, reserve_speculation, resolve_overlap
from lightning_dos.integration.preflight import HostFigure, config_footprint
from lightning_dos.integration.settings import (
    DEEPSPEED_SUB_GROUP_SIZE,
    check_arguments,
    check_master_dtypes,
    merge_required_config,
    validated_fraction,
)
from lightning_dos.integration.startup_checks import StartupChecks
from lightning_dos.integration.zero3 import ZeRO3Adapter
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import FractionSpec, auto_sub_group_size, coarse_share_warning
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.planning.calibrate import HOST_BUFFER_BYTES, Contention, calibrate, calibration_numel
from lightning_dos.planning.scheduler import PlacementScheduler

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_dos.engine.loop import InterleavedUpdate


class DOSSetup(StartupChecks):
    """The engine's settings and this run's engine, adapter, plan and figures, for one strategy.

    Args:
        strategy: the strategy this set-up belongs to; its ``config``, ``world_size``, ``global_rank``,
            ``local_rank``, ``root_device`` and ``parallel_devices`` are read from it when needed.
        clip_setting: how the framework's user sets gradient clipping, as messages name it.
        **settings: the strategy's arguments of the same names (see
            :class:`~lightning_dos.integration.strategy.DeepOptimizerStatesStrategy`), checked here before any work.
    """

    def __init__(
        self,
        strategy: Any,
        *,
        gpu_fraction: float | str,
        sub_group_size: int | str,
        gpu_memory_budget: int | None,
        streams_factory: Callable[[torch.device], Streams] | None,
        host_threads: int | str,
        overlap: str,
        speculation_memory: int | str,
        stage: int,
        offload_optimizer: bool,
        offload_optimizer_device: str,
        offload_parameters: bool,
        offload_params_device: str,
        deepspeed_kwargs: dict[str, Any],
        clip_setting: str = "gradient_clip_val",
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
            deepspeed_kwargs=deepspeed_kwargs,
        )
        self._strategy = strategy
        self.clip_setting = clip_setting
        #: What the update overlaps: "off", "forward" or "auto" (as asked; see ``dos_adapter.overlap`` for what runs).
        self.overlap = overlap
        self.speculation_memory = speculation_memory
        #: Host bytes this rank may hold for speculative updates, decided by the pre-flight (0: none).
        self._speculation_bytes = 0
        self.sub_group_size = sub_group_size
        #: What the engine's sub-groups are sized by (a DeepSpeed config's own value wins: :meth:`read_user_config`).
        self.engine_sub_group_size: int | str = sub_group_size
        self.gpu_memory_budget = gpu_memory_budget
        self.streams_factory = streams_factory
        self.host_threads = host_threads
        #: This rank's host threads and cores, once the process group is up.
        self.dos_host_placement: HostPlacement | None = None
        #: The NVMe tier the config asks for (``offload_optimizer.device: nvme``), taken out of DeepSpeed's config.
        self.dos_nvme: NvmeTier | None = None
        self.dos_adapter: ZeRO3Adapter | None = None
        #: Chooses each step's plan (and predicts its update time) once training has started.
        self.dos_scheduler: PlacementScheduler | None = None
        #: Elements per host calibration buffer, sized from the rank's partition once the model is known.
        self._calibration_numel = HOST_BUFFER_BYTES // 4
        #: This rank's calibration (when, what it measured, what every rank uses), once training has started.
        self.dos_calibration: Calibration | None = None
        #: This rank's pre-flight host-memory figure, once training has started (None before).
        self.dos_host_figure: HostFigure | None = None
        #: The optimizer the user built: its param groups hold each step's hyperparameters.
        self._user_optimizer: Any = None

    # -- the strategy's facts ----------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return self._strategy.config

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def root_device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._strategy.parallel_devices

    @property
    def on_cuda(self) -> bool:
        """Whether this rank trains on a CUDA device (the Trainer's and Fabric's accelerators alike)."""
        return self.root_device.type == "cuda"

    @property
    def dos_engine(self) -> InterleavedUpdate | None:
        """The engine, once set up (None before)."""
        return self.dos_adapter.engine if self.dos_adapter is not None else None

    # -- the DeepSpeed config ------------------------------------------------------------------------

    @property
    def deepspeed_sub_group_size(self) -> int:
        """The ``sub_group_size`` DeepSpeed is given (how it packs parameters into flat partitions)."""
        return DEEPSPEED_SUB_GROUP_SIZE if self.sub_group_size == "auto" else int(self.sub_group_size)

    def read_user_config(self, user_config: dict[str, Any] | None) -> None:
        """Take the engine's sub-group size from the user's DeepSpeed config where it sets one."""
        zero = user_config.get("zero_optimization") if isinstance(user_config, dict) else None
        if isinstance(zero, dict) and "sub_group_size" in zero:
            self.engine_sub_group_size = int(zero["sub_group_size"])

    def required_config(self, config: dict[str, Any], host_memory_budget: int | str) -> dict[str, Any]:
        """``config`` with the NVMe tier taken out of it (its directory checked now) and what the engine requires
        filled in; conflicting keys refused."""
        check_host_budget(host_memory_budget)
        self.dos_nvme = take_nvme_tier(config, host_memory_budget)
        if self.dos_nvme is not None:  # a missing or unusable directory, named now (its room is counted at setup)
            check_nvme_path(self.dos_nvme.path)
        return merge_required_config(config, self.deepspeed_sub_group_size)

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse, before any work, an optimizer or master-weight dtype the engine cannot run."""
        check_optimizer(optimizer)
        check_master_dtypes(self.config, optimizer)

    # -- set-up, in order ----------------------------------------------------------------------------

    def apply_host_threads(self) -> None:
        """Once the process group is up (the local ranks' affinities are gathered through it), before host work."""
        self.dos_host_placement = apply_host_threads(
            self.host_threads, self._strategy.local_rank, self.global_rank, self.root_device
        )

    def prepare(self, model: torch.nn.Module, optimizer: Optimizer) -> None:
        """The host's pre-flight (refused with the figures where it cannot hold the state) and the calibration,
        before DeepSpeed and the engine allocate the optimizer state: the measuring buffers are freed by then, so
        they never add to the run's peak host memory (and on a GPU the measurement sees a device with nothing else
        on it)."""
        self._user_optimizer = optimizer
        self._check_host_memory(model, optimizer)
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
            return calibrated_rates(device, numel, footprint, contention, sub_group)

        self.dos_calibration = calibrate_together(measure, reduce_min_over_ranks(device))

    def attach(self, ds_optimizer: Any) -> None:
        """Hand ``ds_optimizer``'s (DeepSpeed's ZeRO-3 optimizer's) update to the engine and plan it."""
        self.dos_adapter = adapter = ZeRO3Adapter(
            ds_optimizer,
            sub_group_size=self.engine_sub_group_size,
            gpu_memory_budget=self.gpu_memory_budget,
            streams_factory=self.streams_factory,
            optimizer=self._user_optimizer,
            overlap=resolve_overlap(
                self.overlap, ds_optimizer, self._speculation_bytes, self.speculation_memory, self.clip_setting
            ),
            nvme=self.dos_nvme,
            rank=self.global_rank,
        )
        spare = reserve_speculation(adapter, ds_optimizer, self._speculation_bytes, self.clip_setting)
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
            adapter.engine,
            calibrate=lambda device: calibrated.agreed if calibrated else calibrated_rates(device, numel),
            # "auto" plans from inputs agreed by every rank, so all ranks run the same plan; on DeepSpeed's
            # data-parallel group, where its own collectives run (the adapter plans on the training thread, outside
            # backward, at points every rank reaches in the same order).
            reduce_min=reduce_min_over_ranks(self.root_device, adapter.process_group),
            # What the plan minimises: the update alone, or the iteration it overlaps.
            overlap=adapter.overlap,
            drive=self.dos_nvme.drive if self.dos_nvme is not None else None,
        )
        adapter.planner = self.dos_scheduler
        plan_for_speculation(self.dos_scheduler, adapter)

    def watch_forward(self, ds_engine: torch.nn.Module) -> None:
        """Tell the adapter each training forward begins (a forward with gradients enabled), before DeepSpeed's
        first ZeRO-3 gather: a forward pre-hook on the DeepSpeed engine, so the Trainer's loop and a user's Fabric
        loop drive it alike. Evaluation (under ``no_grad``) is not a training forward."""
        adapter = self.dos_adapter
        if adapter is None:
            return

        def forward_begins(module: torch.nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                adapter.forward_begins()

        ds_engine.register_forward_pre_hook(forward_begins)

    # -- each iteration ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around DeepSpeed's backward: it writes the host gradient buffers the update in flight reads, so it waits
        first; the step may begin during it (overlap="auto")."""
        adapter = self.dos_adapter
        if adapter is not None:
            adapter.settle()
            adapter.before_backward()
        yield
        if adapter is not None:
            adapter.after_backward()

    @contextlib.contextmanager
    def saving(self, what: str = "saving a checkpoint") -> Iterator[None]:
        """Around a checkpoint's save: the update in flight lands first (from another thread: waited for; from
        inside the update: refused), and file-backed state read for it leaves host memory after."""
        adapter = self.dos_adapter
        if adapter is None:
            yield
            return
        with adapter.reading_state(what):
            try:
                yield
            finally:
                adapter.engine.release_file_copies()

    def on_exception(self) -> None:
        """An update in flight ends before anything reads the state; held signals are delivered."""
        adapter = self.dos_adapter
        if adapter is not None:
            # What interrupted it was raised at a wait point already, or is superseded by the exception being handled.
            with contextlib.suppress(BaseException):
                adapter.finish_update(abandon=True)
            adapter.release_signals()

    def release(self, keep_files: bool) -> None:
        """Give the engine's resources back now: see :func:`release_adapter`."""
        if self.dos_adapter is not None:
            release_adapter(self.dos_adapter, keep_files)


#: A strategy's own arguments :class:`DOSSetup` takes, by name.
SETTINGS = (
    "gpu_fraction", "sub_group_size", "gpu_memory_budget", "streams_factory", "host_threads", "overlap",
    "speculation_memory", "stage", "offload_optimizer", "offload_optimizer_device", "offload_parameters",
    "offload_params_device",
)  # fmt: skip
#: The arguments both strategies pass on to their Lightning ``DeepSpeedStrategy`` as given.
PASSED_ON = (
    "accelerator",
    "logging_level",
    "parallel_devices",
    "cluster_environment",
    "process_group_backend",
    "timeout",
)


def begin(
    strategy: Any,
    arguments: dict[str, Any],
    load_config: Callable[[Any], dict[str, Any] | None],
    clip_setting: str = "gradient_clip_val",
) -> tuple[DOSSetup, dict[str, Any] | None, dict[str, Any]]:
    """A strategy's start: its ``arguments`` (its ``__init__``'s, by name: :data:`SETTINGS`, :data:`PASSED_ON`,
    ``config`` and ``kwargs``) checked before any work. Returns its :class:`DOSSetup`, the user's DeepSpeed config
    (``load_config`` resolves a JSON path or the environment variable) and the arguments of its ``DeepSpeedStrategy``
    besides ``kwargs``: what the engine requires (ZeRO-3, the optimizer offloaded, pinned) and what is passed on.
    ``pin_memory`` leaves ``kwargs`` (always on: it is what makes the engine's transfers asynchronous; LightningCLI
    passes the parent's default, False, along, which is not a user's choice to honour); the strategy passes the rest
    on itself, as ``**kwargs`` (LightningCLI finds the parent's arguments it accepts that way)."""
    kwargs = arguments["kwargs"]
    setup = DOSSetup(
        strategy, **{name: arguments[name] for name in SETTINGS}, deepspeed_kwargs=kwargs, clip_setting=clip_setting
    )
    kwargs.pop("pin_memory", None)
    user_config = load_config(arguments["config"])
    setup.read_user_config(user_config)
    required = {
        "stage": 3,
        "offload_optimizer": True,
        "pin_memory": True,
        "sub_group_size": setup.deepspeed_sub_group_size,
        "config": user_config,
    }
    offload = ("offload_optimizer_device", "offload_parameters", "offload_params_device")
    passed = {name: arguments[name] for name in (*PASSED_ON, *offload)}
    return setup, user_config, {**required, **passed}


def release_adapter(adapter: ZeRO3Adapter, keep_files: bool) -> None:
    """The update in flight ends (abandoned if it had not), held signals are delivered, resident optimizer state comes
    home (the host slabs are the state of record) and device staging is given back, pinned memory is unpinned now,
    not when the garbage collector finds the strategy, and the swap file's name goes: its records stay readable
    through a descriptor kept open when ``keep_files`` (a checkpoint saved after ``fit``), else the file goes too."""
    adapter.finish_update(abandon=True)  # nothing may run on the state while it is given back
    adapter.release_signals()
    adapter.deliver_after_step = True
    adapter.engine.release_device_memory()
    if keep_files:
        adapter.keep_files_after_fit()
    else:
        adapter.engine.close_files()
    adapter.engine.pool.release_host()


def initialize_deepspeed(
    config: dict[str, Any], model: torch.nn.Module, optimizer: Any, lr_scheduler: Any, device_rank: int
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` with the device rank given explicitly (a CPU device has no index); returns the
    engine, the ZeRO optimizer and the LR scheduler."""
    import deepspeed

    model_parameters = filter(lambda p: p.requires_grad, model.parameters())
    engine, ds_optimizer, _, scheduler = deepspeed.initialize(
        args=argparse.Namespace(device_rank=device_rank),
        config=config,
        model=model,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dist_init_required=False,
    )
    return engine, ds_optimizer, scheduler


@functools.lru_cache(maxsize=8)
def calibrated_rates(
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


#: What a strategy shows of its :class:`DOSSetup` (read-only, by the same names): callbacks, tools and tests read them.
SHOWN = (
    "dos_adapter",
    "dos_engine",
    "dos_scheduler",
    "dos_calibration",
    "dos_host_figure",
    "dos_host_placement",
    "dos_nvme",
    "fraction",
    "overlap",
    "speculation_memory",
    "engine_sub_group_size",
    "streams_factory",
    "host_threads",
)


def shows_setup(cls: type) -> type:
    """Give strategy class ``cls`` a read-only property for each of :data:`SHOWN`, read from its ``dos_setup``."""

    def shown(name: str) -> property:
        return property(lambda self: getattr(self.dos_setup, name), doc=f"``dos_setup.{name}``")

    for name in SHOWN:
        setattr(cls, name, shown(name))
    return cls
