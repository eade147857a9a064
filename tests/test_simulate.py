"""The engine's logged schedule replayed on a virtual node (simulated figures, not measurements)."""

from __future__ import annotations

import json

import pytest

from lightning_dos.cli import main
from lightning_dos.engine.perfmodel import HardwareRates, choose_plan
from lightning_dos.profiles import load_profile
from lightning_dos.sim.replay import replay
from lightning_dos.sim.sanitizer import HOST, LoggedOp
from lightning_dos.sim.simstreams import D2H, H2D
from lightning_dos.sim.simulate import auto_plan, simulate, sub_group_sizes

RATES = HardwareRates(1e9, 1e10, 1e11, 50e9, 50e9, 25e9, 20e9)


def test_replay_uses_solo_rates_alone_and_duplex_rates_together() -> None:
    alone = replay([LoggedOp("op", H2D, "upload", nbytes=50_000_000)], RATES)
    assert alone.time_s == pytest.approx(1e-3)
    both = replay(
        [LoggedOp("op", H2D, "upload", nbytes=25_000_000), LoggedOp("op", D2H, "download", nbytes=20_000_000)], RATES
    )
    assert both.time_s == pytest.approx(1e-3)  # 25 MB at 25 GB/s beside 20 MB at 20 GB/s
    assert both.h2d_bytes == 25_000_000 and both.d2h_bytes == 20_000_000


def test_replay_orders_work_by_waits_and_blocks_the_host_on_host_waits() -> None:
    log = [
        LoggedOp("op", H2D, "upload", nbytes=50_000_000),  # 1 ms
        LoggedOp("record", H2D, event=1),
        LoggedOp("wait", D2H, event=1),
        LoggedOp("op", D2H, "download", nbytes=50_000_000),  # 1 ms, after the upload
        LoggedOp("record", D2H, event=2),
        LoggedOp("host_wait", event=2),
        LoggedOp("op", HOST, "host_adam", elements=1_000_000),  # 1 ms, after the host wait
    ]
    result = replay(log, RATES)
    assert result.time_s == pytest.approx(3e-3)
    assert result.busy_share()["host"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("params", [7e9, 13e9, 20e9])
@pytest.mark.parametrize("resident", [True, False], ids=["auto within an explicit budget", "default auto"])
def test_replayed_engine_schedule_agrees_with_the_performance_model(params: float, resident: bool) -> None:
    rates, meta = load_profile("paper-h100x4")
    sizes = sub_group_sizes(int(params), meta["gpus_per_node"], 100_000_000)
    if resident:  # an explicit budget (memory spare at the forward/backward peak): resident state allowed in it
        plan = auto_plan(sizes, rates, 2, meta["device_free_bytes"], allow_resident=True)
        assert plan.resident_indices
    else:  # as the strategy, `plan` and `simulate` choose it by default: streaming only, within 90% of the free memory
        plan = auto_plan(sizes, rates, 2, int(0.9 * meta["device_free_bytes"]))
        assert not plan.resident_indices
        assert plan == choose_plan(sizes, rates, int(0.9 * meta["device_free_bytes"]), 2, allow_resident=False)[0]
    assert plan.device_indices, "auto puts work on the GPU at this size"
    result = simulate(sizes, plan, rates, 2)
    assert result.races == 0
    assert result.ratio == pytest.approx(1.0, abs=0.10), (result.replayed.time_s, result.predicted.time_s)


def test_simulate_command_prints_the_table_and_writes_a_trace(tmp_path, capsys) -> None:  # noqa: ANN001
    trace = tmp_path / "sim.json"
    assert main(["simulate", "--params", "20e9", "--profile", "paper-h100x4", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "busy share" in out and "replay / prediction" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"upload", "download", "host_adam", "lp_upload"}


def test_simulate_plans_what_the_strategy_runs_resident_state_only_with_a_budget(tmp_path, capsys) -> None:  # noqa: ANN001
    """By default nothing is resident (the strategy keeps none without a gpu_memory_budget); --budget is memory
    spare at the forward/backward peak, and resident state plus the update's buffers fit in it."""
    trace = str(tmp_path / "sim.json")
    assert main(["simulate", "--params", "20e9", "--trace", trace, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["plan"]["resident"] == 0 and default["plan"]["streamed"] > 0
    assert default["held_between_updates_bytes"] == 0 and default["budget_kind"] == "update only"
    assert default["budget_gb"] == pytest.approx(0.9 * 30)  # the profile's free memory after backward, less 10%
    assert main(["simulate", "--params", "20e9", "--trace", trace, "--json", "--budget", "25.6e9"]) == 0
    budgeted = json.loads(capsys.readouterr().out)
    assert budgeted["plan"]["resident"] > 0 and budgeted["budget_kind"] == "forward/backward peak"
    assert 0 < budgeted["held_between_updates_bytes"] <= budgeted["update_device_bytes"] <= 25.6e9


def test_simulate_refuses_bad_settings(capsys) -> None:  # noqa: ANN001
    assert main(["simulate", "--params", "7e9", "--gpu-fraction", "2"]) == 2
    assert "gpu_fraction" in capsys.readouterr().err
    assert main(["simulate", "--params", "7e9", "--profile", "nope"]) == 2
