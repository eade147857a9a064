"""Which user optimizers the engine can take over, and how to read them.

The engine replaces the optimizer's step with its own kernels for one of its update rules
(``lightning_dos.model.update_rules``: what each optimizer computes). This module maps the optimizer
``configure_optimizers`` returned onto a rule: which rule, under which keys the optimizer keeps each state tensor
(so DeepSpeed's checkpoints and accessors find the engine's state where they look), how it keeps its step count,
and how to read a param group's hyperparameters. Accepted:

- ``torch.optim.Adam`` (L2 or decoupled decay), ``torch.optim.AdamW`` and DeepSpeed's ``DeepSpeedCPUAdam``
  (Adam or AdamW mode): the ``adam`` rule;
- ``torch.optim.Adagrad`` and DeepSpeed's ``DeepSpeedCPUAdagrad``: the ``adagrad`` rule;
- DeepSpeed's ``DeepSpeedCPULion``: the ``lion`` rule.

Anything else, or a variant the kernels do not implement (AMSGrad, maximize, Adam without bias correction), is
refused before training starts, naming the setting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_dos.errors import DOSConfigError
from lightning_dos.model.update_rules import OPTIMIZER_RULES, Hyper, UpdateRule

SUPPORTED = (
    "torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, or DeepSpeed's DeepSpeedCPUAdam, "
    "DeepSpeedCPUAdagrad or DeepSpeedCPULion"
)


class UnsupportedOptimizerError(DOSConfigError):
    """The optimizer returned by ``configure_optimizers`` cannot be run by the engine."""


@dataclass(frozen=True)
class OptimizerBinding:
    """How one kind of user optimizer maps onto an engine rule.

    Attributes:
        rule: the engine's update rule.
        state_keys: the optimizer's state key of each of the rule's state tensors, in ``rule.states`` order.
        tensor_step: the optimizer keeps ``state['step']`` as a tensor (torch) rather than an int (DeepSpeed).
        hyper: reads a param group's hyperparameters for one step.
        refused: ``(key, refused value)`` pairs of param-group settings the rule does not implement.
    """

    rule: UpdateRule
    state_keys: tuple[str, ...]
    tensor_step: bool
    hyper: Callable[[Any, Mapping[str, Any]], Hyper]
    refused: tuple[tuple[str, bool], ...] = field(default=())


def _group_hyper(group: Mapping[str, Any], *, betas: bool, eps: bool, **fixed: Any) -> Hyper:
    """The :class:`Hyper` of one param group: the learning rate and weight decay every rule reads, its ``betas`` and
    ``eps`` where the rule has them, and ``fixed`` (what the optimizer, not the group, decides)."""
    values = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]), **fixed}
    if betas:
        values["beta1"], values["beta2"] = (float(beta) for beta in group["betas"])
    if eps:
        values["eps"] = float(group["eps"])
    return Hyper(**values)


def _adam_hyper(optimizer: Any, group: Mapping[str, Any]) -> Hyper:
    return _group_hyper(group, betas=True, eps=True, decoupled=is_decoupled(optimizer, group))


def _adagrad_hyper(optimizer: Any, group: Mapping[str, Any]) -> Hyper:  # noqa: ARG001 - one signature for all
    # DeepSpeed's Adagrad has no lr_decay.
    return _group_hyper(group, betas=False, eps=True, lr_decay=float(group.get("lr_decay", 0.0)))


def _lion_hyper(optimizer: Any, group: Mapping[str, Any]) -> Hyper:  # noqa: ARG001 - one signature for all
    return _group_hyper(group, betas=True, eps=False, decoupled=True)


_ADAM_REFUSED = (("amsgrad", True), ("maximize", True), ("bias_correction", False))
_ADAM, _ADAGRAD, _LION = (OPTIMIZER_RULES[name] for name in ("adam", "adagrad", "lion"))
_TORCH_ADAM = OptimizerBinding(_ADAM, ("exp_avg", "exp_avg_sq"), True, _adam_hyper, _ADAM_REFUSED)
_DS_ADAM = OptimizerBinding(_ADAM, ("exp_avg", "exp_avg_sq"), False, _adam_hyper, _ADAM_REFUSED)
_TORCH_ADAGRAD = OptimizerBinding(_ADAGRAD, ("sum",), True, _adagrad_hyper, (("maximize", True),))
# DeepSpeedCPUAdagrad accepts amsgrad but ignores it; refused so nobody believes it ran.
_DS_ADAGRAD = OptimizerBinding(_ADAGRAD, ("exp_avg_sq",), False, _adagrad_hyper, (("amsgrad", True),))
_DS_LION = OptimizerBinding(_LION, ("exp_avg",), False, _lion_hyper)


def _deepspeed_class(module: str, name: str) -> type | None:
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):  # pragma: no cover - deepspeed is a dependency
        return None


def binding_of(optimizer: Any) -> OptimizerBinding:
    """The binding of ``optimizer``, or :class:`UnsupportedOptimizerError` naming what would run."""
    # DeepSpeed's CPU optimizers first: DeepSpeedCPUAdam is not a torch.optim.Adam, but check by class anyway.
    for module, name, binding in (
        ("deepspeed.ops.adam", "DeepSpeedCPUAdam", _DS_ADAM),
        ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad", _DS_ADAGRAD),
        ("deepspeed.ops.lion", "DeepSpeedCPULion", _DS_LION),
    ):
        cls = _deepspeed_class(module, name)
        if cls is not None and isinstance(optimizer, cls):
            return binding
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass of Adam
        return _TORCH_ADAM
    if isinstance(optimizer, torch.optim.Adagrad):
        return _TORCH_ADAGRAD
    raise UnsupportedOptimizerError(
        f"configure_optimizers returned {type(optimizer).__name__}; DeepOptimizerStatesStrategy runs {SUPPORTED}"
    )


def check_optimizer(optimizer: Any) -> None:
    """Raise :class:`UnsupportedOptimizerError` unless the engine reproduces ``optimizer`` exactly."""
    binding = binding_of(optimizer)
    name = type(optimizer).__name__
    for index, group in enumerate(optimizer.param_groups):
        for key, bad in binding.refused:
            if key in group and bool(group[key]) == bad:
                raise UnsupportedOptimizerError(
                    f"{name} param group {index} sets {key}={group[key]}; DeepOptimizerStatesStrategy "
                    f"supports {key}={not bad} only"
                )


def rule_of(optimizer: Any) -> UpdateRule:
    """The engine rule that runs ``optimizer``."""
    return binding_of(optimizer).rule


def state_keys(optimizer: Any) -> tuple[str, ...]:
    """The optimizer's state key of each of its rule's state tensors, in the rule's order."""
    return binding_of(optimizer).state_keys


def is_decoupled(optimizer: Any, group: Mapping[str, Any]) -> bool:
    """Whether Adam's weight decay is decoupled (AdamW) for this param group."""
    if hasattr(optimizer, "adam_w_mode"):  # DeepSpeedCPUAdam
        return bool(optimizer.adam_w_mode)
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    return bool(group.get("decoupled_weight_decay", False))


def hyper_of(optimizer: Any, group: Mapping[str, Any]) -> Hyper:
    """The group's hyperparameters as they stand now (an LR scheduler may have just changed ``lr``)."""
    return binding_of(optimizer).hyper(optimizer, group)


def uses_tensor_step(optimizer: Any) -> bool:
    """torch optimizers keep ``state['step']`` as a tensor, DeepSpeed's CPU optimizers as an int; we keep theirs."""
    return binding_of(optimizer).tensor_step


def state_dtype(optimizer: Any, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype the optimizer keeps its state in, given DeepSpeed's master dtype: DeepSpeed's CPU optimizers
    built with ``fp32_optimizer_states=False`` keep it in the parameters' dtype (bf16 under
    ``bf16_optimizer_states``), every other optimizer in fp32."""
    return torch.float32 if getattr(optimizer, "fp32_optimizer_states", True) else master_dtype


def initial_state(optimizer: Any) -> float:
    """The value a fresh state tensor starts at: torch Adagrad's ``initial_accumulator_value``, else 0."""
    if isinstance(optimizer, torch.optim.Adagrad):
        return float(optimizer.defaults.get("initial_accumulator_value", 0.0))
    return 0.0
