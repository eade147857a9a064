"""What one sub-group's optimizer update works on, as two values the update functions of
:mod:`lightning_dos.engine.kernels` take instead of eight arguments each: the sub-group's tensors, and the step it
applies to them. One of each is made per sub-group updated (per tile on torch's tiled path), never per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_dos.model.update_rules import Hyper


@dataclass(frozen=True)
class SubGroupTensors:
    """One sub-group's tensors, as an update reads and writes them.

    Attributes:
        param: master weights (1-D; fp32, or bf16 under bf16 master weights), updated in place.
        grad: gradient of the same shape and dtype, scaled by the loss scale and not yet clipped.
        states: the rule's state tensors in ``rule.states`` order (fp32 or bf16), updated in place.
        lp_out: where the fresh weights go in the model's dtype (bf16, fp16, or fp32 for an fp32 model), as many
            elements as ``param``; None for no copy.
    """

    param: torch.Tensor
    grad: torch.Tensor
    states: Sequence[torch.Tensor]
    lp_out: torch.Tensor | None = None

    def span(self, elements: slice) -> SubGroupTensors:
        """The same tensors' ``elements`` (views: an update of them updates these)."""
        lp_out = None if self.lp_out is None else self.lp_out[elements]
        return SubGroupTensors(self.param[elements], self.grad[elements], [s[elements] for s in self.states], lp_out)


@dataclass(frozen=True)
class UpdateStep:
    """The step an update applies: the same for every sub-group of a param group in one engine step.

    Attributes:
        step: 0-d float32 tensor on the sub-group's device holding the step number being applied (1 for the first
            step); the kernels read it and do not change it.
        hyper: the param group's hyperparameters.
        inv_grad_scale: what the gradient is multiplied by to unscale and clip it (1 / DeepSpeed's combined scale);
            1.0 leaves it as it is.
        step_number: ``step``'s value as a host number, for rules whose formula takes it as one (Adagrad), so that
            no formula reads ``step`` back (on a device, a host synchronisation); None: read ``step`` where needed.
    """

    step: torch.Tensor
    hyper: Hyper
    inv_grad_scale: float = 1.0
    step_number: float | None = None
