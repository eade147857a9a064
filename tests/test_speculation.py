"""``overlap="auto"`` with gradient clipping: host sub-groups are updated during backward as if the step were not
clipped (speculatively, out of place into spare slots), then committed or redone once the norm is known.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU. The clipping threshold is chosen
from a plain run's gradient norms so that some steps clip and some do not, and each test asserts both happened.
Parameters, optimizer state (the engine's slabs) and losses must equal ``overlap="off"`` bit for bit.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import deepspeed
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.errors import DOSConfigError
from lightning_dos.model.plan import Place
from lightning_dos.planning.speculation import RETRY_EVERY, STOP_AFTER, CommitPolicy
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, trainer
from tests.test_atomic_training import StepIndexedLM, contents, same
from tests.test_overlap import NonFiniteAt, assert_identical

SUB_GROUP = 700
STEPS = 8
PLACES = (Place.HOST, Place.DEVICE, Place.RESIDENT)


def strategy(overlap: str, speculation_memory: int | str = "auto", **zero: object) -> DeepOptimizerStatesStrategy:
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    return DeepOptimizerStatesStrategy(
        gpu_fraction=0.5,
        sub_group_size=SUB_GROUP,
        overlap=overlap,
        config=config,
        speculation_memory=speculation_memory,
    )


class Outcomes(L.Callback):
    """Per optimizer step: the gradient norm DeepSpeed computed, and the engine's speculation outcome; the slabs
    at the end of training."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}
        self.speculated: dict[int, int] = {}
        self.committed: dict[int, bool | None] = {}
        self.held_at_batch_end: list[int] = []
        self.accessor_reads: list[torch.Tensor] = []

    def _read_report(self, trainer: L.Trainer) -> None:
        report = trainer.strategy.dos_engine.last_report  # the previous update is over here (backward settled it)
        if report is not None:
            self.speculated[report.step] = report.speculated
            self.committed[report.step] = report.committed

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_report(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        norm = trainer.strategy.deepspeed_engine.optimizer._global_grad_norm
        if norm is not None:
            self.norms[trainer.global_step] = float(norm)
        # DeepSpeed's accessor reads the slabs: committed state held in spare slots must come home first.
        self.held_at_batch_end.append(len(trainer.strategy.dos_engine.spare.held))
        if trainer.global_step > 0:  # the optimizer has state once a step was taken (accumulation delays it)
            weight = next(p for p in pl_module.parameters() if p.requires_grad)
            self.accessor_reads.append(deepspeed.utils.safe_get_full_optimizer_state(weight, "exp_avg").clone())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        assert not engine.in_flight
        self._read_report(trainer)
        engine.flush_resident()
        self.slabs = [t.clone() for t in (engine.pool.param, *engine.pool.states)]
        assert engine.spare.pending == {} and engine.spare.held == {}, "no speculative result outlives its step"


def fit(
    overlap: str,
    clip: float | None,
    steps: int = STEPS,
    callbacks=(),
    ckpt_path=None,
    speculation_memory="auto",
    model=None,
    **kw,
):  # noqa: ANN001, ANN201, E501
    L.seed_everything(0, verbose=False)
    model, outcomes = (model or TinyLM)(), Outcomes()  # made after seeding: every run starts from the same weights
    placement = RandomPlacement(seed=5, places=PLACES, after_backward=True)
    run = trainer(
        strategy(overlap, speculation_memory, **kw.pop("zero", {})),
        steps=steps,
        clip=clip,
        callbacks=[placement, outcomes, *callbacks],
        **kw,
    )
    run.fit(model, loader(), ckpt_path=ckpt_path)
    return model, outcomes


_THRESHOLDS: dict[tuple[str, int], float] = {}


def threshold_for(precision: str = "32-true", accumulate: int = 1) -> float:
    """A clipping threshold between the gradient norms of a plain run's steps (their median), so that some steps
    clip and some do not."""
    key = (precision, accumulate)
    if key not in _THRESHOLDS:
        _, outcomes = fit("off", None, steps=12, precision=precision, accumulate_grad_batches=accumulate)
        _THRESHOLDS[key] = statistics.median(outcomes.norms.values())
    return _THRESHOLDS[key]


@pytest.fixture
def threshold() -> float:
    return threshold_for()


def _assert_both_outcomes(outcomes: Outcomes) -> None:
    outcome = [c for c in outcomes.committed.values() if c is not None]
    assert True in outcome and False in outcome, outcomes.committed
    assert all(outcomes.speculated[s] > 0 for s, c in outcomes.committed.items() if c is not None)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_speculative_updates_are_bit_identical_to_off_whether_committed_or_redone(
    precision: str, accumulate: int
) -> None:
    settings = dict(precision=precision, accumulate_grad_batches=accumulate)
    threshold = threshold_for(precision, accumulate)
    off = fit("off", threshold, **settings)
    auto = fit("auto", threshold, **settings)
    assert auto[0].trainer.strategy.dos_adapter.speculative
    _assert_both_outcomes(auto[1])
    assert_identical((auto[0], auto[1]), (off[0], off[1]))
    # Between steps committed sub-groups' state lives in spare slots; DeepSpeed's accessor still reads each step's.
    assert max(auto[1].held_at_batch_end) > 0 and len(auto[1].accessor_reads) == len(off[1].accessor_reads)
    assert all(torch.equal(a, b) for a, b in zip(auto[1].accessor_reads, off[1].accessor_reads, strict=True))


def test_the_committed_steps_are_those_under_the_threshold(threshold: float) -> None:
    _, outcomes = fit("auto", threshold, steps=10)
    # Every step reported, and steps were speculated on: some committed, some redone (so the loop checks both).
    assert sorted(outcomes.committed) == list(range(1, 11)), outcomes.committed
    _assert_both_outcomes(outcomes)
    for step, committed in outcomes.committed.items():
        if committed is not None:
            # DeepSpeed's norm of optimizer step `step` is recorded at global_step == step.
            assert committed == (outcomes.norms[step] + 1e-6 <= threshold), (step, outcomes.norms[step], threshold)


def test_resuming_from_a_checkpoint_saved_after_a_redone_step_is_exact(tmp_path: Path, threshold: float) -> None:
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    settings = dict(limit_train_batches=4, enable_checkpointing=True)
    # StepIndexedLM trains on the batch of its global step: a run resumed mid-epoch sees the same batches.
    whole = fit("auto", threshold, callbacks=[every], model=StepIndexedLM, **settings)
    redone = [s for s, c in whole[1].committed.items() if c is False and s < STEPS]
    assert redone, whole[1].committed
    saved = tmp_path / f"step={redone[0]}.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = fit(
        "auto",
        threshold,
        ckpt_path=str(saved),
        default_root_dir=tmp_path / "resumed",
        model=StepIndexedLM,
        **settings,
    )
    for name, value in full_parameters(resumed[0]).items():
        assert torch.equal(value, full_parameters(whole[0])[name]), name
    for ours, theirs in zip(resumed[1].slabs, whole[1].slabs, strict=True):
        assert torch.equal(ours, theirs)


def test_a_nan_step_is_skipped_and_every_speculative_update_undone() -> None:
    """A non-finite gradient in the embedding (made final last): the sub-groups speculated before it are restored,
    the step is skipped as DeepSpeed skips it, and training goes on (without clipping this state is torn)."""

    def run(overlap: str) -> tuple[TinyLM, Outcomes]:
        return fit(
            overlap, 1e9, steps=5, model=lambda: NonFiniteAt(at=2, where="embedding"), zero={"reduce_bucket_size": 600}
        )

    off, auto = run("off"), run("auto")
    assert auto[1].speculated[3] > 0 and auto[1].committed[3] is False, (auto[1].speculated, auto[1].committed)
    assert_identical(auto, off)


class RaiseInBackward(TinyLM):
    """Raises from the embedding's backward (made final last) at step ``at``, once the engine has speculated a
    sub-group of that step."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.raised_after: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.trainer.global_step == self.at:
            h = _RaiseAfterSpeculation.apply(h, self)
        h = h + self.mlp(self.norm(h))
        return self.head(h)


class _RaiseAfterSpeculation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, module: RaiseInBackward) -> torch.Tensor:  # noqa: ANN001
        ctx.module = module
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        engine = ctx.module.trainer.strategy.dos_engine
        deadline = time.monotonic() + 60
        while not engine.spare.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        ctx.module.raised_after = dict(engine.spare.pending)
        raise RuntimeError("failure injected during backward")


class StateAtException(L.Callback):
    """The engine's slabs once the strategy has handled the exception (before teardown gives them back)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        handle = strategy.on_exception

        def on_exception(exception: BaseException) -> None:
            handle(exception)
            engine = strategy.dos_engine
            self.torn, self.pending = engine.torn, dict(engine.spare.pending)
            engine.flush_resident()
            self.slabs = [t.clone() for t in (engine.pool.param, *engine.pool.states)]

        strategy.on_exception = on_exception


def test_an_exception_during_backward_after_speculation_began_leaves_the_state_pre_step() -> None:
    at = 3
    made, state = [], StateAtException()
    with pytest.raises(RuntimeError, match="failure injected during backward"):
        fit(
            "auto",
            1e9,
            model=lambda: made.append(RaiseInBackward(at)) or made[0],
            callbacks=[state],
            zero={"reduce_bucket_size": 600},
        )
    assert made[0].raised_after, "the failure came after a sub-group was speculated"
    assert state.torn is None and state.pending == {}
    _, before = fit("off", 1e9, steps=at)  # the state after the steps that completed
    for ours, theirs in zip(state.slabs, before.slabs, strict=True):
        assert torch.equal(ours, theirs)


class SignalWhileSpeculating(L.Callback):
    """Sends ``signum`` to this process once, from the update as it speculates during step ``at``'s backward."""

    def __init__(self, signum: int, at: int = 3) -> None:
        self.signum, self.at = signum, at
        self.sent: bool | None = None  # True: sent while backward was still running
        self.trainer: L.Trainer | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer = trainer
        engine = trainer.strategy.dos_engine

        def on_point(point: str, index: int) -> None:
            if point == "speculated" and engine.steps_taken == self.at and self.sent is None:
                self.sent = engine.arrivals is not None
                os.kill(os.getpid(), self.signum)

        engine.watch_points(on_point)


def _checkpoint_every_step_of_off(tmp_path: Path, threshold: float) -> None:
    every = ModelCheckpoint(dirpath=tmp_path / "off", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit("off", threshold, callbacks=[every], enable_checkpointing=True, default_root_dir=tmp_path)


@pytest.mark.usefixtures("restore_signal_handlers")
def test_a_signal_during_backward_after_speculation_began_saves_a_whole_step(tmp_path: Path, threshold: float) -> None:
    """SIGUSR1's handler saves a checkpoint (as Lightning's SLURM requeue handler does); sent from the update as it
    speculates, it is held and runs once the step is recorded: the checkpoint holds the whole step, and resumes."""
    _checkpoint_every_step_of_off(tmp_path, threshold)
    saved: list[tuple[int, bool]] = []
    probe = SignalWhileSpeculating(signal.SIGUSR1)

    def save_like_slurm_requeue(signum: int, frame: object) -> None:
        t = probe.trainer
        saved.append((t.global_step, t.strategy.dos_engine.guard.in_update))
        t.save_checkpoint(tmp_path / "requeue")

    signal.signal(signal.SIGUSR1, save_like_slurm_requeue)
    fit("auto", threshold, callbacks=[probe])
    assert probe.sent, "sent during backward"
    assert len(saved) == 1 and saved[0] == (3, False), saved
    assert same(contents(tmp_path / "requeue"), contents(tmp_path / "off" / "step=3.ckpt"))


@pytest.mark.usefixtures("restore_signal_handlers")
def test_a_sigterm_during_backward_after_speculation_began_stops_after_a_whole_step(
    tmp_path: Path, threshold: float
) -> None:
    """SIGTERM sent from the update as it speculates (a cluster's pre-emption): it is held until the step is
    recorded, then Lightning's handler stops the run with SIGTERMException after that batch, and the checkpoint
    OnExceptionCheckpoint saves holds the whole step (equal to ``off``'s of that step): nothing speculative saved."""
    _checkpoint_every_step_of_off(tmp_path, threshold)
    probe = SignalWhileSpeculating(signal.SIGTERM)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="on-sigterm")
    with pytest.raises(SIGTERMException):
        fit("auto", threshold, callbacks=[probe, on_exception], enable_checkpointing=True, default_root_dir=tmp_path)
    assert probe.sent, "sent during backward"
    saved = contents(tmp_path / "on-sigterm.ckpt")
    assert saved["global_step"] == 3
    assert same(saved, contents(tmp_path / "off" / "step=3.ckpt"))


@pytest.mark.parametrize("clip", [0.5, None], ids=["clipping", "no-clipping"])
def test_speculation_memory_zero_runs_as_forward_and_says_why(
    clip: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """No spare memory for speculation: host sub-groups wait for backward's end (as "forward" does), clipping on or
    off (without clipping a step can still be skipped on its global norm), and the console says so once."""
    with caplog.at_level("INFO"):
        model, outcomes = fit("auto", clip, steps=2, speculation_memory=0)
    assert model.trainer.strategy.dos_adapter.overlap == "forward"
    said = [r.getMessage() for r in caplog.records if "overlap='auto'" in r.getMessage()]
    assert len(said) == 1 and "speculation_memory=0" in said[0], said
    assert set(outcomes.committed.values()) == {None}


def test_speculation_memory_is_validated_before_any_work() -> None:
    for bad in (-1, "lots", 1.5, True):
        with pytest.raises(DOSConfigError, match="speculation_memory"):
            DeepOptimizerStatesStrategy(speculation_memory=bad)


def test_a_small_speculation_memory_speculates_as_many_sub_groups_as_it_holds(threshold: float) -> None:
    # A slot holds the largest sub-group's (704 elements: sizes are aligned) fp32 master weights, two moments and
    # its result in the model's dtype (fp32 here): 704 x 16 bytes. Two and a half slots' worth make two slots.
    model, outcomes = fit("auto", threshold, speculation_memory=5 * 704 * 16 // 2)
    engine = model.trainer.strategy.dos_engine
    assert engine.speculation_slot_bytes() == 704 * 16
    assert engine.spare.slots == 2
    figure = model.trainer.strategy.dos_host_figure  # the pre-flight's figure counts them
    assert ("spare slots for speculative updates", 2 * 704 * 16) in figure.items
    assert 0 < max(outcomes.speculated.values()) <= 2


def test_the_commit_policy_stops_after_redone_steps_in_a_row_and_retries() -> None:
    said: list[str] = []
    policy = CommitPolicy(say=said.append)
    for step in range(1, STOP_AFTER + 1):
        assert policy.speculates(step)
        policy.observe(step, False)
    assert not policy.speculates(STOP_AFTER + 1) and len(said) == 1
    first, *rest = said[0].splitlines()  # Lightning prefixes the first line with "INFO: "
    assert len("INFO: " + first) <= 80 and all(len(line) <= 80 for line in rest), said
    assert policy.speculates(STOP_AFTER + RETRY_EVERY)
    policy.observe(STOP_AFTER + RETRY_EVERY, True)  # the run stopped clipping: speculate again
    assert policy.speculates(STOP_AFTER + RETRY_EVERY + 1)
    policy.observe(STOP_AFTER + RETRY_EVERY, True)  # counted once
    assert policy.rate == pytest.approx(1 / (STOP_AFTER + 1)) and len(said) == 1
