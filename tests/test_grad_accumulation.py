"""Gradient accumulation scales the loss once, as plain Lightning does.

Lightning's automatic loop divides each micro-batch's loss by ``accumulate_grad_batches``; DeepSpeed's
``engine.backward`` divides it again unless told not to. Under ``strategy="dos"`` the gradient norm that
clipping sees, and so the clipping itself and the parameters, must be plain Lightning's. Stock
``DeepSpeedStrategy`` keeps the double division; the last test pins that difference down, so that the
comparison above cannot pass for a reason other than the fix.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from tests.helpers import FP32_RTOL, TinyLM, full_parameters, loader, max_relative_error, trainer
from tests.test_equivalence import SUB_GROUP, stock_offload_config

STEPS = 6
CLIP = 0.5


class GradNorms(L.Callback):
    """The global gradient norm each optimizer step clipped against.

    Plain Lightning: the norm of the accumulated ``.grad`` just before clipping. DeepSpeed: the norm its
    ZeRO-3 optimizer computed over the flat partitions in the step (``engine.get_global_grad_norm()``).
    """

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        if not hasattr(trainer.model, "get_global_grad_norm"):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if hasattr(trainer.model, "get_global_grad_norm") and (batch_idx + 1) % self.accumulate == 0:
            self.norms.append(float(trainer.model.get_global_grad_norm()))


def fit(strategy, accumulate: int) -> tuple[dict[str, torch.Tensor], list[float]]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model = TinyLM(fused=True)
    norms = GradNorms(accumulate)
    trainer(strategy, steps=STEPS, clip=CLIP, callbacks=[norms], accumulate_grad_batches=accumulate).fit(
        model, loader()
    )
    return full_parameters(model), norms.norms


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulated_gradients_and_clipping_are_plain_lightnings(accumulate: int) -> None:
    plain_params, plain_norms = fit("auto", accumulate)
    dos_params, dos_norms = fit(DeepOptimizerStatesStrategy(sub_group_size=SUB_GROUP), accumulate)
    assert len(plain_norms) == len(dos_norms) == STEPS
    # Clipping acted: the norms are above the threshold, so a norm k times off would change every step.
    assert min(plain_norms) > CLIP
    assert dos_norms == pytest.approx(plain_norms, rel=1e-5)
    assert max_relative_error(dos_params, plain_params) < FP32_RTOL


def test_stock_deepspeed_divides_the_accumulated_loss_twice() -> None:
    """What the strategy fixes: stock DeepSpeed's gradient norm is plain Lightning's divided by k."""
    accumulate = 2
    _, plain_norms = fit("auto", accumulate)
    _, stock_norms = fit(DeepSpeedCPUStrategy(config=stock_offload_config()), accumulate)
    assert stock_norms[0] == pytest.approx(plain_norms[0] / accumulate, rel=1e-4)
