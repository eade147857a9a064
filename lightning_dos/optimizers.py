"""Which user optimizers the engine can take over, and how to read their hyperparameters.

The engine replaces the optimizer's update with its own Adam kernels, so it accepts exactly the
Adam family whose formula it reproduces: ``torch.optim.Adam`` (L2 or decoupled decay),
``torch.optim.AdamW`` and DeepSpeed's ``DeepSpeedCPUAdam`` (Adam or AdamW mode). Anything else, or
an Adam variant the kernels do not implement (AMSGrad, maximize, no bias correction), is refused
before training starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_dos.engine.kernels import AdamHyper

SUPPORTED = "torch.optim.Adam, torch.optim.AdamW or deepspeed.ops.adam.DeepSpeedCPUAdam"


class UnsupportedOptimizerError(ValueError):
    """The optimizer returned by ``configure_optimizers`` cannot be run by the engine."""


def _is_deepspeed_cpu_adam(optimizer: Any) -> bool:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return False
    return isinstance(optimizer, DeepSpeedCPUAdam)


def check_optimizer(optimizer: Any) -> None:
    """Raise :class:`UnsupportedOptimizerError` unless the engine reproduces ``optimizer`` exactly."""
    name = type(optimizer).__name__
    if not (isinstance(optimizer, torch.optim.Adam) or _is_deepspeed_cpu_adam(optimizer)):
        raise UnsupportedOptimizerError(
            f"configure_optimizers returned {name}; DeepOptimizerStatesStrategy runs {SUPPORTED}"
        )
    for index, group in enumerate(optimizer.param_groups):
        for key, bad in (("amsgrad", True), ("maximize", True), ("bias_correction", False)):
            if key in group and bool(group[key]) == bad:
                raise UnsupportedOptimizerError(
                    f"{name} param group {index} sets {key}={group[key]}; DeepOptimizerStatesStrategy "
                    f"supports {key}={not bad} only"
                )


def is_decoupled(optimizer: Any, group: Mapping[str, Any]) -> bool:
    """Whether weight decay is decoupled (AdamW) for this param group."""
    if _is_deepspeed_cpu_adam(optimizer):
        return bool(optimizer.adam_w_mode)
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    return bool(group.get("decoupled_weight_decay", False))


def hyper_of(optimizer: Any, group: Mapping[str, Any]) -> AdamHyper:
    """The group's hyperparameters as they stand now (an LR scheduler may have just changed ``lr``)."""
    beta1, beta2 = group["betas"]
    return AdamHyper(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled=is_decoupled(optimizer, group),
    )


def uses_tensor_step(optimizer: Any) -> bool:
    """torch optimizers keep ``state['step']`` as a tensor, DeepSpeedCPUAdam as an int; we keep theirs."""
    return not _is_deepspeed_cpu_adam(optimizer)
