"""One non-finite batch: ours does exactly what stock DeepSpeed ZeRO-3 offload does with it.

DeepSpeed 0.19.8's ZeRO-3 ``step`` checks fp16 overflow only in fp16 (``_overflow_check_and_loss_scale_update``), but
in every precision it takes the global gradient norm and skips the step when that norm is not finite
(``is_invalid_grad_norm``: ``overflow = True``, the step returns before any sub-group is touched, ``skipped_steps``
counts it). So in fp32 and bf16-mixed a batch whose loss is infinite is skipped: parameters, Adam's moments and its
step count stay as they were, and training goes on. Ours must leave the same parameters and state as stock on the
same batches, with and without clipping (with clipping our host updates begin speculatively during backward).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from tests.helpers import TinyLM, full_parameters, loader, trainer

SUB_GROUP = 700
STEPS = 5
BAD = 2  # the third batch's loss is infinite


class InfiniteLossAt(TinyLM):
    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == BAD else loss


class KeepOptimizerState(L.Callback):
    """Every parameter's Adam moments (DeepSpeed's accessor, which ours answers too) and the steps DeepSpeed skipped."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state

        self.moments = {
            f"{name}.{key}": safe_get_full_optimizer_state(param, key).clone()
            for name, param in pl_module.named_parameters()
            for key in ("exp_avg", "exp_avg_sq")
        }
        self.skipped = trainer.strategy.deepspeed_engine.skipped_steps


def _fit(strategy, precision: str, clip: float | None) -> tuple[dict[str, torch.Tensor], KeepOptimizerState, list]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model, state = InfiniteLossAt(fused=True), KeepOptimizerState()
    trainer(strategy, steps=STEPS, precision=precision, clip=clip, callbacks=[state]).fit(model, loader())
    return full_parameters(model), state, model.losses


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no clipping", "clip 1.0"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_non_finite_batch_is_skipped_as_stock_offload_skips_it(precision: str, clip: float | None) -> None:
    stock_config = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": SUB_GROUP},
        "zero_force_ds_cpu_optimizer": False,  # torch's fused AdamW: the formula our engine computes
        "zero_allow_untested_optimizer": True,
    }
    stock, stock_state, stock_losses = _fit(DeepSpeedCPUStrategy(config=stock_config), precision, clip)
    ours, our_state, our_losses = _fit(DeepOptimizerStatesStrategy(sub_group_size=SUB_GROUP), precision, clip)
    assert len(stock_losses) == STEPS and all(torch.isfinite(torch.tensor(stock_losses)))  # TinyLM's, before the inf
    # Stock skipped the step (in fp32 and bf16 too) and its weights stayed finite: ours did the same.
    assert stock_state.skipped == our_state.skipped == 1
    assert all(bool(torch.isfinite(v).all()) for v in stock.values())
    assert our_losses == stock_losses
    for name, value in stock.items():
        assert torch.equal(ours[name], value), name
    for name, value in stock_state.moments.items():
        assert bool(torch.isfinite(value).all()), name
        # Bit for bit, the last elements of each of stock's flat sub-groups included (torch's fused AdamW takes its
        # scalar remainder there, which the engine's kernel reproduces).
        assert torch.equal(our_state.moments[name], value), name
