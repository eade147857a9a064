"""``overlap="forward"``: the optimizer update runs on while the next forward starts, and nothing changes.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU: the engine's update runs on a
background thread, every all-gather of the next forward first waits for the sub-groups it reads, and the next
backward, checkpoints and the end of training wait for the whole update. Parameters, optimizer state (the
engine's slabs) and losses must equal ``overlap="off"`` bit for bit.
"""

from __future__ import annotations

import threading
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.plan import Place
from lightning_dos.errors import DOSConfigError
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, trainer

SUB_GROUP = 700
STEPS = 8
PLACES = (Place.HOST, Place.DEVICE, Place.RESIDENT)


def strategy(overlap: str) -> DeepOptimizerStatesStrategy:
    # No persistent parameters: otherwise DeepSpeed all-gathers every small parameter right after the step, and
    # TinyLM's parameters are all small, so the step would wait for the whole update.
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, overlap=overlap, config=config)


class KeepState(L.Callback):
    """The engine's slabs (master weights and every state tensor) at the end of training, before teardown."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        assert not engine.in_flight, "the update must be over when training ends"
        engine.flush_resident()  # resident state is current on the device only
        self.slabs = [t.clone() for t in (engine.pool.param, *engine.pool.states)]


def fit(overlap: str, steps: int = STEPS, callbacks=(), ckpt_path=None, **kw) -> tuple[TinyLM, KeepState]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model, keep = TinyLM(), KeepState()
    callbacks = [RandomPlacement(seed=5, places=PLACES), keep, *callbacks]
    trainer(strategy(overlap), steps=steps, callbacks=callbacks, **kw).fit(model, loader(), ckpt_path=ckpt_path)
    return model, keep


def assert_identical(a: tuple[TinyLM, KeepState], b: tuple[TinyLM, KeepState]) -> None:
    (model_a, keep_a), (model_b, keep_b) = a, b
    assert model_a.losses == model_b.losses
    for name, value in full_parameters(model_a).items():
        assert torch.equal(value, full_parameters(model_b)[name]), name
    assert len(keep_a.slabs) == len(keep_b.slabs) > 1
    for ours, theirs in zip(keep_a.slabs, keep_b.slabs, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", [0.5, None])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_overlap_forward_is_bit_identical_to_off(precision: str, clip: float | None, accumulate: int) -> None:
    settings = dict(precision=precision, gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    assert_identical(fit("forward", **settings), fit("off", **settings))


def test_auto_runs_as_forward_and_resuming_from_a_checkpoint_saved_mid_run_is_exact(tmp_path: Path) -> None:
    # Two epochs of 4 steps; checkpoints after steps 4 and 8 (the first at the epoch boundary, where a resume
    # starts from the next epoch's first batch, as the uninterrupted run does).
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    whole = fit("auto", callbacks=[every], limit_train_batches=4, enable_checkpointing=True)
    assert_identical(whole, fit("off", limit_train_batches=4))
    saved = tmp_path / "step=4.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = fit("forward", ckpt_path=str(saved), limit_train_batches=4, default_root_dir=tmp_path / "resumed")
    for name, value in full_parameters(resumed[0]).items():
        assert torch.equal(value, full_parameters(whole[0])[name]), name
    for ours, theirs in zip(resumed[1].slabs, whole[1].slabs, strict=True):
        assert torch.equal(ours, theirs)


class NextBatchDuringUpdate(L.Callback):
    """Holds the update of step 2 at its last sub-group until the next training batch has started.

    With the overlap, the step has returned, so Lightning goes on to the next batch (and its forward) and releases
    the update; without it, the next batch cannot start while the update is held, and the wait times out. The
    next batch's start is the probe, not a module's forward: ZeRO-3 may prefetch the first modules' parameters
    from the last sub-groups (two param groups), and that all-gather rightly waits for them."""

    def __init__(self) -> None:
        self.next_batch = threading.Event()
        self.held = False
        self.held_ok = False
        self.order: list[str] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        last = len(engine.sub_groups) - 1

        def on_point(point: str, index: int) -> None:
            if point == "done" and index == last and engine.steps_taken == 2 and not self.held:
                self.held = True
                self.order.append("update: last sub-group reached")
                self.held_ok = self.next_batch.wait(timeout=10)
                self.order.append("update: last sub-group done")

        engine.on_point = on_point

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        # The batch after step 2's optimizer step (which may have returned before the update reached its last
        # sub-group: then this comes first in the order).
        if trainer.global_step == 2 and not self.next_batch.is_set():
            self.order.append("next batch starts")
            self.next_batch.set()


@pytest.mark.parametrize("overlap", ["forward", "off"])
def test_the_next_batch_starts_before_the_updates_last_sub_group_finishes(overlap: str) -> None:
    probe = NextBatchDuringUpdate()
    model, _ = fit(overlap, steps=3, callbacks=[probe])
    assert probe.held
    if overlap == "forward":
        assert probe.held_ok, "the next batch never started while the update ran"
        assert probe.order.index("next batch starts") < probe.order.index("update: last sub-group done")
    else:  # the control: without the overlap the next batch cannot start before the update is over
        assert not probe.held_ok


def test_overlap_is_validated_before_any_work() -> None:
    with pytest.raises(DOSConfigError, match=r"overlap='backward'.*'off', 'forward', 'auto'"):
        DeepOptimizerStatesStrategy(overlap="backward")
