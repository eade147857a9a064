"""``DeepSpeedCPUStrategy``: Lightning's stock DeepSpeed strategy, able to run on CPU (the benchmarks' baseline, and
the base the Deep Optimizer States strategy attaches its engine to)."""

from __future__ import annotations

import argparse
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_dos.errors import DOSConfigError
from lightning_dos.host import quiet
from lightning_dos.host.extensions import announce_op_builds
from lightning_dos.host.rank_exit import settle_collectives_at_exit
from lightning_dos.integration.setup import initialize_deepspeed


class DeepSpeedCPUStrategy(DeepSpeedStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, able to run on CPU as well.

    Stock DeepSpeed behaviour otherwise (it is the baseline the benchmarks compare against). Lightning's
    strategy refuses non-CUDA accelerators; three changes lift that: skip the CUDA check in
    ``setup_environment``, skip CUDA device-index validation in ``setup_distributed``, and give
    ``deepspeed.initialize`` the local rank as ``device_rank`` where the device has no index.
    Arguments are those of ``DeepSpeedStrategy``.
    """

    # -- running without CUDA: the three changes Lightning's strategy needs ----------------------

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_environment()
            return
        check_deepspeed_accelerator_is_cpu()
        check_fp16_runs_here(str(getattr(self.precision_plugin, "precision", "")), self.config)
        # Lightning's DeepSpeedStrategy refuses non-CUDA accelerators here; skip to DDP's setup.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # At exit, the collectives in flight end and the process group goes while the interpreter is whole (a finished
        # gloo run aborted with SIGABRT without: lightning_dos/host/rank_exit.py).
        settle_collectives_at_exit()
        announce_op_builds()  # DeepSpeed's ops build from here on (its collectives' first), minutes on a small machine
        if self.root_device.type == "cuda":
            super().setup_distributed()
            return
        # Lightning validates CUDA device indices here, which CPU devices do not have.
        reset_seed()
        self.set_world_ranks()
        with quiet.known_prints_dropped():  # DeepSpeed prints that its CPU comm op loaded, on every start
            self._init_deepspeed_distributed()

    @property
    def _device_rank(self) -> int:
        # `root_device.index` is None on CPU; DeepSpeed wants an int.
        index = self.root_device.index
        return index if index is not None else self.local_rank

    # -- the seam where the engine attaches ----------------------------------------------------------

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        engine, ds_optimizer, _ = initialize_deepspeed(self.config, model, optimizer, lr_scheduler, self._device_rank)
        if ds_optimizer is not None:
            self._on_optimizer_ready(ds_optimizer)
        return engine, ds_optimizer

    def _on_optimizer_ready(self, ds_optimizer: Any) -> None:
        """Called right after ``deepspeed.initialize`` built the ZeRO optimizer (subclasses attach here)."""

    def _initialize_deepspeed_inference(self, model: Any) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
        inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )


def cpu_supports_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator accepts fp16 on this CPU (oneDNN fp16 kernels: AVX-512-FP16 or AMX-FP16)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def check_fp16_runs_here(precision: str, config: Any) -> None:
    """Refuse fp16 before any work where DeepSpeed's CPU accelerator would refuse it mid-setup.

    DeepSpeed runs fp16 on a CPU only where oneDNN has fp16 kernels (AVX-512-FP16 or AMX-FP16); elsewhere
    ``deepspeed.initialize`` fails deep inside with a message naming no setting. ``precision``: the framework's
    precision setting; ``config``: the DeepSpeed config.
    """
    config = config if isinstance(config, dict) else {}
    from_config = bool((config.get("fp16") or {}).get("enabled", False))
    if not (precision.startswith("16") or from_config) or cpu_supports_fp16():
        return
    setting, value = ("precision", precision) if precision.startswith("16") else ("config['fp16']['enabled']", True)
    raise DOSConfigError(
        f"{setting}={value!r} cannot run on this CPU: DeepSpeed's CPU accelerator supports fp16 only on CPUs with "
        "AVX-512-FP16 or AMX-FP16, which this one lacks; use precision='bf16-mixed' (or '32-true') instead"
    )


def check_deepspeed_accelerator_is_cpu() -> None:
    """Refuse a CPU run where DeepSpeed chose another accelerator (it chooses once per process)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()  # public: "cpu", "cuda", ... (no private of DeepSpeed outside the adapter)
    if name != "cpu":
        raise DOSConfigError(
            f"accelerator='cpu' was chosen but DeepSpeed selected its {name!r} accelerator; "
            "set the environment variable DS_ACCELERATOR=cpu before starting Python"
        )
