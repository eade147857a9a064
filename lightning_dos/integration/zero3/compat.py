"""What the adapter requires of DeepSpeed, checked before any work: its ZeRO-3 optimizer's attributes
(every one the adapter reads), the offload configuration it supports, and what blocks updating during
backward."""

from __future__ import annotations

import torch

from lightning_dos.integration.optimizers import (
    check_optimizer,
)

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


TESTED_DEEPSPEED = "0.19.8"  # 0.19.0-0.19.7 lack _loss_scale_update_and_overflow_cleanup


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
    """Why the step cannot begin during backward with this ZeRO-3 optimizer at all (None: it can, speculatively:
    :func:`speculation_reason`)."""
    z = zero_optimizer
    if getattr(z, "swap_optimizer", False):
        return "the optimizer state is swapped to NVMe"
    if not hasattr(z, "_offload_grad_partition_at_boundary"):
        return f"DeepSpeed {_deepspeed_version()} has no _offload_grad_partition_at_boundary to watch"
    return None


def speculation_reason(zero_optimizer: object, clip_setting: str = "gradient_clip_val") -> str:
    """What makes a sub-group's update begun during backward provisional until backward ends: always something.

    DeepSpeed skips a step whose global gradient norm is not finite, in every precision (``is_invalid_grad_norm``),
    and only the whole gradient tells: an update begun during backward is therefore speculative
    (:mod:`lightning_dos.engine.speculation`), committed once the step is known to be taken and dropped when it is
    skipped. Gradient clipping also scales every gradient by the global norm, and fp16 loss scaling may skip the
    step on an overflow anywhere; the reason said names the first that applies (clipping as ``clip_setting``, the
    framework's setting of it)."""
    z = zero_optimizer
    if z.clip_grad > 0.0:
        return f"gradient clipping ({clip_setting}={z.clip_grad:g}) needs the global gradient norm"
    if z.dtype == torch.float16:
        return "fp16 loss scaling may skip the step on an overflow anywhere"
    return "DeepSpeed skips a step whose global gradient norm is not finite"
