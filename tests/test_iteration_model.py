"""The whole-iteration model (engine/iteration.py) and ``lightning-dos simulate --forward-s/--backward-s``."""

from __future__ import annotations

import json

import pytest

from lightning_dos.cli import main as cli_main
from lightning_dos.engine.iteration import UpdateTimeline, iteration_plan, iteration_s, predicted_timeline
from lightning_dos.engine.perfmodel import predict
from lightning_dos.engine.plan import Place, Plan
from lightning_dos.profiles import load_profile
from lightning_dos.sim.simulate import sub_group_sizes

H, D = Place.HOST, Place.DEVICE


def test_a_hand_worked_iteration_for_each_mode() -> None:
    # Two equal host sub-groups, 2 s of CPU each, landing at 2 s and 4 s; forward 2 s (1 s per sub-group's
    # layers), backward 4 s (sub-group 1's gradient is final at 2 s, sub-group 0's at 4 s).
    timeline = UpdateTimeline(land_s=(2.0, 4.0), host_s=(2.0, 2.0), upload_s=(0.0, 0.0), device_end_s=0.0, total_s=4.0)
    got = iteration_s([1, 1], Plan((H, H)), timeline, forward_s=2.0, backward_s=4.0)
    # off: 2 + 4 + 4. forward: sub-group 0's layers wait for it (2 s), sub-group 1's for it (4 s): 4 + 5.
    # auto: the CPU updates sub-group 1 from 2 s to 4 s during backward, then sub-group 0 by 2 s after it: 4 + 4.
    assert got == {"off": 10.0, "forward": 9.0, "auto": 8.0}


@pytest.fixture(scope="module")
def node() -> tuple:
    rates, _ = load_profile("paper-h100x4")
    return rates, sub_group_sizes(int(20e9), 4, int(1e8))


def test_the_predicted_timeline_is_predicts_own_arithmetic_per_sub_group(node: tuple) -> None:
    rates, sizes = node
    plan = Plan(tuple(D if i < 12 else H for i in range(len(sizes))), 2)
    timeline = predicted_timeline(sizes, plan, rates, 2)
    assert timeline.total_s == predict(sizes, plan, rates, 2).time_s
    host = [timeline.land_s[i] for i in plan.host_indices]
    assert host == sorted(host) and host[-1] <= timeline.total_s + 1e-12
    assert timeline.device_end_s == pytest.approx(max(timeline.land_s[i] for i in plan.streamed_indices))
    assert all(timeline.host_s[i] == 0 for i in plan.streamed_indices)


def test_auto_plans_by_arrival_and_overlaps_more_than_forward(node: tuple) -> None:
    rates, sizes = node
    plan = iteration_plan(sizes, rates, 2, 2, forward_s=0.5, backward_s=1.0, mode="auto")
    streamed = plan.streamed_indices
    assert streamed and streamed[0] == 0 and streamed == list(range(len(streamed))), "device sub-groups come first"
    host_first = Plan(tuple(H if i < len(sizes) - len(streamed) else D for i in range(len(sizes))), 2)
    times = {
        p: iteration_s(sizes, p, predicted_timeline(sizes, p, rates, 2), 0.5, 1.0)["auto"] for p in (plan, host_first)
    }
    assert times[plan] < times[host_first], "placing by arrival is what makes auto shorter"


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
    assert replayed["off"] == pytest.approx(forward + backward + got["update_s"])
    assert replayed["stock"] >= replayed["off"] >= replayed["forward"] >= replayed["auto"] >= forward + backward
    for mode in ("off", "forward", "auto"):
        assert replayed[mode] == pytest.approx(predicted[mode], rel=0.10), mode
        assert got["iteration_plans"][mode]["races"] == 0


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
