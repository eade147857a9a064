"""What an optimizer is, to the engine: its state tensors, its hyperparameters and its element update.

Every optimizer the engine runs is one :class:`UpdateRule`, and this module is the only place that says
what each one computes. The rest of the engine is written against the rule: the buffer pool allocates one
slab per state tensor the rule names, the loop streams exactly those tensors, the performance model and the
planner count their bytes, the compiled host kernel (``native``) runs the rule's loop by its name and the
device side runs :meth:`UpdateRule.torch_update`. Adding an optimizer means adding a rule here and its loop
in ``host_adam.c``; nothing in the loop branches on which optimizer it runs.

The element updates, in fp32 (bf16 master weights or states are loaded into fp32, updated, and stored back
rounded to nearest even, as DeepSpeed's CPU optimizers store bf16 state):

- ``adam``: torch's fused Adam/AdamW (``torch._fused_adam_``/``torch._fused_adamw_``), bias-corrected.
- ``adagrad``: torch's ``Adagrad`` (its single-tensor path, torch's default on CPU):
  ``g += wd * p; sum += g * g; p -= lr / (1 + (step - 1) * lr_decay) * g / (sqrt(sum) + eps)``, with the
  square root correctly rounded (torch's own CPU ``sqrt`` is not; see :func:`_sqrt`).
  DeepSpeed's ``DeepSpeedCPUAdagrad`` is the same update with ``lr_decay = 0`` (it rounds ``g / (sqrt + eps)``
  then fuses the step; the two differ by float rounding).
- ``lion``: DeepSpeed's ``DeepSpeedCPULion`` (Chen et al. 2023):
  ``c = b1 * m + (1 - b1) * g; p = p * (1 - lr * wd) - lr * sign(c); m = b2 * m + (1 - b2) * g``, where the
  sign of ``c = 0`` is taken as DeepSpeed's ``copysign`` takes it (+1 for +0). The compiled host kernel rounds
  it as DeepSpeed's op does on the CPU it runs on, bit for bit (fused multiply-adds in DeepSpeed's vector body
  and, where the CPU has FMA, in its scalar loop; the scalars derived in fp32: see host_adam.c). The torch formula
  here (the device side, and the host without a compiler) rounds every product on its own and derives
  ``1 - b1``, ``1 - b2`` and ``1 - lr * wd`` in double: DeepSpeed's scalar loop on a CPU without FMA but for
  those scalars' rounding, and within float rounding of DeepSpeed's op elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where an update runs: the planner's CLI counts bytes without importing it
    import torch


@dataclass(frozen=True)
class Hyper:
    """Hyperparameters of one optimizer param group for one step; each rule reads the ones it uses.

    Attributes:
        lr: learning rate (read from the param group every step, so LR schedules apply).
        beta1: first-moment decay (Adam), interpolation weight of the update direction (Lion).
        beta2: second-moment decay (Adam), momentum decay (Lion).
        eps: term added to the denominator (Adam, Adagrad).
        weight_decay: weight-decay coefficient.
        decoupled: True for decoupled decay (AdamW; Lion always decays decoupled), False for an L2 penalty
            added to the gradient (Adam, Adagrad).
        lr_decay: Adagrad's learning-rate decay (torch's ``lr_decay``; 0 for DeepSpeed's Adagrad).
    """

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    lr_decay: float = 0.0


@dataclass(frozen=True)
class UpdateRule:
    """One optimizer's update, as the engine runs it.

    Attributes:
        name: the rule's name, also the name of its loop in the compiled host kernel.
        states: names of the per-element state tensors, in the order the kernels take them. These are the
            engine's names; the framework layer maps them to the keys the user's optimizer keeps them under.
    """

    name: str
    states: tuple[str, ...]

    @property
    def slabs(self) -> int:
        """Per-element tensors the engine keeps for this rule: the master weights and each state tensor."""
        return 1 + len(self.states)

    def torch_update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Sequence[torch.Tensor],
        step: torch.Tensor,
        hyper: Hyper,
        step_number: float | None = None,
    ) -> None:
        """One step of this rule with torch's kernels (any device), in place on fp32 ``param`` and ``states``.

        No formula reads a device value on the host: a host read of a device tensor (``.item()``, ``float()``)
        would make the host wait for the device's queue on every call, serialising the engine's launch loop
        behind its uploads (the simulated accelerator reports one inside the engine's device lanes:
        docs/stream-sanitizer.md).

        Args:
            param: fp32 master weights (1-D), updated in place.
            grad: fp32 gradient of the same shape, already unscaled and clipped; may be overwritten (Adagrad adds
                the L2 term into it, as torch's Adagrad does into a copy).
            states: the rule's fp32 state tensors, in :attr:`states` order, updated in place.
            step: 0-d float32 tensor on ``param``'s device, the step number being applied (1 for the first).
            hyper: the param group's hyperparameters.
            step_number: the same step number as a host number (the engine's own count), for a rule whose formula
                takes it as a Python number (Adagrad's learning-rate decay); None reads it from ``step``, which on
                a device is a host synchronisation (the engine always passes it).
        """
        _TORCH_UPDATES[self.name](param, grad, tuple(states), step, hyper, step_number)


def _adam(param, grad, states, step, hyper: Hyper, step_number: float | None) -> None:  # noqa: ANN001, ARG001
    exp_avg, exp_avg_sq = states
    import torch

    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
        amsgrad=False, maximize=False,
    )  # fmt: skip


def _adagrad(param, grad, states, step, hyper: Hyper, step_number: float | None) -> None:  # noqa: ANN001
    (state_sum,) = states
    # torch.optim.Adagrad's single-tensor step, operation for operation: it reads the step as a Python float and
    # computes the decayed rate in double. The engine passes that number, so the device's formula never reads the
    # step tensor back (a host synchronisation per sub-group); only a caller without it pays for the read.
    number = float(step.item()) if step_number is None else float(step_number)
    if hyper.weight_decay != 0:
        grad = grad.add(param, alpha=hyper.weight_decay)
    clr = hyper.lr / (1 + (number - 1) * hyper.lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    std = _sqrt(state_sum).add_(hyper.eps)
    param.addcdiv_(grad, std, value=-clr)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (IEEE's, what C's ``sqrtf`` and CUDA's ``sqrtf`` give).

    torch's CPU ``sqrt`` of float32 (and ``pow(0.5)``) is MKL's ``vsSqrt``, which is not correctly rounded (about
    15% of random inputs come out one ulp off on an AVX2 CPU with torch 2.13, and the errors depend on MKL's code
    path for the CPU), so no compiled kernel can reproduce it. On the CPU the root is taken in float64 and rounded
    to float32: torch's float64 root is within an ulp of float64, and the root of a float32 is never that close to
    a float32 rounding boundary, so the result is the correctly rounded float32 root (checked against C's
    ``sqrtf`` on 2M random bit patterns). Elsewhere torch's float32 ``sqrt`` is IEEE's already.
    """
    if x.device.type == "cpu":
        return x.double().sqrt_().float()
    return x.sqrt()


def _lion(param, grad, states, step, hyper: Hyper, step_number: float | None) -> None:  # noqa: ANN001, ARG001 - no bias correction
    (exp_avg,) = states
    # Lion's formula as DeepSpeed's scalar loop has it, every product rounded on its own (DeepSpeed's own op fuses
    # where the CPU has FMA, and derives its scalars in fp32; the host kernel matches that: see the module's
    # docstring), the sign by copysign.
    direction = exp_avg.mul(hyper.beta1).add_(grad.mul(1 - hyper.beta1))
    step_size = direction.new_full(direction.shape, hyper.lr).copysign_(direction)
    if hyper.weight_decay > 0:
        param.mul_(1 - hyper.lr * hyper.weight_decay)
    param.sub_(step_size)
    exp_avg.mul_(hyper.beta2).add_(grad.mul(1 - hyper.beta2))


_TORCH_UPDATES = {"adam": _adam, "adagrad": _adagrad, "lion": _lion}

ADAM = UpdateRule("adam", ("exp_avg", "exp_avg_sq"))
ADAGRAD = UpdateRule("adagrad", ("sum",))
LION = UpdateRule("lion", ("exp_avg",))
#: Every rule, by name.
RULES = {rule.name: rule for rule in (ADAM, ADAGRAD, LION)}
#: The optimizers the engine runs, by name, and the rule each computes (AdamW is Adam's rule with decoupled decay):
#: what ``plan`` and ``simulate`` take as ``--optimizer``, and what ``integration/optimizers.py`` binds torch's and
#: DeepSpeed's classes to.
OPTIMIZER_RULES = {"adam": ADAM, "adamw": ADAM, "adagrad": ADAGRAD, "lion": LION}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


@dataclass(frozen=True)
class Footprint:
    """Bytes per element the engine holds and moves for one rule in one pair of dtypes.

    The master weights and the gradient share DeepSpeed's ``master_weights_and_grads_dtype`` (fp32, or bf16
    under ``bf16_master_weights_and_grads``); the optimizer's state tensors are fp32 or, under
    ``bf16_optimizer_states``, bf16.

    Attributes:
        rule: the optimizer's update rule.
        master: bytes per element of the master weights and of the gradient.
        state: bytes per element of each state tensor.
        grads_on_device: resident sub-groups' gradients are written on the device during backward (the
            strategy's engine keeps them: :meth:`~lightning_dos.engine.loop.InterleavedUpdate.keep_gradient`),
            so a resident sub-group uploads nothing.
    """

    rule: UpdateRule
    master: int = 4
    state: int = 4
    grads_on_device: bool = False

    @classmethod
    def of(
        cls, rule: UpdateRule, master_dtype: torch.dtype, state_dtype: torch.dtype, grads_on_device: bool = False
    ) -> Footprint:
        """``rule`` with master weights and gradients in ``master_dtype`` and states in ``state_dtype``."""
        return cls(rule, dtype_bytes(master_dtype), dtype_bytes(state_dtype), grads_on_device)

    @property
    def optimizer_state(self) -> int:
        """Master weights and state tensors: what the host slabs hold, and what a streamed sub-group brings home."""
        return self.master + self.state * len(self.rule.states)

    @property
    def streamed_up(self) -> int:
        """A streamed sub-group's upload: master weights, states and the gradient."""
        return self.optimizer_state + self.master

    @property
    def streamed_down(self) -> int:
        """A streamed sub-group's download: master weights and states (the 16-bit cast is counted apart)."""
        return self.optimizer_state

    @property
    def resident_up(self) -> int:
        """A resident sub-group's upload: its gradient only, or nothing when it is kept on the device."""
        return 0 if self.grads_on_device else self.master

    @property
    def device(self) -> int:
        """Device bytes of a staging buffer or resident sub-group: master weights, states and the gradient."""
        return self.streamed_up

    @property
    def temporaries(self) -> int:
        """Device bytes per element one sub-group's update allocates beyond the tensors it stores, at its peak
        (``kernels.torch_update``, the formula the device runs): fp32 copies of whatever is stored in bf16 (master
        weights, states, gradient) and the unscaled gradient, then the rule's own intermediates in fp32
        (:data:`RULE_TEMPORARIES`). Kernels run one at a time on the engine's compute stream, so the plan counts
        them once, for its largest device sub-group (``perfmodel.device_bytes``); ``tests/test_device_memory.py``
        measures them."""
        own = RULE_TEMPORARIES[self.rule.name]
        if self.master == 4 and self.state == 4:
            return own  # in place, the gradient unscaled in place too
        # fp32 work copies of the bf16 tensors, and the fp32 gradient the rule reads (converted, or unscaled apart).
        copies = 4 * (self.master != 4) + 4 * len(self.rule.states) * (self.state != 4) + 4
        # Unscaling a converted gradient holds both fp32 copies for a moment, before the rule runs.
        return copies + max(own, 4 if self.master != 4 else 0)


#: Bytes per element each rule's fp32 formula (:meth:`UpdateRule.torch_update`) allocates at its peak: Adam's fused
#: kernel none; Lion three fp32 intermediates (the interpolation, the signed step, the momentum's gradient term);
#: Adagrad the L2 term's gradient (4) and the square root's float64 round trip on the CPU (8 + 4; 4 on CUDA).
RULE_TEMPORARIES = {"adam": 0, "adagrad": 16, "lion": 12}

#: Adam with fp32 master weights and states: 16 bytes up, 12 down, 16 on the device per element.
ADAM_FP32 = Footprint(ADAM)
