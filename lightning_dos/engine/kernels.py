"""Functional Adam kernels, the same formula on both sides.

Host and device sub-groups both go through torch's fused Adam kernels (``torch._fused_adamw_`` for
decoupled weight decay, ``torch._fused_adam_`` for L2), which are functional: the step count is
passed in, so a sub-group's count is right whichever side updated it last. Using one kernel family
on both sides is what makes the result independent of placement. On this project's CPU the fused
kernel is as fast as DeepSpeed's CPU Adam op (``bench/kernels.py`` measures both) and needs no
JIT build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one optimizer param group for one step.

    Attributes:
        lr: learning rate (read from the param group every step, so LR schedules apply).
        beta1: first-moment decay.
        beta2: second-moment decay.
        eps: term added to the denominator.
        weight_decay: weight-decay coefficient.
        decoupled: True for AdamW-style decoupled decay, False for Adam's L2 penalty.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """Apply one Adam step in place to ``param``, ``exp_avg`` and ``exp_avg_sq``.

    Args:
        param: fp32 master weights (1-D), updated in place.
        grad: fp32 gradient of the same shape, already unscaled and clipped.
        exp_avg: first moment, updated in place.
        exp_avg_sq: second moment, updated in place.
        step: 0-d float32 tensor on ``param``'s device holding the step number being applied
            (1 for the first step); the kernel reads it for bias correction and does not change it.
        hyper: the param group's hyperparameters.
    """
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """A 0-d step tensor made on ``device`` by a fill kernel (no host-to-device copy, no sync)."""
    return torch.full((), float(step), dtype=torch.float32, device=device)
