"""An update is never torn, in training: signals, Ctrl-C, exceptions and checkpoints in the middle of it.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU. The engine's test seam
(``InterleavedUpdate.on_point``) fires a signal or raises at a named point inside the update of one step:
between sub-groups, during a flush of resident state home, between storing two flats' step counts.
Every checkpoint written must be exactly the pre-step or the post-step state (weights, moments, step
counts, Lightning's step and LR schedule), and resuming from it must give the uninterrupted run's
parameters bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.atomic import POST_STEP, PRE_STEP, UpdateInterrupted
from lightning_dos.model.plan import Place, Plan
from tests.helpers import TinyLM, clean_env, full_parameters, lm_data, loader, trainer

SUB_GROUP = 700
STEPS = 5
STEP = 3  # the step whose update is interrupted
LANES = (Place.HOST, Place.DEVICE, Place.RESIDENT)


class StepIndexedLM(TinyLM):
    """Trains on the batch of its global step, whichever batch the loader hands over, so that a run resumed
    mid-epoch (Lightning restarts a plain loader from its first batch) sees the uninterrupted run's batches."""

    def __init__(self) -> None:
        super().__init__()
        x, y = lm_data().tensors
        self.batches = list(zip(x.split(16), y.split(16)))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        return super().training_step(self.batches[self.trainer.global_step], batch_idx)


class RotatingPlan(L.Callback):
    """Sub-group i goes to host, streamed, resident in turn, so every step mixes all three lanes and
    moves resident state home (a flush) at its start. The same plans in every run of a test."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = len(trainer.strategy.dos_engine.sub_groups)
        trainer.strategy.dos_adapter.planner = lambda step: (
            Plan(tuple(LANES[(i + step) % 3] for i in range(n))),
            None,
        )


class At(L.Callback):
    """Calls ``action(trainer)`` once, at ``point`` of sub-group (or flat) ``index`` inside the update of
    ``STEP`` (or, with ``during_update=False``, outside it: in the flush a checkpoint saved after it does)."""

    def __init__(self, point: str, index: int, action, during_update: bool = True) -> None:  # noqa: ANN001
        self.where, self.action, self.fired = (point, index), action, False
        self.during_update = during_update
        #: Whether it fired while backward was still on (overlap="auto": a host sub-group updated early).
        self.in_backward = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine

        def on_point(point: str, index: int) -> None:
            # The engine counts the step in flight from its start (Lightning's global step, only once the step
            # has returned, which under overlap="forward" is before the update ends).
            if not self.fired and (point, index) == self.where and engine.steps_taken == STEP:
                if engine.guard.in_update == self.during_update:
                    self.fired, self.in_backward = True, engine.arrivals is not None
                    self.action(trainer)

        engine.watch_points(on_point)


def clip_for(overlap: str) -> float | None:
    """Gradient clipping for runs under ``overlap``: "auto"'s runs (and their reference) clip nothing, so that its
    speculative updates during backward are committed, not redone; the others clip, so an unscale applied twice
    would show."""
    return None if overlap == "auto" else 0.5


def fit(
    tmp: Path, callbacks=(), steps: int = STEPS, ckpt_path: Path | None = None, overlap: str = "off", **kw
) -> tuple[L.Trainer, TinyLM]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model = StepIndexedLM()
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, overlap=overlap)
    kw.setdefault("clip", clip_for(overlap))
    t = trainer(strategy, steps=steps, callbacks=[RotatingPlan(), *callbacks], default_root_dir=tmp, **kw)
    t.fit(model, loader(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return t, model


def contents(path: Path) -> dict[str, object]:
    """Weights, moments and step counts of a DeepSpeed checkpoint, with Lightning's step and LR schedule."""
    folder = path / "checkpoint"
    optim = torch.load(next(folder.glob("*optim_states.pt")), map_location="cpu", weights_only=False)
    client = torch.load(next(folder.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    zero = optim["optimizer_state_dict"]
    state = zero["optimizer_state_dict"]["state"]
    return {
        "weights": [t.clone() for t in zero["fp32_flat_groups"]],
        "exp_avg": [state[i]["exp_avg"] for i in sorted(state)],
        "exp_avg_sq": [state[i]["exp_avg_sq"] for i in sorted(state)],
        "step_counts": [int(state[i]["step"]) for i in sorted(state)],
        "global_step": client["global_step"],
        "lr_schedule": client["lr_schedulers"][0]["last_epoch"],
    }


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            if not all(torch.equal(u, v) for u, v in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


class SaveEveryStep(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        trainer.save_checkpoint(self.folder / f"step{trainer.global_step}")


def _uninterrupted(tmp: Path, clip: float | None) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    _, model = fit(tmp, callbacks=[SaveEveryStep(tmp)], clip=clip)
    return {k: contents(tmp / f"step{k}") for k in range(1, STEPS + 1)}, full_parameters(model)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    """Checkpoint contents after every step of the uninterrupted run (clipped), and its final parameters."""
    return _uninterrupted(tmp_path_factory.mktemp("uninterrupted"), clip_for("off"))


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    """The same without clipping: the reference of overlap="auto"'s runs."""
    return _uninterrupted(tmp_path_factory.mktemp("unclipped"), clip_for("auto"))


def reference_for(request: pytest.FixtureRequest, overlap: str) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    return request.getfixturevalue("unclipped" if overlap == "auto" else "uninterrupted")


def assert_resumes_exactly(tmp: Path, checkpoint: Path, final: dict[str, torch.Tensor], overlap: str = "off") -> None:
    _, model = fit(tmp / "resumed", ckpt_path=checkpoint, clip=clip_for(overlap))
    for name, value in full_parameters(model).items():
        assert torch.equal(value, final[name]), name


# Between two host sub-groups; while a streamed sub-group's state downloads; during the flush of resident
# state home at the start of the update; after the engine's step, between storing two flats' step counts;
# and outside the update, during the flush of resident state that a checkpoint saved after the step does.
SIGNAL_POINTS = [("updated", 3, True), ("downloading", 4, True), ("flush", 3, True), ("step_count", 1, True)]
SIGNAL_POINTS += [("flush", 2, False)]


class SaveAfter(L.Callback):
    """Saves a checkpoint after ``STEP`` (like ModelCheckpoint), flushing resident state home."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == STEP:
            trainer.save_checkpoint(self.folder / "after")


@pytest.mark.usefixtures("restore_signal_handlers")
@pytest.mark.parametrize("overlap", ["off", "forward", "auto"])
def test_a_signal_handler_that_saves_a_checkpoint_mid_update_saves_a_whole_step_that_resumes(
    tmp_path: Path, request: pytest.FixtureRequest, overlap: str
) -> None:
    """Like Lightning's SLURM auto-requeue handler: SIGUSR1's handler calls trainer.save_checkpoint."""
    reference, final = reference_for(request, overlap)
    saved: list[tuple[Path, bool]] = []
    t: L.Trainer | None = None

    def save_like_slurm_requeue(signum: int, frame: object) -> None:
        path = tmp_path / f"requeue{len(saved)}"
        saved.append((path, t.strategy.dos_engine.guard.in_update))
        t.save_checkpoint(path)

    signal.signal(signal.SIGUSR1, save_like_slurm_requeue)
    for point, index, during_update in SIGNAL_POINTS:
        L.seed_everything(0, verbose=False)
        model = StepIndexedLM()
        strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, overlap=overlap)
        fire = At(point, index, lambda trainer: os.kill(os.getpid(), signal.SIGUSR1), during_update)
        callbacks = [RotatingPlan(), fire] + ([] if during_update else [SaveAfter(tmp_path)])
        t = trainer(strategy, steps=STEP, callbacks=callbacks, default_root_dir=tmp_path, clip=clip_for(overlap))
        t.fit(model, loader())
        assert fire.fired, point
    assert len(saved) == len(SIGNAL_POINTS)
    assert same(contents(tmp_path / "after"), reference[STEP])  # the checkpoint the signal interrupted
    for (path, in_update), (point, *_) in zip(saved, SIGNAL_POINTS):
        assert not in_update, f"the handler ran inside the update ({point})"
        got = contents(path)
        assert same(got, reference[STEP]) or same(got, reference[STEP - 1]), f"torn checkpoint at {point}"
    for path, _ in saved:
        assert_resumes_exactly(tmp_path / path.name, path, final, overlap)


@pytest.mark.usefixtures("restore_signal_handlers")
@pytest.mark.parametrize("overlap", ["off", "forward", "auto"])
def test_ctrl_c_mid_update_with_on_exception_checkpoint_saves_a_whole_step_that_resumes(
    tmp_path: Path, request: pytest.FixtureRequest, overlap: str
) -> None:
    reference, final = reference_for(request, overlap)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = At("downloading", 7, lambda trainer: os.kill(os.getpid(), signal.SIGINT))
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="interrupted")
    with pytest.raises(SystemExit):  # Lightning shuts down gracefully on KeyboardInterrupt, then exits
        fit(tmp_path, callbacks=[ctrl_c, on_exception], enable_checkpointing=True, overlap=overlap)
    assert ctrl_c.fired
    saved = tmp_path / "interrupted.ckpt"
    assert same(contents(saved), reference[STEP]), "the checkpoint must hold the whole interrupted step"
    assert_resumes_exactly(tmp_path, saved, final, overlap)


# A training run (in a child process, which is to die) that sends itself SIGTERM twice in the middle of an
# update, as an impatient user or a scheduler would; Lightning's own SIGTERM handler is installed.
SIGTERM_TWICE = """
import os, signal, sys
from pathlib import Path
from tests.test_atomic_training import At, fit

def twice(trainer):
    os.kill(os.getpid(), signal.SIGTERM)
    print("went on after the first", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("went on after the second", flush=True)

fit(Path(sys.argv[1]), callbacks=[At("downloading", 4, twice)])
"""


def test_a_second_sigterm_mid_update_ends_the_process_at_once_while_the_first_alone_is_held(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", SIGTERM_TWICE, str(tmp_path)],
        cwd=root,
        env={**clean_env(), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert "went on after the first" in done.stdout and "went on after the second" not in done.stdout
    said = [line for line in done.stderr.splitlines() if line.startswith("lightning-dos: SIGTERM held")]
    assert len(said) == 1 and "Send SIGTERM again to end the process at once" in said[0], done.stderr[-3000:]


class Injected(RuntimeError):
    pass


class BackwardWaitsFor(L.Callback):
    """After ``STEP``'s backward, before its optimizer step: gives ``at`` up to 10 s to fire, so that an ``At`` on a
    host sub-group fires while backward's phase of overlap="auto" is still on (elsewhere it just waits)."""

    def __init__(self, at: At) -> None:
        self.at = at

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == STEP - 1 and trainer.strategy.dos_adapter.overlap == "auto":
            deadline = time.monotonic() + 10
            while not self.at.fired and time.monotonic() < deadline:
                time.sleep(0.001)


def raise_injected(trainer: L.Trainer) -> None:
    raise Injected("injected failure")


@pytest.mark.parametrize(
    ("point", "index", "state", "overlap"),
    [
        ("flush", 3, PRE_STEP, "off"),
        ("updated", 3, POST_STEP, "off"),
        ("computed", 4, POST_STEP, "off"),
        ("step_count", 0, POST_STEP, "off"),
        # Under overlap the failure surfaces at the next wait (the next backward), on the training thread. A
        # failure before anything changed is taken whole on the host: Lightning has counted the step by then.
        ("flush", 3, POST_STEP, "forward"),
        ("updated", 3, POST_STEP, "forward"),
        ("computed", 4, POST_STEP, "forward"),
        ("step_count", 0, POST_STEP, "forward"),
        # Under "auto" host sub-group 3 is updated during backward, speculatively: its "updated" point is reached
        # when that update is committed, once backward has ended; a failure there is finished on the host.
        ("updated", 3, POST_STEP, "auto"),
        ("computed", 4, POST_STEP, "auto"),
    ],
)
def test_an_exception_mid_update_leaves_a_whole_step_as_reported_and_resumes(
    tmp_path: Path, request: pytest.FixtureRequest, point: str, index: int, state: str, overlap: str
) -> None:
    reference, final = reference_for(request, overlap)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="failed")
    fail = At(point, index, raise_injected)
    with pytest.raises(UpdateInterrupted, match=state) as raised:
        fit(
            tmp_path,
            callbacks=[fail, BackwardWaitsFor(fail), on_exception],
            enable_checkpointing=True,
            overlap=overlap,
        )
    assert raised.value.state == state and isinstance(raised.value.error, Injected)
    # Nothing is final before backward's end: no point of the step is reached while it is still on (under "auto"
    # sub-group 3's speculative update reaches "updated" at its commit).
    assert not fail.in_backward
    saved = tmp_path / "failed.ckpt"
    assert same(contents(saved), reference[STEP if state == POST_STEP else STEP - 1])
    assert_resumes_exactly(tmp_path, saved, final, overlap)


def test_a_device_out_of_memory_mid_stream_completes_the_step_on_the_host_and_training_goes_on(
    tmp_path: Path, uninterrupted
) -> None:  # noqa: ANN001
    _, final = uninterrupted

    def out_of_memory(trainer: L.Trainer) -> None:
        raise torch.OutOfMemoryError("injected: device out of memory")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, model = fit(tmp_path, callbacks=[At("computed", 4, out_of_memory)])
    assert t.global_step == STEPS
    assert any("post-step" in str(w.message) for w in caught)
    for name, value in full_parameters(model).items():
        assert torch.equal(value, final[name]), name


def test_a_checkpoint_from_another_thread_waits_for_the_update_and_holds_the_step_counts_with_the_weights(
    tmp_path: Path,
) -> None:
    seen: dict[str, object] = {}

    def read_from_another_thread(trainer: L.Trainer) -> None:
        zero = trainer.strategy.deepspeed_engine.optimizer

        def read() -> None:
            try:
                seen["state"] = zero.state_dict()
            except BaseException as error:  # noqa: BLE001 - reported by the test below
                seen["error"] = error

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=0.5)
        seen["blocked"] = reader.is_alive()
        seen["reader"] = reader

    class JoinReaderAfterTheStep(L.Callback):
        """The reader reads right after the update, as a checkpointing thread would (not during teardown)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if "reader" in seen:
                seen["reader"].join(timeout=60)  # type: ignore[union-attr]

    # Between storing the first and the second flat's step counts: the most torn moment there is.
    fit(tmp_path, callbacks=[At("step_count", 1, read_from_another_thread), JoinReaderAfterTheStep()], steps=STEP)
    assert seen["blocked"] is True, "the reader did not wait for the update"
    assert "error" not in seen, seen.get("error")
    state = seen["state"]["optimizer_state_dict"]["state"]  # type: ignore[index]
    assert len(state) > 1 and all(int(s["step"]) == STEP for s in state.values())
