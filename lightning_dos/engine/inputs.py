"""What the framework hands the engine for one step (shared by the step loop and its recovery)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_dos.model.update_rules import Hyper


@dataclass
class StepInputs:
    """What one step needs from the framework, per DeepSpeed flat partition.

    Attributes:
        grads: gradient of each flat partition (fp32, or bf16 under bf16 master weights), in host memory
            (DeepSpeed's offload buffers).
        lp_targets: the model's 16-bit (or fp32) partition of each flat, where the updated parameters go.
        hypers: hyperparameters of each optimizer param group.
        steps: the step number to apply to each flat partition (1 for its first update).
        inv_grad_scale: factor that unscales and clips gradients (1 / DeepSpeed's combined scale).
        speculative: ``inv_grad_scale`` is a guess made before the global gradient norm was known (gradient
            clipping or fp16 loss scaling; the guess is "not clipped"): what a step begun during backward updates
            with it is kept undoable until backward's end gives the real factor
            (:mod:`lightning_dos.engine.speculation`).
        predicted_s: the performance model's prediction for this step's plan, if any.
        predicted_iteration_s: the whole iteration's prediction for this step's plan, if any.
    """

    grads: Sequence[torch.Tensor]
    lp_targets: Sequence[torch.Tensor]
    hypers: Sequence[Hyper]
    steps: Sequence[int]
    inv_grad_scale: float = 1.0
    speculative: bool = False
    predicted_s: float | None = None
    predicted_iteration_s: float | None = None
