"""The virtual node replays host threads on clocks of their own, and the whole iteration on its streams (issue 23)."""

from __future__ import annotations

import pytest

from lightning_dos.commands.options import footprint_of
from lightning_dos.commands.simulate import replay_iteration, sub_group_sizes
from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.iteration_plan import shortest_iteration_plan
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.planning.profiles import load_profile
from lightning_dos.sim import simstreams
from lightning_dos.sim.replay import ReplayResult, replay
from lightning_dos.sim.sanitizer import HOST, TRAINING, LoggedOp
from lightning_dos.sim.simstreams import COMPUTE, H2D, LP_H2D, UPDATE
from lightning_dos.sim.timed_iteration import BACKWARD_END

RATES, META = load_profile("paper-h100x4")
#: Elements the paper node's host updates in one second (host_adam_eps), per rank.
ONE_HOST_SECOND = int(RATES.host_adam_eps)


def _kernel(seconds: float, stream: int = COMPUTE, host: int = TRAINING) -> LoggedOp:
    return LoggedOp("op", stream, "forward", host=host, seconds=seconds)


def _host_work(seconds: float, host: int = HOST) -> LoggedOp:
    return LoggedOp("op", HOST, "host_adam", elements=round(seconds * ONE_HOST_SECOND), host=host)


def _span(result: ReplayResult, lane: str, stream: int) -> list[tuple[float, float]]:
    return [(s.start_s, s.end_s) for s in result.spans if s.lane == lane and s.stream == str(stream)]


def test_host_threads_run_on_clocks_of_their_own_and_meet_at_marks() -> None:
    """The update's thread works on the host for 1 s while the training thread's first kernel runs; the training
    thread's second kernel waits for the update's mark (a condition variable), not for the update's whole log."""
    log = [
        _host_work(1.0),
        LoggedOp("host_record", event=-7, host=HOST),
        _host_work(1.0),
        _kernel(0.5),
        LoggedOp("host_wait", event=-7, host=TRAINING),
        _kernel(0.2),
    ]
    result = replay(log, RATES)
    assert _span(result, "forward", COMPUTE) == [pytest.approx((0.0, 0.5)), pytest.approx((1.0, 1.2))]
    assert result.marks_s[-7] == pytest.approx(1.0)
    assert result.host_clock_s == {HOST: pytest.approx(2.0), TRAINING: pytest.approx(1.0)}
    assert result.time_s == pytest.approx(2.0)


def test_a_stream_waits_for_the_record_another_thread_issues_later() -> None:
    """The training thread's stream waits (at time 0) for an event the update's thread records only after 1 s of host
    work and a 0.1 s upload: its kernel runs after both, as on a GPU once the record is issued."""
    upload = int(0.1 * RATES.h2d_bps)
    log = [
        LoggedOp("wait", COMPUTE, event=5, host=TRAINING),
        _kernel(0.3),
        _host_work(1.0),
        LoggedOp("op", H2D, "upload", nbytes=upload),
        LoggedOp("record", H2D, event=5),
    ]
    result = replay(log, RATES)
    assert _span(result, "upload", H2D) == [pytest.approx((1.0, 1.1))]
    assert _span(result, "forward", COMPUTE) == [pytest.approx((1.1, 1.4))]


def test_the_upload_copy_engine_takes_copies_in_the_order_they_became_runnable() -> None:
    """Two streamed uploads of 0.1 s each are issued at 0 on one stream; a host sub-group's 16-bit upload of 0.01 s
    is issued at 0.02 s on the other, once its CPU work is done. It waits for the upload in flight, then goes before
    the second streamed upload, which became runnable only when the first was over (at 0.1 s), although the engine
    issued it earlier. The same when the second upload's stream first waits for an event that is already met."""
    tenth, hundredth = int(0.1 * RATES.h2d_bps), int(0.01 * RATES.h2d_bps)
    for met_wait in (False, True):
        log = [
            LoggedOp("record", UPDATE, event=9),
            LoggedOp("op", H2D, "upload", nbytes=tenth),
            *([LoggedOp("wait", H2D, event=9)] if met_wait else []),
            LoggedOp("op", H2D, "upload", nbytes=tenth),
            _host_work(0.02),
            LoggedOp("op", LP_H2D, "lp_upload", nbytes=hundredth),
        ]
        result = replay(log, RATES)
        assert _span(result, "upload", H2D) == [pytest.approx((0.0, 0.1)), pytest.approx((0.11, 0.21))], met_wait
        assert _span(result, "lp_upload", LP_H2D) == [pytest.approx((0.1, 0.11))], met_wait


def test_a_synchronisation_waits_for_the_work_issued_before_it_only() -> None:
    """At 0.1 s the training thread synchronises the device: it waits for the update thread's kernel issued at 0, not
    for the one that thread issues at 0.5 s, nor would it without that kernel (the log's order does not matter)."""
    log = [
        _host_work(0.1, host=TRAINING),
        LoggedOp("sync", host=TRAINING),
        _kernel(1.0, UPDATE, host=HOST),
        _host_work(0.5),
        _kernel(1.0, COMPUTE, host=HOST),
    ]
    result = replay(log, RATES)
    assert result.host_clock_s[TRAINING] == pytest.approx(1.0)
    assert _span(result, "forward", COMPUTE) == [pytest.approx((0.5, 1.5))]
    assert result.time_s == pytest.approx(1.5)


def test_kernels_of_different_streams_run_side_by_side_and_a_streams_own_in_order() -> None:
    log = [_kernel(1.0, COMPUTE), _kernel(1.0, UPDATE), _kernel(0.5, UPDATE)]
    result = replay(log, RATES)
    assert _span(result, "forward", COMPUTE) == [pytest.approx((0.0, 1.0))]
    assert _span(result, "forward", UPDATE) == [pytest.approx((0.0, 1.0)), pytest.approx((1.0, 1.5))]
    assert result.busy_s["compute"] == pytest.approx(2.5)


# -- the whole iteration ------------------------------------------------------------------------------------------

FORWARD_S, BACKWARD_S = 0.5, 1.0


def _twenty_b(mode: str) -> tuple[list[int], object, object]:
    """20B on paper-h100x4 at the default settings: the sizes, the footprint the strategy runs and ``mode``'s plan."""
    footprint = footprint_of()
    sizes = sub_group_sizes(20_000_000_000, META["gpus_per_node"], 100_000_000)
    plan = auto_plan(sizes, RATES, 2, int(0.9 * META["device_free_bytes"]), footprint=footprint).update_plan
    if mode != "off":
        plan = shortest_iteration_plan(
            UpdateProblem(sizes, RATES, 2, footprint), plan, TrainingPhases(FORWARD_S, BACKWARD_S, mode)
        )
    return sizes, plan, footprint


def _landed(result: ReplayResult, plan: object) -> dict[int, float]:
    """When each sub-group's 16-bit result is on the device: a host one's upload, a device one's cast."""
    landed: dict[int, float] = {}
    for s in result.spans:
        host = plan.places[s.sub_group] == Place.HOST if s.sub_group >= 0 else False
        if (s.lane == "lp_upload" and host) or (s.lane == "cast" and not host):
            landed[s.sub_group] = max(landed.get(s.sub_group, 0.0), s.end_s)
    return landed


@pytest.mark.parametrize("mode", ["off", "forward", "auto"])
def test_the_whole_iteration_replays_backward_the_update_and_the_next_forward(mode: str) -> None:
    sizes, plan, footprint = _twenty_b(mode)
    result, races = replay_iteration(
        UpdateProblem(sizes, RATES, 2, footprint), plan, TrainingPhases(FORWARD_S, BACKWARD_S, mode)
    )
    assert races == 0
    spans = {lane: [s for s in result.spans if s.lane == lane] for lane in ("backward", "forward", "grad_download")}
    assert sum(s.end_s - s.start_s for s in spans["backward"]) == pytest.approx(BACKWARD_S)
    assert sum(s.end_s - s.start_s for s in spans["forward"]) == pytest.approx(FORWARD_S)
    # DeepSpeed's copy of each reduced gradient (2 bytes per element), each after its layers' backward.
    assert [s.sub_group for s in spans["grad_download"]] == list(reversed(range(len(sizes))))
    assert sum(s.amount for s in spans["grad_download"]) == pytest.approx(2 * sum(sizes), rel=1e-3)
    backward_done = {s.sub_group: s.end_s for s in spans["backward"]}
    assert all(s.start_s >= backward_done[s.sub_group] - 1e-9 for s in spans["grad_download"])
    backward_end = result.marks_s[BACKWARD_END]
    assert backward_end >= BACKWARD_S
    # The next forward: after backward, in order, each sub-group's layers once its 16-bit result has landed.
    landed = _landed(result, plan)
    assert set(landed) == set(range(len(sizes)))
    assert [s.sub_group for s in spans["forward"]] == list(range(len(sizes)))
    for s in spans["forward"]:
        assert s.start_s >= max(backward_end, landed[s.sub_group]) - 1e-9, s
    update = [s for s in result.spans if s.lane not in ("backward", "forward", "grad_download")]
    if mode == "off":  # the forward waits for the whole update (its step returned)
        assert spans["forward"][0].start_s >= max(s.end_s for s in update) - 1e-9
    else:  # it runs beside the update
        assert spans["forward"][0].start_s < max(s.end_s for s in update)
    early = [s for s in update if s.lane == "host_adam" and s.start_s < backward_end]
    if mode == "auto":  # host sub-groups updated during backward, each once its gradient has landed
        assert len(early) >= 5
        copied = {s.sub_group: s.end_s for s in spans["grad_download"]}
        assert all(s.start_s >= copied[s.sub_group] - 1e-9 for s in early)
    else:
        assert not early


def test_the_engines_kernels_on_the_forwards_stream_would_hold_the_forward_back(monkeypatch) -> None:  # noqa: ANN001
    """Why the engine's device kernels have a stream of their own: each waits for its sub-group's upload, and on the
    stream the next forward runs on (the caller's) every forward kernel would queue behind those waits."""
    sizes, plan, footprint = _twenty_b("forward")
    own, _ = replay_iteration(
        UpdateProblem(sizes, RATES, 2, footprint), plan, TrainingPhases(FORWARD_S, BACKWARD_S, "forward")
    )
    monkeypatch.setattr(simstreams.SimStreams, "compute", property(lambda streams: streams.current))
    shared, races = replay_iteration(
        UpdateProblem(sizes, RATES, 2, footprint), plan, TrainingPhases(FORWARD_S, BACKWARD_S, "forward")
    )
    assert races == 0  # still correct: only slower
    assert shared.time_s > 1.08 * own.time_s, (shared.time_s, own.time_s)


@pytest.mark.parametrize(("backward_s", "early"), [(10.0, 8), (0.001, 1)])
def test_under_auto_the_engine_takes_host_sub_groups_while_backward_lasts_on_the_replayed_clock(
    backward_s: float, early: int
) -> None:
    """Eight host sub-groups of 100M elements (52 ms each on the CPU). A 10 s backward leaves time for all of them
    while it lasts (the first sub-group's as its gradient lands, at backward's end). A 1 ms backward leaves time
    for one: DeepSpeed's copies of the gradients (4 ms each) make backward end at 33 ms, when the CPU is still on
    the first; the rest of the step updates the others after it."""
    sizes = [100_000_000] * 8
    plan = Plan((Place.HOST,) * 8, 1)
    result, races = replay_iteration(UpdateProblem(sizes, RATES, 2), plan, TrainingPhases(0.5, backward_s, "auto"))
    backward_end = result.marks_s[BACKWARD_END]
    assert backward_end == pytest.approx(backward_s + 0.004 if early == 8 else 8 * 0.004, rel=0.01)
    updated = sorted((s for s in result.spans if s.lane == "host_adam"), key=lambda s: s.start_s)
    assert races == 0 and len(updated) == 8
    assert [s.start_s <= backward_end + 1e-9 for s in updated] == [True] * early + [False] * (8 - early)
