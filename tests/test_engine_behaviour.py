"""The engine keeps DeepSpeed's semantics: overflow skips, checkpoints, accumulation, memory limits.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.integration.cpu_strategy import cpu_supports_fp16
from lightning_dos.integration.strategy import DOSConfigError
from lightning_dos.model.plan import Place
from tests.helpers import FP32_RTOL_PER_OP, TinyLM, full_parameters, loader, max_relative_error, trainer

SUB_GROUP = 700


def dos(fraction: float | str = 0.5, **kw) -> DeepOptimizerStatesStrategy:
    return DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=SUB_GROUP, **kw)


class OverflowAt(TinyLM):
    """Returns an infinite loss at one step, so the fp16 gradients overflow there."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        return loss * math.inf if self.trainer.global_step == self.bad_step else loss


class Probe(L.Callback):
    """Records, around every optimizer step, the parameters, the loss scale and the engine's report."""

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self.scales: list[float] = []
        self.reports: list = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.before.append(full_parameters(pl_module))
        self.scales.append(float(trainer.strategy.deepspeed_engine.optimizer.loss_scale))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.after.append(full_parameters(pl_module))  # gathering waits for the sub-groups of an update in flight
        trainer.strategy.dos_adapter.finish_update()  # the step's report is issued once its update is over
        self.reports.append(trainer.strategy.dos_engine.last_report)


def _assert_overflow_step_skipped_and_training_continued(strategy, probe: Probe, bad_step: int) -> None:
    skipped = [i for i, r in enumerate(probe.reports) if r.skipped]
    assert skipped == [bad_step], f"only the forced overflow must skip its step, skipped: {skipped}"
    # Nothing moved on the skipped step, on host and device sub-groups alike.
    for key, value in probe.before[bad_step].items():
        assert torch.equal(value, probe.after[bad_step][key]), key
    assert probe.scales[bad_step + 1] < probe.scales[bad_step], "the loss scale must back off after an overflow"
    for i in range(bad_step + 1, len(probe.reports)):
        changed = any(not torch.equal(v, probe.after[i][k]) for k, v in probe.before[i].items())
        assert changed, f"training must continue after the overflow (step {i} moved nothing)"
    assert torch.isfinite(strategy.dos_engine.pool.param).all()
    assert torch.isfinite(strategy.dos_engine.pool.state("exp_avg")).all()
    assert torch.isfinite(strategy.dos_engine.pool.state("exp_avg_sq")).all()
    assert probe.reports[-1].plan.device_indices and probe.reports[-1].plan.host_indices


FP16_UNSUPPORTED = (
    "DeepSpeed refuses fp16 on this CPU (no AVX-512-FP16/AMX-FP16); "
    "test_overflow_branch_with_dynamic_loss_scaling_on_any_cpu covers the same branch"
)


@pytest.mark.skipif(not cpu_supports_fp16(), reason=FP16_UNSUPPORTED)
def test_fp16_overflow_skips_the_step_on_every_sub_group_and_training_continues() -> None:
    L.seed_everything(0, verbose=False)
    model, probe = OverflowAt(bad_step=4), Probe()
    strategy = dos(0.5, initial_scale_power=8, hysteresis=1)  # back off on the first overflow
    trainer(strategy, steps=10, precision="16-mixed", clip=None, callbacks=[probe]).fit(model, loader())
    _assert_overflow_step_skipped_and_training_continued(strategy, probe, bad_step=4)


class DynamicLossScaling(L.Callback):
    """Gives the real ZeRO-3 optimizer the dynamic loss scaler fp16 would configure (scale 2**8, hysteresis 1).

    DeepSpeed scales the loss with it in backward and the adapter's prologue detects the overflow (a
    non-finite gradient norm), backs the scale off and skips the step: the fp16 overflow branch, on a model
    that any CPU can run.
    """

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        zero = trainer.strategy.deepspeed_engine.optimizer
        zero.loss_scaler = DynamicLossScaler(
            init_scale=2.0**8, scale_window=1000, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False
        )
        zero.dynamic_loss_scale = True


def test_overflow_branch_with_dynamic_loss_scaling_on_any_cpu() -> None:
    """The fp16 overflow path (scale back-off, step skipped on every sub-group, finite master slabs) in fp32."""
    L.seed_everything(0, verbose=False)
    model, probe = OverflowAt(bad_step=4), Probe()
    strategy = dos(0.5)
    trainer(strategy, steps=10, clip=None, callbacks=[DynamicLossScaling(), probe]).fit(model, loader())
    assert probe.scales[0] == 2.0**8, "the dynamic scaler must be the one in use"
    _assert_overflow_step_skipped_and_training_continued(strategy, probe, bad_step=4)


def test_fp16_is_refused_up_front_where_deepspeed_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without fp16 support, precision='16-mixed' fails before any work, naming the setting."""
    import lightning_dos.integration.cpu_strategy as strategy_module

    if cpu_supports_fp16():  # a CPU that runs fp16 takes the refusal branch too
        monkeypatch.setattr(strategy_module, "cpu_supports_fp16", lambda: False)
    model = TinyLM()
    with pytest.raises(DOSConfigError, match=r"precision='16-mixed'.*bf16-mixed"):
        trainer(dos(0.5), steps=2, precision="16-mixed").fit(model, loader())
    assert model.losses == [], "nothing may run before the refusal"
    config = {"fp16": {"enabled": True}}
    with pytest.raises(DOSConfigError, match=r"config\['fp16'\]\['enabled'\].*bf16-mixed"):
        trainer(dos(0.5, config=config), steps=2).fit(TinyLM(), loader())


def test_gradient_accumulation_matches_plain_lightning() -> None:
    """Accumulating over 3 micro-batches: the engine equals plain Lightning + AdamW to float precision.

    The loss is divided by the accumulation count once, as Lightning does (stock DeepSpeed divides it again:
    tests/test_grad_accumulation.py), so the micro-batch gradients are summed from the same values.
    """

    def run(strategy) -> TinyLM:  # noqa: ANN001
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        trainer(strategy, steps=6, accumulate_grad_batches=3).fit(model, loader(batch_size=8))
        return model

    ours, plain = run(dos(0.5)), run("auto")
    assert max_relative_error(full_parameters(ours), full_parameters(plain)) < FP32_RTOL_PER_OP
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)


def test_checkpoint_written_mid_run_reloads_with_another_placement(tmp_path) -> None:  # noqa: ANN001
    """A DeepSpeed checkpoint holds the engine's state; resuming (even with another gpu_fraction) continues
    bit-exactly as the uninterrupted run, on CPU (on a GPU to float precision: tests/test_gpu.py)."""

    def run(strategy, steps: int, ckpt_path=None, save=False):  # noqa: ANN001, ANN202
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)] if save else []
        t = trainer(strategy, steps=steps, callbacks=callbacks, limit_train_batches=5, enable_checkpointing=save)
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return full_parameters(model), model.losses

    straight, straight_losses = run(dos(0.5), steps=10, save=True)
    checkpoint = next(tmp_path.glob("*step=5*"))
    assert checkpoint.is_dir(), "DeepSpeed writes a checkpoint directory"
    resumed, resumed_losses = run(dos(0.25), steps=10, ckpt_path=str(checkpoint))
    assert resumed_losses == straight_losses[5:]
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_checkpoint_while_state_is_resident_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    """With every sub-group resident on the device, the host slabs are stale between steps; saving a
    checkpoint brings the state home first, and loading one replaces the resident copies."""
    from lightning_dos.model.plan import Plan

    class AllResident(L.Callback):
        def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            adapter = trainer.strategy.dos_adapter
            plan = Plan((Place.RESIDENT,) * len(adapter.engine.sub_groups))
            adapter.planner = lambda step: (plan, None)

    def run(steps: int, ckpt_path=None, save=False):  # noqa: ANN001, ANN202
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        callbacks = [AllResident()]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1))
        t = trainer(dos(0.5), steps=steps, callbacks=callbacks, limit_train_batches=5, enable_checkpointing=save)
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return full_parameters(model), model.losses, t.strategy.dos_engine

    straight, losses, engine = run(10, save=True)
    assert sorted(engine.last_report.plan.resident_indices) == list(range(len(engine.sub_groups)))
    assert not engine.resident, "teardown brings resident state home and frees it"
    resumed, resumed_losses, _ = run(10, ckpt_path=str(next(tmp_path.glob("*step=5*"))))
    assert resumed_losses == losses[5:]
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_zero_memory_budget_puts_every_sub_group_on_the_host_with_one_warning() -> None:
    """One warning per run, but every step's fallback is in its report and logged as dos/fallback_subgroups."""
    from lightning_dos.integration.callbacks.monitor import DOSMonitor

    L.seed_everything(0, verbose=False)
    model, probe, monitor = TinyLM(), Probe(), DOSMonitor(summary=False, log_every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="did not fit the device memory budget") as caught:
        trainer(dos(1.0, gpu_memory_budget=0), steps=4, callbacks=[probe, monitor]).fit(model, loader())
    assert sum("lightning-dos" in str(w.message) for w in caught) == 1
    assert all(set(r.plan.places) == {Place.HOST} for r in probe.reports)
    assert all(r.fallback_host and r.device_staging_bytes == 0 for r in probe.reports)
    logged = [row["dos/fallback_subgroups"] for row in monitor.history]
    assert logged == [float(len(r.fallback_host)) for r in probe.reports] and logged[0] > 0


def test_budget_limits_device_staging() -> None:
    """A budget for one staging buffer of the largest sub-group: never more bytes than allowed, the trimmed
    plan fits, and what was trimmed is in every step's report."""
    budget = 16 * SUB_GROUP
    L.seed_everything(0, verbose=False)
    probe = Probe()
    strategy = dos(0.5, gpu_memory_budget=budget)
    trainer(strategy, steps=3, callbacks=[probe]).fit(TinyLM(), loader())
    engine = strategy.dos_engine
    for report in probe.reports:
        assert 0 < report.device_staging_bytes <= budget
        assert engine.device_bytes(report.plan, report.plan.device_buffers) <= budget
        assert report.plan.streamed_indices
    assert engine.pool.staging_allocations == 3, "staging is allocated for every update"
    assert engine.pool.device_bytes_in_use == 0, "and given back at its end"


def test_out_of_memory_falls_back_to_host_with_identical_result(monkeypatch) -> None:  # noqa: ANN001
    """Injected allocation failure: the step runs on the host, warns once, and the result is unchanged;
    later steps allocate their staging again and stream."""

    def reference() -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        trainer("auto", steps=5).fit(model, loader())
        return full_parameters(model)

    from lightning_dos.engine.pool import BufferPool

    calls = {"n": 0}
    real = BufferPool.staging_for

    def flaky(self, count: int, capacity: int):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] in (1, 2):
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real(self, count, capacity)

    monkeypatch.setattr(BufferPool, "staging_for", flaky)
    L.seed_everything(0, verbose=False)
    model, probe = TinyLM(), Probe()
    with pytest.warns(RuntimeWarning, match="out of memory"):
        strategy = dos(0.5)
        trainer(strategy, steps=5, callbacks=[probe]).fit(model, loader())
    assert [bool(r.fallback_host) for r in probe.reports] == [True, True, False, False, False]
    assert strategy.dos_engine.pool.staging_allocations == 3
    assert max_relative_error(full_parameters(model), reference()) < 1e-5


def test_validate_test_and_predict_run() -> None:
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    t = trainer(dos(0.5), steps=3, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    t.fit(model, loader(), loader())
    assert "val/loss" in t.validate(model, loader(), verbose=False)[0]
    assert "test/loss" in t.test(model, loader(), verbose=False)[0]
    predictions = t.predict(model, loader())
    assert len(predictions) == 2 and predictions[0].shape == (16, 8)


class _AllResident(L.Callback):
    """Every sub-group resident; with ``keep=False`` the engine is kept from keeping gradients on the device."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.reports: list = []

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from lightning_dos.model.plan import Plan

        adapter = trainer.strategy.dos_adapter
        plan = Plan((Place.RESIDENT,) * len(adapter.engine.sub_groups))
        adapter.planner = lambda step: (plan, None)
        if not self.keep:
            adapter.engine.keep_gradient = lambda *args: None

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        engine = trainer.strategy.dos_engine  # every update is over (the strategy's own on_train_end waited)
        self.reports = [engine.report_number(n) for n in range(1, engine.reports_issued + 1)]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_resident_sub_groups_keep_their_gradients_on_the_device(precision: str) -> None:
    """Backward's final gradients are copied on the device into the resident sub-groups' gradient slots, so from
    the second step (the first makes them resident) a resident sub-group uploads no gradient; the result is
    bit-identical to uploading DeepSpeed's host copy, with gradient accumulation and clipping."""

    def run(keep: bool) -> tuple[dict, list]:
        L.seed_everything(0, verbose=False)
        model, watch = TinyLM(), _AllResident(keep)
        t = trainer(dos(0.5), steps=4, callbacks=[watch], precision=precision, accumulate_grad_batches=2)
        t.fit(model, loader())
        return full_parameters(model), watch.reports

    (kept, kept_reports), (uploaded, uploaded_reports) = run(True), run(False)
    for key, value in uploaded.items():
        assert torch.equal(kept[key], value), key
    elements = sum(kept_reports[0].sizes)
    assert [r.h2d_bytes for r in uploaded_reports] == [4 * elements] * 4
    assert kept_reports[0].h2d_bytes == 4 * elements  # not yet resident during the first backward
    # TinyLM's sub-groups hold no padding, so backward writes every element of each: nothing is uploaded.
    assert [r.h2d_bytes for r in kept_reports[1:]] == [0] * 3
