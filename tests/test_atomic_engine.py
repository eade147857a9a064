"""The engine's update is atomic on its own (no Lightning, no DeepSpeed): an exception at any point of
any sub-group leaves the state pre-step or post-step, as reported, and a reader waits for the update."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from lightning_dos.engine.atomic import (
    POST_STEP,
    PRE_STEP,
    TornStateError,
    UpdateGuard,
    UpdateInFlightError,
    UpdateInterrupted,
)
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model.plan import Place, Plan

NUMELS, GROUPS = [50, 37, 64], [0, 1, 1]
HYPERS = [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True), Hyper(3e-3, 0.8, 0.95, 1e-6, 0.0, False)]
H, D, R = Place.HOST, Place.DEVICE, Place.RESIDENT
# Step 1 makes some sub-groups resident; step 2 moves some of them away (a flush home) and mixes all lanes.
PLANS = [Plan((R, R, D, H, D, H, R, H, D)), Plan((H, R, D, D, H, R, H, D, R))]


class Injected(RuntimeError):
    pass


def _engine(device: str = "cpu") -> InterleavedUpdate:
    engine = InterleavedUpdate(NUMELS, GROUPS, 20, torch.device(device), torch.float32)
    assert len(engine.sub_groups) == len(PLANS[0].places)
    engine.pool.param.copy_(torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(0)))
    return engine


def _inputs(step: int, lp: list[torch.Tensor]) -> StepInputs:
    g = torch.Generator().manual_seed(step)
    grads = [torch.randn(n, generator=g) for n in NUMELS]
    return StepInputs(grads, lp, HYPERS, [step] * 3, inv_grad_scale=0.5)


def _state(engine: InterleavedUpdate, lp: list[torch.Tensor]) -> list[torch.Tensor]:
    engine.flush_resident()
    return [
        engine.pool.param.clone(),
        engine.pool.state("exp_avg").clone(),
        engine.pool.state("exp_avg_sq").clone(),
    ] + [t.cpu() for t in lp]


def _run(failure: tuple[str, int, int, type[BaseException]] | None = None, device: str = "cpu") -> tuple:
    """Two steps; ``failure`` = (point, sub-group, step, exception type) raises there once."""
    engine, lp = _engine(device), [torch.zeros(n, device=device) for n in NUMELS]
    outcome, states, fired = None, [], []

    def on_point(point: str, index: int) -> None:
        if failure is not None and not fired and (point, index, engine.steps_taken) == failure[:3]:
            fired.append(point)
            raise failure[3]("injected")

    engine.watch_points(on_point)
    for step, plan in enumerate(PLANS, start=1):
        states.append(_state(engine, lp))
        try:
            engine.step(plan, _inputs(step, lp))
        except UpdateInterrupted as interrupted:
            outcome = interrupted
            states.append(_state(engine, lp))  # right after the interruption
            if interrupted.state == PRE_STEP:
                engine.step(plan, _inputs(step, lp))  # the step was not taken: take it again
    states.append(_state(engine, lp))
    return states, outcome, engine


def _points(device: str = "cpu") -> list[tuple[str, int, int]]:
    seen: list[tuple[str, int, int]] = []
    engine, lp = _engine(device), [torch.zeros(n, device=device) for n in NUMELS]
    engine.watch_points(lambda point, index: seen.append((point, index, engine.steps_taken)))
    for step, plan in enumerate(PLANS, start=1):
        engine.step(plan, _inputs(step, lp))
    return seen


POINTS = _points()


def test_every_lane_reports_its_progress_points() -> None:
    assert {p for p, _, _ in POINTS} == {"unscaled", "updated", "computed", "downloading", "done", "flush"}


@pytest.mark.parametrize("point", POINTS, ids=lambda p: f"{p[0]}-sg{p[1]}-step{p[2]}")
def test_an_exception_anywhere_leaves_the_state_pre_or_post_step_as_reported(point) -> None:  # noqa: ANN001
    reference, _, _ = _run()
    states, outcome, engine = _run((*point, Injected))
    assert isinstance(outcome, UpdateInterrupted), "the exception was swallowed"
    assert isinstance(outcome.error, Injected)
    assert outcome.state in str(outcome)
    # Before any change (only a flush of resident state home precedes it) the step is not taken.
    assert outcome.state == (PRE_STEP if point[0] == "flush" else POST_STEP)
    assert engine.steps_taken == 2
    step = point[2]
    expected = reference[step - 1] if outcome.state == PRE_STEP else reference[step]
    for got, want in zip(states[step], expected):
        assert torch.equal(got, want)  # right after the interruption: exactly the state it reports
    for got, want in zip(states[-1], reference[-1]):
        assert torch.equal(got, want)  # and training continues exactly


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU cases above run the same code")
def test_on_cuda_an_exception_anywhere_leaves_a_whole_step_as_reported() -> None:
    """With real streams: queued downloads land before the host finishes the rest. Host and device Adam
    round differently, so a sub-group finished on the other side matches within float tolerance."""
    reference, _, _ = _run(device="cuda")
    for point in _points("cuda"):
        states, outcome, _ = _run((*point, Injected), device="cuda")
        assert isinstance(outcome, UpdateInterrupted), point
        step = point[2]
        expected = reference[step - 1] if outcome.state == PRE_STEP else reference[step]
        for got, want in zip(states[step], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_device_out_of_memory_mid_stream_finishes_on_the_host_and_goes_on() -> None:
    reference, _, _ = _run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states, outcome, engine = _run(("computed", 2, 2, torch.OutOfMemoryError))
    assert outcome is None
    assert any("post-step" in str(w.message) for w in caught)
    assert engine.last_report.fallback_host  # the rest of the step ran on the host
    for got, want in zip(states[-1], reference[-1]):
        assert torch.equal(got, want)


def test_when_the_host_cannot_finish_either_the_engine_refuses_to_step_or_be_read(monkeypatch) -> None:  # noqa: ANN001
    import lightning_dos.engine.recovery as recovery

    def broken(*args: object) -> None:
        raise MemoryError("host")

    monkeypatch.setattr(recovery, "host_update", broken)
    with pytest.raises(TornStateError, match="mixes two steps"):
        _run(("updated", 3, 1, Injected))


def test_a_reader_on_another_thread_waits_for_the_update_and_one_inside_it_is_refused() -> None:
    engine, lp = _engine(), [torch.zeros(n) for n in NUMELS]
    seen: dict[str, object] = {}

    def read() -> None:
        with engine.guard.reading("a test read"):
            seen["param"] = engine.pool.param.clone()

    def on_point(point: str, index: int) -> None:
        if point == "updated" and "thread" not in seen:
            seen["thread"] = reader = threading.Thread(target=read)
            reader.start()
            reader.join(timeout=0.3)
            seen["waited"] = reader.is_alive()  # still blocked: the update is in flight
            with pytest.raises(UpdateInFlightError, match="inside the optimizer update"):
                with engine.guard.reading("a hook's read"):
                    pass

    engine.watch_points(on_point)
    engine.step(PLANS[0], _inputs(1, lp))
    seen["thread"].join(timeout=10)  # type: ignore[union-attr]
    assert seen["waited"] is True
    engine.flush_resident()
    assert torch.equal(seen["param"], engine.pool.param.clone()) or engine.resident  # post-step, whole


def test_guard_is_reentrant_for_the_updating_thread() -> None:
    guard = UpdateGuard()
    with guard.updating():
        with guard.updating():
            assert guard.in_update
        assert guard.in_update
    assert not guard.in_update
    with guard.reading("x"), guard.reading("y"):
        pass
