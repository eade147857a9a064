"""The strategy's settings checked before any work: its arguments, and the DeepSpeed config the engine runs under
(what it requires filled in, what it refuses)."""

from __future__ import annotations

import copy
from typing import Any

from lightning_dos.errors import DOSConfigError
from lightning_dos.model.overlap import MODES
from lightning_dos.model.plan import MAX_AUTO_SUB_GROUP, FractionSpec, parse_gpu_fraction

#: How ``"dos"`` is described in Lightning's strategy registry.
DESCRIPTION = "Deep Optimizer States: ZeRO-3 offload with interleaved CPU/GPU updates"
#: DeepSpeed's own ``sub_group_size`` (how it packs parameters into flat partitions) under ``"auto"``; the
#: engine then cuts those flats into sub-groups sized from the rank's partition.
DEEPSPEED_SUB_GROUP_SIZE = MAX_AUTO_SUB_GROUP


def refuse(setting: str, value: Any, valid: str) -> DOSConfigError:
    return DOSConfigError(f"{setting}={value!r} is not valid for DeepOptimizerStatesStrategy; {valid}")


def validated_fraction(value: float | str) -> FractionSpec:
    """``gpu_fraction`` parsed, or refused naming what would be valid."""
    try:
        return parse_gpu_fraction(value)
    except ValueError as error:
        raise DOSConfigError(str(error)) from None


def check_arguments(
    *,
    sub_group_size: Any,
    gpu_memory_budget: Any,
    host_threads: Any,
    overlap: Any,
    stage: Any,
    offload_optimizer: Any,
    offload_optimizer_device: Any,
    offload_parameters: Any,
    offload_params_device: Any,
    streams_factory: Any,
    speculation_memory: Any,
    deepspeed_kwargs: dict[str, Any],
) -> None:
    """Refuse, naming the argument and what would be valid, a strategy argument the engine cannot run (see
    :class:`~lightning_dos.integration.strategy.DeepOptimizerStatesStrategy` for each); ``deepspeed_kwargs`` are
    the other arguments given for Lightning's ``DeepSpeedStrategy``."""
    if sub_group_size != "auto" and (
        isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size <= 0
    ):
        raise refuse("sub_group_size", sub_group_size, "use 'auto' or a positive integer number of elements")
    if gpu_memory_budget is not None and (
        isinstance(gpu_memory_budget, bool) or not isinstance(gpu_memory_budget, int) or gpu_memory_budget < 0
    ):
        raise refuse("gpu_memory_budget", gpu_memory_budget, "use None or a non-negative number of bytes")
    if host_threads != "auto" and (
        isinstance(host_threads, bool) or not isinstance(host_threads, int) or host_threads < 1
    ):
        raise refuse("host_threads", host_threads, "use 'auto' or a positive integer number of threads")
    if overlap not in MODES:
        raise refuse("overlap", overlap, f"use one of {', '.join(map(repr, MODES))}")
    if speculation_memory != "auto" and (
        isinstance(speculation_memory, bool) or not isinstance(speculation_memory, int) or speculation_memory < 0
    ):
        raise refuse(
            "speculation_memory", speculation_memory, "use 'auto' or a non-negative number of bytes (0 turns it off)"
        )
    if stage != 3:
        raise refuse("stage", stage, "the engine works on ZeRO stage 3 only: use 3")
    if not offload_optimizer:
        raise refuse("offload_optimizer", offload_optimizer, "the optimizer state is always offloaded: use True")
    if offload_optimizer_device not in ("cpu", "nvme"):
        raise refuse(
            "offload_optimizer_device",
            offload_optimizer_device,
            "use 'cpu', or 'nvme' (with nvme_path) to keep what does not fit host_memory_budget on NVMe",
        )
    if offload_parameters and offload_params_device != "cpu":
        raise refuse("offload_params_device", offload_params_device, "use 'cpu' (NVMe is not supported)")
    for key in ("zero_optimization", "remote_device"):
        if key in deepspeed_kwargs and deepspeed_kwargs[key] not in (True, None):
            raise refuse(
                key, deepspeed_kwargs[key], "ZeRO-3 with CPU optimizer offload is always on; leave it at its default"
            )
    if streams_factory is not None and not callable(streams_factory):
        raise refuse("streams_factory", streams_factory, "use None or a callable taking the device")


def merge_required_config(config: dict[str, Any], sub_group_size: int) -> dict[str, Any]:
    """Return ``config`` with what the engine requires filled in; refuse keys that conflict with it.

    Required: ZeRO stage 3, optimizer offload to ``cpu`` with pinned memory (``pin_memory: false`` is refused in
    either offload section), TwinFlow's ``ratio`` left at
    1.0 (the engine places sub-groups itself), and ``zero_force_ds_cpu_optimizer`` off so that
    ``torch.optim.Adam``/``AdamW`` from ``configure_optimizers`` are accepted.
    """
    config = copy.deepcopy(config)
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise refuse("config['zero_optimization']", zero, "it must be a mapping with 'stage': 3")
    stage = zero.setdefault("stage", 3)
    if stage != 3:
        raise refuse("zero_optimization.stage", stage, "the engine works on ZeRO stage 3 only: use 3")
    offload = zero.get("offload_optimizer")
    if offload is None:
        offload = zero["offload_optimizer"] = {}
    if not isinstance(offload, dict):
        raise refuse("zero_optimization.offload_optimizer", offload, "use a mapping with device 'cpu'")
    device = str(offload.setdefault("device", "cpu")).lower()
    if device != "cpu":
        raise refuse(
            "zero_optimization.offload_optimizer.device",
            offload["device"],
            "the optimizer state must be offloaded to 'cpu', or to 'nvme' with nvme_path",
        )
    ratio = offload.get("ratio", 1.0)
    if ratio != 1.0:
        raise refuse(
            "zero_optimization.offload_optimizer.ratio",
            ratio,
            "TwinFlow's fixed ratio conflicts with the engine; use 1.0 and gpu_fraction instead",
        )
    _require_pinned(offload, "offload_optimizer")
    zero.setdefault("sub_group_size", sub_group_size)
    param_offload = zero.get("offload_param") or {}
    param_device = str(param_offload.get("device", "none")).lower()
    if param_device == "nvme":
        raise refuse("zero_optimization.offload_param.device", "nvme", "use 'cpu' or 'none'")
    if param_device == "cpu":
        _require_pinned(param_offload, "offload_param")
    if config.get("zero_force_ds_cpu_optimizer", False):
        raise refuse("zero_force_ds_cpu_optimizer", True, "leave it false: the engine runs torch Adam/AdamW itself")
    config["zero_force_ds_cpu_optimizer"] = False
    config.setdefault("zero_allow_untested_optimizer", True)
    return config


def check_master_dtypes(config: dict[str, Any], optimizer: Any) -> None:
    """Refuse, before DeepSpeed starts, a master-weight or optimizer-state dtype the engine cannot run.

    The engine runs what DeepSpeed itself accepts under ZeRO-3 offload: fp32 master weights, or bf16 master weights
    and gradients (``bf16.bf16_master_weights_and_grads``) with ``DeepSpeedCPUAdam``, its state in fp32 or, under
    ``bf16.bf16_optimizer_states``, in bf16 (``DeepSpeedCPUAdam(..., fp32_optimizer_states=False)``). DeepSpeed
    would refuse the other combinations with an assertion deep in its start-up; fp16 master weights it accepts,
    the engine does not run them.
    """
    bf16, fp16 = config.get("bf16") or {}, config.get("fp16") or {}
    if fp16.get("fp16_master_weights_and_grads", False):
        raise refuse(
            "fp16.fp16_master_weights_and_grads",
            True,
            "the engine keeps master weights in fp32 or (bf16.bf16_master_weights_and_grads) bf16: leave it false",
        )
    master, states = bf16.get("bf16_master_weights_and_grads", False), bf16.get("bf16_optimizer_states", False)
    if states and not master:
        raise refuse(
            "bf16.bf16_optimizer_states",
            True,
            "it needs bf16.bf16_master_weights_and_grads: true (DeepSpeed requires it)",
        )
    if not master:
        return
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if type(optimizer) is not DeepSpeedCPUAdam:
        raise refuse(
            "bf16.bf16_master_weights_and_grads",
            True,
            f"DeepSpeed keeps bf16 master weights only for DeepSpeedCPUAdam, and configure_optimizers returned "
            f"{type(optimizer).__name__}: return DeepSpeedCPUAdam, or leave bf16 master weights off",
        )
    if states and getattr(optimizer, "fp32_optimizer_states", True):
        raise refuse(
            "bf16.bf16_optimizer_states",
            True,
            "it needs the moments kept in bf16: build DeepSpeedCPUAdam(..., fp32_optimizer_states=False)",
        )


def _require_pinned(section: dict[str, Any], name: str) -> None:
    """Refuse ``pin_memory: false`` in an offload section, else set it true.

    Unpinned, the copies of that section's buffers become synchronous and silently remove the overlap the
    engine exists for; a contradicting key is refused, like every other one.
    """
    if section.get("pin_memory", True) is not True:
        raise refuse(
            f"zero_optimization.{name}.pin_memory",
            section["pin_memory"],
            "unpinned host buffers make their copies synchronous, which removes the overlap of transfers with "
            "the update: remove the key or set it to true (where the CUDA runtime refuses to pin the engine's "
            "slabs, they fall back to pageable memory by themselves, with a warning)",
        )
    section["pin_memory"] = True
