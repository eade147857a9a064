"""A step stock skips is skipped, bit for bit, under every overlap mode and placement, clipping on or off.

DeepSpeed's ZeRO-3 skips a step whose global gradient norm is not finite, in every precision (``is_invalid_grad_norm``).
Under ``overlap="auto"`` host sub-groups are updated during backward, before that norm is known: each such update
is speculative (into a spare slot), committed when the step is taken and dropped when it is skipped, with clipping
on or off. Three kinds of bad batch, each at the first, a middle and the last step:
- an infinite loss (every gradient element infinite or NaN);
- a huge but finite loss: every gradient element finite, their norm overflowing to infinity (each sub-group's own
  check passes; only the global norm says skip);
- a NaN in the embedding's gradient only, which backward makes final last, after other sub-groups were updated.
Ours (real Trainer, real ZeRO-3 on CPU) must skip as stock does (Lightning's DeepSpeed ZeRO-3 with the optimizer
offloaded, torch's fused AdamW: the arithmetic the engine reproduces; the loss scaled once under accumulation, as
ours scales it) and train on, ending with stock's parameters, moments and losses. Settings are spread over the
cases (each precision, clipping and accumulation value beside each kind of bad batch and each position) rather than
crossed, to keep the suite short; placements are random per step.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from lightning_dos.model.plan import Place
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, trainer
from tests.test_non_finite_batch import KeepOptimizerState
from tests.test_overlap import NonFiniteGradient

SUB_GROUP = 700
STEPS = 5
POSITIONS = {"first": 0, "middle": 2, "last": STEPS - 1}
#: Small reduce buckets: DeepSpeed reduces gradients as backward produces them, the embedding's last (as on a real
#: model), so sub-groups are updated during backward before the bad one arrives.
ZERO = {"stage": 3, "sub_group_size": SUB_GROUP, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0}


class BadBatchAt(TinyLM):
    """TinyLM whose optimizer step ``at`` (every micro-batch of it) gets a bad batch of the given ``kind``."""

    def __init__(self, kind: str, at: int) -> None:
        super().__init__(fused=True)
        self.kind, self.at = kind, at

    def _bad(self) -> bool:
        return self.trainer.global_step == self.at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.kind == "nan in last gradient" and self._bad():
            h = NonFiniteGradient.apply(h, float("nan"))
        h = h + self.mlp(self.norm(h))
        return self.head(h)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        if self._bad() and self.kind == "inf loss":
            return loss * float("inf")
        if self._bad() and self.kind == "huge finite loss":
            return loss * 1e36  # gradient elements up to ~1e36: finite; the sum of their squares is not
        return loss


class StockScaledOnce(DeepSpeedCPUStrategy):
    """Stock ZeRO-3 offload with the loss scaled once under accumulation, as ours and plain Lightning scale it
    (stock DeepSpeed divides Lightning's already divided loss again: tests/test_grad_accumulation.py), so that with
    accumulation the two differ by how each handles the bad step alone."""

    def backward(self, closure_loss: torch.Tensor, optimizer: object, *args: object, **kwargs: object) -> object:
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)


class SpeculatedAtTheBadStep(L.Callback):
    """Whether any sub-group was updated during the bad step's backward (so that dropping them is what is tested)."""

    def __init__(self, at: int) -> None:
        self.at, self.speculated = at, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        report = trainer.strategy.dos_engine.last_report  # the previous update is over when the next batch starts
        if report is not None and report.step == self.at + 1:
            self.speculated = report.speculated

    on_train_end = on_train_batch_start


def _fit(strategy, bad: tuple, precision: str, clip: float | None, accumulate: int, callbacks=()) -> tuple:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model, state = BadBatchAt(*bad), KeepOptimizerState()
    run = trainer(
        strategy,
        steps=STEPS,
        precision=precision,
        clip=clip,
        callbacks=[state, *callbacks],
        accumulate_grad_batches=accumulate,
    )
    run.fit(model, loader())
    return full_parameters(model), state, model.losses


#: (kind, position, precision, clip, accumulation, the other overlap mode checked beside "auto"): each kind at each
#: position; each precision, clipping and accumulation value beside each kind and each position.
CASES = [
    ("inf loss", "first", "32-true", None, 1, "off"),
    ("inf loss", "middle", "bf16-mixed", 1.0, 2, "forward"),
    ("inf loss", "last", "bf16-mixed", None, 2, "off"),
    ("huge finite loss", "first", "bf16-mixed", 1.0, 1, "forward"),
    ("huge finite loss", "middle", "32-true", None, 2, "off"),
    ("huge finite loss", "last", "32-true", 1.0, 1, "forward"),
    ("nan in last gradient", "first", "bf16-mixed", None, 2, "forward"),
    ("nan in last gradient", "middle", "32-true", None, 1, "off"),
    ("nan in last gradient", "last", "bf16-mixed", 1.0, 1, "off"),
]


@pytest.mark.parametrize(("kind", "position", "precision", "clip", "accumulate", "other"), CASES)
def test_a_bad_batch_is_skipped_as_stock_skips_it_and_training_goes_on(
    kind: str, position: str, precision: str, clip: float | None, accumulate: int, other: str
) -> None:
    at = POSITIONS[position]
    stock_config = {
        "zero_optimization": {**ZERO, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,  # torch's fused AdamW: the formula our engine computes
        "zero_allow_untested_optimizer": True,
    }
    settings = (precision, clip, accumulate)
    stock, stock_state, stock_losses = _fit(StockScaledOnce(config=stock_config), (kind, at), *settings)
    assert stock_state.skipped == 1 and all(bool(torch.isfinite(v).all()) for v in stock.values())
    for overlap in ("auto", other):
        ours_strategy = DeepOptimizerStatesStrategy(
            gpu_fraction=0.5, sub_group_size=SUB_GROUP, overlap=overlap, config={"zero_optimization": ZERO}
        )
        placement = RandomPlacement(seed=at, places=(Place.HOST, Place.DEVICE, Place.RESIDENT))
        probe = SpeculatedAtTheBadStep(at)
        ours, our_state, our_losses = _fit(ours_strategy, (kind, at), *settings, callbacks=[placement, probe])
        if overlap == "auto" and kind == "nan in last gradient":
            assert probe.speculated > 0, "no sub-group was updated during the bad step's backward"
        assert our_state.skipped == 1, overlap
        assert our_losses == stock_losses, overlap
        for name, value in stock.items():
            assert torch.equal(ours[name], value), (overlap, name)
        for name, value in stock_state.moments.items():  # bit for bit, as in tests/test_non_finite_batch.py
            assert torch.equal(our_state.moments[name], value), (overlap, name)
