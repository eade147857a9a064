"""The whole-iteration model (model/iteration.py) and ``lightning-dos simulate --forward-s/--backward-s``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lightning_dos.commands.main import main as cli_main
from lightning_dos.commands.options import footprint_of
from lightning_dos.commands.simulate import sub_group_sizes
from lightning_dos.engine.loop import InterleavedUpdate
from lightning_dos.integration.phases import IterationPhases
from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.iteration import (
    Speculation,
    UpdateTimeline,
    iteration_s,
    predicted_timeline,
    speculation_of,
)
from lightning_dos.model.iteration_plan import iteration_plan, shortest_iteration_plan
from lightning_dos.model.perfmodel import device_bytes, predict, rates_for
from lightning_dos.model.plan import Place, Plan, parse_gpu_fraction
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.model.update_rules import ADAM_FP32
from lightning_dos.planning.profiles import load_profile
from lightning_dos.planning.scheduler import PlacementScheduler

H, D = Place.HOST, Place.DEVICE


def test_a_hand_worked_iteration_for_each_mode() -> None:
    # Two equal host sub-groups, 2 s of CPU each, landing at 2 s and 4 s; forward 2 s (1 s per sub-group's
    # layers), backward 4 s (sub-group 1's gradient is final at 2 s, sub-group 0's at 4 s).
    timeline = UpdateTimeline(land_s=(2.0, 4.0), host_s=(2.0, 2.0), upload_s=(0.0, 0.0), device_end_s=0.0, total_s=4.0)
    got = iteration_s([1, 1], Plan((H, H)), timeline, forward_s=2.0, backward_s=4.0)
    # off: 2 + 4 + 4. forward: sub-group 0's layers wait for it (2 s), sub-group 1's for it (4 s): 4 + 5.
    # auto: the CPU updates sub-group 1 from 2 s to 4 s during backward, then sub-group 0 by 2 s after it: 4 + 4.
    assert got == {"off": 10.0, "forward": 9.0, "auto": 8.0}


def test_a_hand_worked_speculative_iteration_committed_and_clipped() -> None:
    # The same two sub-groups with clipping on, a speculative update costing half an update more (torch's kernels
    # copy the state first). Sub-group 1 is speculated from 2 s to 5 s, ending after backward (4 s): it lands 1 s
    # after it; sub-group 0 then takes the CPU from 1 s to 3 s after backward. Committed: forward waits 3 s for
    # sub-group 0, runs 1 s, then sub-group 1's 1 s: 4 + 5. Clipped: sub-group 1's result is dropped (the CPU is
    # free 1 s after backward), then both are updated: they land 3 s and 5 s after backward (4 + 6). At a commit
    # rate of 0.5, the mean: 4 + 5.5.
    timeline = UpdateTimeline(land_s=(2.0, 4.0), host_s=(2.0, 2.0), upload_s=(0.0, 0.0), device_end_s=0.0, total_s=4.0)

    def auto(rate: float, copy_share: float = 0.5) -> float:
        speculation = Speculation(commit_rate=rate, copy_share=copy_share)
        return iteration_s([1, 1], Plan((H, H)), timeline, forward_s=2.0, backward_s=4.0, speculation=speculation)[
            "auto"
        ]

    assert auto(1.0) == 9.0 and auto(0.0) == 9.0  # at 0 the engine stops speculating: "forward" (4 + 5)
    assert auto(0.5) == pytest.approx(0.5 * 9.0 + 0.5 * 10.0)
    # A speculative update that costs what an update does: committed, sub-group 1 lands as exact auto's (4 + 4);
    # clipped, the 2 s it ran during backward are lost: 0 + 2 + 2 after backward.
    assert auto(1.0, 0.0) == 8.0 and auto(0.5, 0.0) == pytest.approx(0.5 * 8.0 + 0.5 * 9.0)
    # Out of place the CPU reads each line it writes first (the state, 12 bytes for Adam fp32); a copy, twice that.
    assert speculation_of(1.0).copy_share == pytest.approx(12 / 28)
    assert speculation_of(1.0, out_of_place=False).copy_share == pytest.approx(24 / 28)
    with pytest.raises(ValueError, match="commit rate"):
        speculation_of(1.5)


def test_simulate_with_clipping_weighs_committed_and_clipped_steps(capsys: pytest.CaptureFixture) -> None:
    """20B on paper-h100x4 at forward 0.5 s + backward 1 s with clipping: every step committed beats "forward", a
    run that is always clipped runs as "forward" (its speculation stopped), replays within 10% of the model, no
    race; the spare slots' host memory is reported."""
    runs = {}
    for rate in ("1.0", "0.0"):
        runs[rate] = _simulate(capsys, "--forward-s", "0.5", "--backward-s", "1.0", "--commit-rate", rate)
    committed, clipped = runs["1.0"], runs["0.0"]
    assert committed["iteration_s"]["auto"] < committed["iteration_s"]["forward"]
    assert clipped["iteration_s"]["auto"] <= 1.02 * clipped["iteration_s"]["forward"]
    for got in runs.values():
        assert got["iteration_s"]["auto"] == pytest.approx(got["iteration_predicted_s"]["auto"], rel=0.10)
        assert got["iteration_plans"]["auto"]["races"] == 0 and got["speculation_bytes"] > 0
        assert got["iteration_floor_s"]["auto"] <= min(got["iteration_s"]["auto"], got["iteration_predicted_s"]["auto"])
    # The floor charges the speculative update's write-allocate: committed, it sits above exact auto's (no clipping).
    from lightning_dos.model.iteration import iteration_floor

    sizes, rates = sub_group_sizes(int(20e9), 4, int(1e8)), load_profile("paper-h100x4")[0]
    exact = iteration_floor(UpdateProblem(sizes, rates, 2), 0.5, 1.0)["auto"]
    assert committed["iteration_floor_s"]["auto"] > exact
    assert clipped["iteration_floor_s"]["auto"] == pytest.approx(clipped["iteration_floor_s"]["forward"])
    assert cli_main(["simulate", "--params", "20e9", "--commit-rate", "1.5"]) == 2
    assert "--commit-rate=1.5 is not valid" in capsys.readouterr().err


@pytest.fixture(scope="module")
def node() -> tuple:
    rates, _ = load_profile("paper-h100x4")
    return rates, sub_group_sizes(int(20e9), 4, int(1e8))


def test_the_predicted_timeline_is_predicts_own_arithmetic_per_sub_group(node: tuple) -> None:
    rates, sizes = node
    plan = Plan(tuple(D if i < 12 else H for i in range(len(sizes))), 2)
    timeline = predicted_timeline(UpdateProblem(sizes, rates, 2), plan)
    assert timeline.total_s == predict(sizes, plan, rates, 2).time_s
    host = [timeline.land_s[i] for i in plan.host_indices]
    assert host == sorted(host) and host[-1] <= timeline.total_s + 1e-12
    # A streamed sub-group lands with its cast on the device; its state's download home follows it.
    streamed = [timeline.land_s[i] for i in plan.streamed_indices]
    assert streamed == sorted(streamed)
    last = plan.streamed_indices[-1]
    download_s = ADAM_FP32.streamed_down * sizes[last] / rates_for(rates, ADAM_FP32).duplex_d2h_bps
    assert timeline.device_end_s == pytest.approx(timeline.land_s[last] + download_s)
    assert all(timeline.host_s[i] == 0 for i in plan.streamed_indices)


def test_auto_plans_by_arrival_and_overlaps_more_than_forward(node: tuple) -> None:
    rates, sizes = node
    plan = iteration_plan(UpdateProblem(sizes, rates, 2), 2, TrainingPhases(0.5, 1.0, "auto"))
    streamed = plan.streamed_indices
    assert streamed[-1] < len(sizes) - 1, "the last sub-group, final first, is the CPU's during backward"
    host_first = Plan(tuple(H if i < len(sizes) - len(streamed) else D for i in range(len(sizes))), 2)
    times = {
        p: iteration_s(sizes, p, predicted_timeline(UpdateProblem(sizes, rates, 2), p), 0.5, 1.0)["auto"]
        for p in (plan, host_first)
    }
    assert times[plan] < times[host_first], "placing by arrival is what makes auto shorter"


def test_auto_spreads_the_cpus_work_during_backward_over_the_partition(node: tuple) -> None:
    """20B on paper-h100x4, forward 0.5 s + backward 1 s: the CPU has time for about 19 of the 50 host updates
    during backward. Under "auto" the plan leaves some host sub-groups for after backward so that those it updates
    during backward are spread over the whole partition (not only the last ones, whose gradients come first), and
    that predicts a shorter iteration than the best plan in which the CPU takes every host sub-group as it comes."""
    rates, sizes = node
    plan = iteration_plan(UpdateProblem(sizes, rates, 2), 2, TrainingPhases(0.5, 1.0, "auto"))
    during = [i for i in plan.host_indices if i not in plan.after_backward]
    assert plan.after_backward and plan.after_backward <= set(plan.host_indices)
    assert min(during) < len(sizes) // 4 and max(during) >= 3 * len(sizes) // 4, during

    def auto(p: Plan) -> float:
        return iteration_s(sizes, p, predicted_timeline(UpdateProblem(sizes, rates, 2), p), 0.5, 1.0)["auto"]

    as_they_come = min(auto(_streamed_first(sizes, k)) for k in range(len(sizes) + 1))
    assert auto(plan) < 0.95 * as_they_come
    # "forward" never updates during backward, so it leaves nothing for after it.
    assert not iteration_plan(UpdateProblem(sizes, rates, 2), 2, TrainingPhases(0.5, 1.0, "forward")).after_backward


def _streamed_first(sizes: list, count: int) -> Plan:
    return Plan(tuple(D if i < count else H for i in range(len(sizes))), 2)


@pytest.mark.parametrize("mode", ["forward", "auto"])
def test_the_iteration_plan_is_at_least_the_best_count_streamed_first_and_no_single_move_improves_it(
    node: tuple, mode: str
) -> None:
    """Forward 1 s + backward 2 s: the plan predicts no longer an iteration than any count of streamed sub-groups
    placed first or last, and (settled within its predictions) neither moving one sub-group between streamed and
    host nor two neighbours trading places predicts a shorter one."""
    rates, sizes = node

    def predicted(plan: Plan) -> float:
        return iteration_s(sizes, plan, predicted_timeline(UpdateProblem(sizes, rates, 2), plan), 1.0, 2.0)[mode]

    plan = iteration_plan(UpdateProblem(sizes, rates, 2), 2, TrainingPhases(1.0, 2.0, mode))
    n = len(sizes)
    contiguous = [_streamed_first(sizes, k) for k in range(n + 1)]
    contiguous += [Plan(tuple(D if i >= n - k else H for i in range(n)), 2) for k in range(n + 1)]
    best_contiguous = min(map(predicted, contiguous))
    assert predicted(plan) < best_contiguous, "spreading streamed sub-groups among the host ones shortens it here"
    if mode == "auto":  # settled within REFINE_PREDICTIONS here (forward needs more at these phases)
        roles = [D if p == D else "late" if i in plan.after_backward else H for i, p in enumerate(plan.places)]

        def plan_of(moved: list) -> Plan:
            after = frozenset(i for i, role in enumerate(moved) if role == "late")
            return Plan(tuple(D if role == D else H for role in moved), 2, after)

        for i in range(n):
            for role in {D, H, "late"} - {roles[i]}:
                moved = list(roles)
                moved[i] = role
                assert predicted(plan_of(moved)) >= predicted(plan) * (1 - 1e-9), (i, role)
            if i + 1 < n and roles[i] != roles[i + 1]:
                traded = list(roles)
                traded[i], traded[i + 1] = roles[i + 1], roles[i]
                assert predicted(plan_of(traded)) >= predicted(plan) * (1 - 1e-9), i


def test_refining_a_plan_moves_only_free_sub_groups_and_stops_at_its_limit() -> None:
    """The refinement never moves a resident sub-group, predicts at most ``limit`` placements, keeps the plan it
    started from when nothing predicts shorter, and leaves host sub-groups for after backward only when asked."""
    from lightning_dos.model.iteration_plan import DEVICE, HOST, LATE, RESIDENT, _refined

    start = (RESIDENT, HOST, HOST, DEVICE, HOST, RESIDENT)
    calls: list[tuple[str, ...]] = []

    def streamed_late(roles: object) -> float:  # shorter the later the streamed sub-groups sit, and each late one
        calls.append(tuple(roles))
        streamed = [i for i, role in enumerate(roles) if role == DEVICE]
        return -sum(streamed) + 1.5 * len(streamed) - 0.1 * sum(role == LATE for role in roles)

    got = _refined(start, streamed_late(start), [1, 2, 3, 4], streamed_late, limit=1000)
    assert got[0] == got[-1] == RESIDENT and all(c[0] == c[-1] == RESIDENT for c in calls)
    assert got == [RESIDENT, HOST, DEVICE, DEVICE, DEVICE, RESIDENT]
    assert LATE not in {role for call in calls for role in call}, "only under auto"
    late = _refined(start, streamed_late(start), [1, 2, 3, 4], streamed_late, limit=1000, late=True)
    assert late == [RESIDENT, LATE, DEVICE, DEVICE, DEVICE, RESIDENT]
    calls.clear()
    assert _refined(start, streamed_late(start), [1, 2, 3, 4], streamed_late, limit=3) != list(start)
    assert len(calls) == 1 + 3
    calls.clear()
    assert _refined(start, -1e9, [1, 2, 3, 4], streamed_late, limit=1000) == list(start)  # nothing beats the start


def _simulate(capsys: pytest.CaptureFixture, *extra: str) -> dict:
    assert cli_main(["simulate", "--params", "20e9", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("scale", [1, 4])
def test_simulate_times_the_whole_iteration_replayed_and_predicted(
    tmp_path, capsys: pytest.CaptureFixture, scale: int
) -> None:  # noqa: ANN001
    forward, backward = 0.5 * scale, 1.0 * scale
    trace = str(tmp_path / "trace.json")
    got = _simulate(capsys, "--forward-s", str(forward), "--backward-s", str(backward), "--trace", trace)
    replayed, predicted = got["iteration_s"], got["iteration_predicted_s"]
    assert set(replayed) == set(predicted) == {"off", "forward", "auto", "stock"}
    assert got["forward_backward_s"] == forward + backward
    # Off: backward, DeepSpeed's copy of the gradient made final last (the first sub-group's, 2 bytes per element,
    # after backward's last kernel), the update, then the forward.
    last_copy = 2 * 100_000_000 / load_profile("paper-h100x4")[0].d2h_bps
    assert replayed["off"] == pytest.approx(forward + backward + last_copy + got["update_s"])
    assert replayed["stock"] >= replayed["off"] >= replayed["forward"] and replayed["auto"] >= forward + backward
    # "auto" is speculative (issue 61): the model times its out-of-place updates 2-5% faster than the replay does
    # (scale 4: predicted 6.063 s against forward's 6.106 s, replayed 6.214 s against 6.074 s), so where the two are
    # that close "auto" may replay a little behind "forward". Held to that margin until the model's term is found.
    assert replayed["auto"] <= 1.03 * replayed["forward"]
    floor = got["iteration_floor_s"]
    for mode in ("off", "forward", "auto"):
        assert replayed[mode] == pytest.approx(predicted[mode], rel=0.10), mode
        assert forward + backward <= floor[mode] <= min(replayed[mode], predicted[mode]), mode
        assert got["iteration_plans"][mode]["races"] == 0
        written = json.loads(Path(got["iteration_plans"][mode]["trace"]).read_text())["traceEvents"]
        lanes = {event["name"] for event in written if event["ph"] == "X"}
        assert {"backward", "grad_download", "forward", "host_adam"} <= lanes, lanes


def test_the_overlap_targets_on_the_papers_node_at_the_default_settings(capsys: pytest.CaptureFixture) -> None:
    """20B on paper-h100x4, forward 0.5 s + backward 1 s, default settings, simulated (the engine's schedule replayed
    on the virtual node): "auto" within 0.75x of "off" and within 1.4x of forward + backward alone (the update mostly
    hidden), "forward" within 0.88x of "off", each replay within 10% of the model's prediction and above what no
    schedule could beat. Since issue 61 "auto"'s updates during backward are speculative with clipping or without:
    out of place, they pay the CPU's write-allocate (2.089 s, 1.39x, where the exact ones of before gave 1.918 s,
    1.28x, but ended a run on a step DeepSpeed skips)."""
    got = _simulate(capsys, "--forward-s", "0.5", "--backward-s", "1.0")
    replayed, predicted, floor = got["iteration_s"], got["iteration_predicted_s"], got["iteration_floor_s"]
    assert replayed["auto"] <= 0.75 * replayed["off"], replayed
    assert replayed["forward"] <= 0.88 * replayed["off"], replayed
    assert replayed["auto"] <= 1.4 * got["forward_backward_s"], replayed
    for mode in ("off", "forward", "auto"):
        assert replayed[mode] == pytest.approx(predicted[mode], rel=0.10), mode
        assert floor[mode] <= replayed[mode], mode


def test_no_placement_predicts_an_iteration_below_the_floor() -> None:
    """The model's iteration, for random placements (host sub-groups left for after backward included), sizes,
    rates and phase times, is never below :func:`iteration_floor`, in any mode: the floor only relaxes the
    engine's rules. And it is not vacuous: on the paper's node the best plan comes within 5% of it."""
    import random

    from lightning_dos.model.iteration import iteration_floor

    base, _ = load_profile("paper-h100x4")
    rng = random.Random(23)
    for _ in range(300):
        n = rng.randint(1, 12)
        sizes = [rng.randint(1, 10) * 10_000_000 for _ in range(n)]
        rates = base.scaled(rng.uniform(0.2, 5.0))
        places = tuple(rng.choice((H, D)) for _ in range(n))
        late = frozenset(i for i in range(n) if places[i] == H and rng.random() < 0.5)
        plan = Plan(places, rng.randint(1, 3), late)
        forward, backward = rng.uniform(0.01, 0.5), rng.uniform(0.01, 1.0)
        # Clipping on in half the draws: speculation at a random commit rate and write-allocate cost.
        clip = Speculation(rng.choice((0.0, rng.random(), 1.0)), rng.uniform(0.0, 1.0)) if rng.random() < 0.5 else None
        got = iteration_s(
            sizes, plan, predicted_timeline(UpdateProblem(sizes, rates, 2), plan), forward, backward, clip
        )
        floor = iteration_floor(UpdateProblem(sizes, rates, 2), forward, backward, speculation=clip)
        for mode in ("off", "forward", "auto"):
            assert floor[mode] <= got[mode] * (1 + 1e-9), (mode, floor, got, sizes, plan, forward, backward, clip)
    sizes = sub_group_sizes(int(20e9), 4, int(1e8))
    plan = iteration_plan(UpdateProblem(sizes, base, 2), 2, TrainingPhases(0.5, 1.0, "auto"))
    best = iteration_s(sizes, plan, predicted_timeline(UpdateProblem(sizes, base, 2), plan), 0.5, 1.0)["auto"]
    assert best <= 1.05 * iteration_floor(UpdateProblem(sizes, base, 2), 0.5, 1.0)["auto"]


def test_the_least_update_time_is_the_exact_minimum_over_the_streamed_share() -> None:
    """:func:`least_update_s` (bisection) is below every streamed share's time on a fine grid and within 0.1% of the
    grid's best; with resident room charged nothing, the floor only falls."""
    from lightning_dos.model.iteration import iteration_floor
    from lightning_dos.model.perfmodel import least_update_s, link_seconds

    rates, _ = load_profile("paper-h100x4")
    host = 1 / rates.host_adam_eps + 1 / rates.host_cast_eps

    def t(n: float, r: float) -> float:
        up = n * (16 * r + 2 * (1 - r))
        return max(n * (1 - r) * host, link_seconds(up, 12 * n * r, rates), n * r / rates.device_adam_eps)

    for n in (1e6, 3.1e9, 5e9):
        grid = min(t(n, k / 10_000) for k in range(10_001))
        assert least_update_s(n, rates, 2) <= grid <= least_update_s(n, rates, 2) * 1.001
    sizes = sub_group_sizes(int(20e9), 4, int(1e8))
    plain = iteration_floor(UpdateProblem(sizes, rates, 2), 0.5, 1.0)
    roomy = iteration_floor(UpdateProblem(sizes, rates, 2), 0.5, 1.0, resident_room=int(25.6e9))
    assert all(roomy[mode] <= plain[mode] for mode in plain)


def test_simulate_prints_the_iteration_table(tmp_path, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    args = ["simulate", "--params", "20e9", "--forward-s", "0.5", "--backward-s", "1", "--trace", str(tmp_path / "t")]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "iteration s, forward 0.5 s + backward 1 s" in out
    for row in ("stock", "off", "forward", "auto", "forward + backward"):
        assert f"│ {row}" in out, row
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--forward-s", "0.5"], "--forward-s and --backward-s go together"),
        (["--forward-s", "0", "--backward-s", "1"], "must be positive seconds"),
        (["--forward-s", "nan", "--backward-s", "1"], "must be positive seconds"),
    ],
)
def test_simulate_refuses_bad_phase_times(capsys: pytest.CaptureFixture, extra: list, message: str) -> None:
    assert cli_main(["simulate", "--params", "20e9", *extra]) == 2
    assert message in capsys.readouterr().err


class _OnAnAccelerator(InterleavedUpdate):
    """The engine, told it runs on an accelerator with ``free_after_backward`` device bytes free after backward
    (what ``torch.cuda.mem_get_info`` says on a GPU); the scheduler plans device work only for one."""

    free_after_backward = 0

    def device_budget(self) -> int | None:
        if self.budget.gpu_memory_budget is not None:
            return self.budget.gpu_memory_budget
        return int(0.9 * self.free_after_backward)


def _scaled_scheduler(overlap: str, budget: int | None = None) -> tuple[PlacementScheduler, list[int], object]:
    """The strategy's scheduler at 1/100,000 of 20B on paper-h100x4 (times and memory scale alike), with the
    strategy's engine settings (resident gradients kept) and ``budget`` as its gpu_memory_budget."""
    rates, meta = load_profile("paper-h100x4")
    engine = _OnAnAccelerator(
        [50_000], [0], 1_000, torch.device("cpu"), torch.float32, pin=False, keep_resident_grads=True
    )
    engine.budget.limit(budget)
    engine.free_after_backward = meta["device_free_bytes"] // 100_000
    engine.device = torch.device("cuda", 0)
    scheduler = PlacementScheduler(parse_gpu_fraction("auto"), engine, lambda device: rates, overlap=overlap)
    return scheduler, list(engine.sizes), rates


def _iteration(sizes: list[int], plan: Plan, rates: object, mode: str, f: float, b: float) -> float:
    return iteration_s(sizes, plan, predicted_timeline(UpdateProblem(sizes, rates, 4), plan), f, b)[mode]


@pytest.mark.parametrize("overlap", ["auto", "forward"])
def test_with_forward_and_backward_measured_auto_places_for_the_whole_iteration(overlap: str) -> None:
    """Forward 0.5 s and backward 1 s at 20B (scaled): once the framework hands them over, the next step's plan is
    whichever of the update's best and the iteration's best (within the same buffers) predicts the shorter
    iteration under that overlap; under "auto" that is the iteration's, by far."""
    scheduler, sizes, rates = _scaled_scheduler(overlap)
    assert scheduler.wants_phases
    update_best, _ = scheduler(1)
    f, b = 0.5e-5, 1.0e-5
    scheduler.observe_phases(f, b)
    plan, _ = scheduler(2)
    assert scheduler.phases == (f, b)
    candidate = iteration_plan(
        UpdateProblem(sizes, rates, 4), update_best.device_buffers, TrainingPhases(f, b, overlap)
    )
    times = {p: _iteration(sizes, p, rates, overlap, f, b) for p in (update_best, candidate)}
    assert plan == min(times, key=times.get)
    assert plan.device_buffers <= update_best.device_buffers  # no more device memory than the update's plan
    if overlap == "auto":
        assert plan == candidate and times[candidate] < 0.95 * times[update_best], times
    assert scheduler(3)[0] == plan  # kept until the next re-plan


def test_with_overlap_off_the_plan_is_the_updates_own_best() -> None:
    scheduler, _, _ = _scaled_scheduler("off")
    assert not scheduler.wants_phases
    update_best, _ = scheduler(1)
    scheduler.observe_phases(0.5e-5, 1.0e-5)
    assert scheduler(2)[0] == update_best


def test_a_rank_that_could_not_measure_keeps_the_plan() -> None:
    scheduler, _, _ = _scaled_scheduler("auto")
    update_best, _ = scheduler(1)
    scheduler.observe_phases(0.0, 0.0)  # a micro-batch missed a mark: zeros, so the ranks still plan together
    assert scheduler(2)[0] == update_best and scheduler.phases is None


def test_an_unknown_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match="overlap must be one of off, forward, auto, got 'backward'"):
        PlacementScheduler(parse_gpu_fraction("auto"), None, lambda device: None, overlap="backward")


def _phases_of(device: torch.device, work: object) -> tuple[float, float] | None:
    """Two micro-batches, each ``work(1)`` as forward and ``work(2)`` as backward, timed by IterationPhases."""
    phases = IterationPhases(device)
    for _ in range(2):
        phases.forward_begins()
        work(1)
        phases.backward_begins()
        work(2)
        phases.backward_ends()
    return phases.seconds()


def test_iteration_phases_add_up_the_micro_batches_on_the_hosts_clock() -> None:
    forward_s, backward_s = _phases_of(torch.device("cpu"), lambda k: time.sleep(0.02 * k))
    assert 0.04 <= forward_s < backward_s and backward_s >= 0.08


def test_an_iteration_with_a_missing_mark_has_no_phases() -> None:
    phases = IterationPhases(torch.device("cpu"))
    assert phases.seconds() is None  # nothing marked
    phases.forward_begins()
    phases.backward_begins()
    assert phases.seconds() is None  # backward never ended (an interruption)
    phases.backward_ends()
    phases.forward_begins()  # a forward without backward
    assert phases.seconds() is None


def test_with_a_budget_the_iteration_plan_keeps_the_resident_sub_groups_and_their_memory(
    capsys: pytest.CaptureFixture,
) -> None:
    """20B on paper-h100x4 with a 25.6 GB budget (resident state allowed), forward 0.5 s and backward 1 s: the
    iteration's plan keeps the update's resident sub-groups, needs no more device memory, and under "auto" moves
    streamed sub-groups to the host (updated during backward), replayed within 1.3x of forward + backward."""
    rates, _ = load_profile("paper-h100x4")
    sizes = sub_group_sizes(int(20e9), 4, int(1e8))
    fp = footprint_of()
    update_best = auto_plan(sizes, rates, 2, int(25.6e9), allow_resident=True, footprint=fp).update_plan
    assert update_best.resident_indices and update_best.streamed_indices
    # "auto" is speculative (issue 61), as simulate plans it: every step committed.
    spec = speculation_of(1.0, fp)
    plan = shortest_iteration_plan(
        UpdateProblem(sizes, rates, 2, fp), update_best, TrainingPhases(0.5, 1.0, "auto"), speculation=spec
    )
    assert plan.resident_indices == update_best.resident_indices
    assert device_bytes(sizes, plan, footprint=fp) <= device_bytes(sizes, update_best, footprint=fp) <= 25.6e9
    assert len(plan.streamed_indices) < len(update_best.streamed_indices)
    got = _simulate(capsys, "--budget", "25.6e9", "--forward-s", "0.5", "--backward-s", "1.0")
    assert got["iteration_plans"]["auto"]["streamed"] == len(plan.streamed_indices)
    assert got["iteration_s"]["auto"] <= 1.3 * got["forward_backward_s"], got["iteration_s"]


def test_with_a_budget_the_scheduler_keeps_its_resident_sub_groups_and_places_the_rest_for_the_iteration() -> None:
    scheduler, sizes, rates = _scaled_scheduler("auto", budget=256_000)  # 25.6 GB at 1/100,000
    update_best, _ = scheduler(1)
    assert update_best.resident_indices, "a budget allows resident state"
    f, b = 0.5e-5, 1.0e-5
    scheduler.observe_phases(f, b)
    plan, _ = scheduler(2)
    fp = scheduler.footprint
    assert plan.resident_indices == update_best.resident_indices
    assert device_bytes(sizes, plan, footprint=fp) <= device_bytes(sizes, update_best, footprint=fp) <= 256_000
    before, after = (_iteration(sizes, p, rates, "auto", f, b) for p in (update_best, plan))
    assert after < 0.9 * before, (before, after)


def test_contention_slows_the_overlapped_modes_and_not_off() -> None:
    """Calibrated contention (issue 52, point 2) in the iteration: the host update beside the training thread at its
    share (``overlap_host_speed``) and the next forward beside the update at its (``overlap_launch_speed``) lengthen
    ``forward`` and ``auto``, each by no more than the slowdown itself; ``off`` runs nothing side by side."""
    from dataclasses import replace

    from lightning_dos.model.iteration import mode_iteration_s

    rates, _ = load_profile("paper-h100x4")
    sizes = [100_000_000] * 20
    plan = parse_gpu_fraction(0.4).plan(len(sizes), sizes=sizes)
    alone = {
        m: mode_iteration_s(UpdateProblem(sizes, rates, 2), plan, TrainingPhases(1.0, 2.0, m))
        for m in ("off", "forward", "auto")
    }
    for shares in ({"overlap_host_speed": 0.5}, {"overlap_launch_speed": 0.5}):
        slowed = replace(rates, **shares)
        charged = {
            m: mode_iteration_s(UpdateProblem(sizes, slowed, 2), plan, TrainingPhases(1.0, 2.0, m)) for m in alone
        }
        assert charged["off"] == pytest.approx(alone["off"]), shares
        for mode in ("forward", "auto"):
            assert alone[mode] < charged[mode] <= 2 * alone[mode], (shares, mode, alone, charged)
