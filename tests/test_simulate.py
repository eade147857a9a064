"""The engine's logged schedule replayed on a virtual node (simulated figures, not measurements)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dos.commands.main import main
from lightning_dos.commands.simulate import copy_bytes, engine_log, rescale_copies, simulate, sub_group_sizes
from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.nvme import DiskRates
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.plan_search import choose_plan
from lightning_dos.model.update_rules import ADAGRAD, ADAM, ADAM_FP32, LION, Footprint
from lightning_dos.planning.profiles import load_profile
from lightning_dos.sim.findings import DRIVE
from lightning_dos.sim.replay import replay
from lightning_dos.sim.sanitizer import HOST, LoggedOp
from lightning_dos.sim.simstreams import D2H, H2D

RATES = HardwareRates(1e9, 1e10, 1e11, 50e9, 50e9, 25e9, 20e9)


def test_replay_uses_solo_rates_alone_and_duplex_rates_together() -> None:
    alone = replay([LoggedOp("op", H2D, "upload", nbytes=50_000_000)], RATES)
    assert alone.time_s == pytest.approx(1e-3)
    both = replay(
        [LoggedOp("op", H2D, "upload", nbytes=25_000_000), LoggedOp("op", D2H, "download", nbytes=20_000_000)], RATES
    )
    assert both.time_s == pytest.approx(1e-3)  # 25 MB at 25 GB/s beside 20 MB at 20 GB/s
    assert both.h2d_bytes == 25_000_000 and both.d2h_bytes == 20_000_000


def test_replay_runs_the_drives_requests_one_at_a_time_at_its_rates_and_blocks_the_host_on_their_waits() -> None:
    log = [
        LoggedOp("op", DRIVE, "nvme_read", nbytes=1_000_000_000),  # 0.5 s at 2 GB/s
        LoggedOp("record", DRIVE, event=1),
        LoggedOp("op", DRIVE, "nvme_write", nbytes=1_000_000_000),  # 1 s at 1 GB/s, after the read: one queue
        LoggedOp("record", DRIVE, event=2),
        LoggedOp("host_wait", event=1),
        LoggedOp("op", HOST, "host_adam", elements=1_000_000),  # 1 ms, once the read landed
        LoggedOp("host_wait", event=2),
    ]
    result = replay(log, RATES, disk=DiskRates(2e9, 1e9))
    assert result.time_s == pytest.approx(1.5)
    assert (result.read_bytes, result.write_bytes) == (1e9, 1e9)
    assert result.busy_s["drive"] == pytest.approx(1.5) and result.busy_s["host"] == pytest.approx(1e-3)
    host = next(span for span in result.spans if span.lane == "host_adam")
    assert host.start_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="drive"):
        replay(log, RATES)


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
        plan = auto_plan(sizes, rates, 2, meta["device_free_bytes"], allow_resident=True).update_plan
        assert plan.resident_indices
    else:  # as the strategy, `plan` and `simulate` choose it by default: streaming only, within 90% of the free memory
        plan = auto_plan(sizes, rates, 2, int(0.9 * meta["device_free_bytes"])).update_plan
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


# -- every optimizer rule and dtype (issue 21) --------------------------------------------------------------------


def test_the_engines_own_copies_are_exactly_adam_fp32s_footprint() -> None:
    """The copies the engine issues for Adam in fp32 carry exactly the bytes its Footprint counts: the factor
    ``rescale_copies`` applies to the engine's own log is 1 for every streamed and resident sub-group. (Once the
    engine takes the rule, the same holds for every rule and dtype; the factor then stays 1.)"""
    sizes = [64] * 4
    plan = Plan((Place.RESIDENT, Place.DEVICE, Place.DEVICE, Place.HOST), device_buffers=2)
    log, scale, races = engine_log(sizes, plan, 2)
    expected = copy_bytes(plan, sizes, ADAM_FP32, 2, lp_downloads=False)
    _, factors = rescale_copies(log, expected)
    assert races == 0 and scale == 1.0
    assert set(factors) == {(0, "upload"), (1, "upload"), (1, "download"), (2, "upload"), (2, "download")}
    assert all(f == 1.0 for f in factors.values()), factors


@pytest.mark.parametrize(
    ("footprint", "up", "down"),
    [
        (Footprint(ADAM, 2, 2), 8, 6),
        (Footprint(LION), 12, 8),
        (Footprint(ADAGRAD), 12, 8),
        (Footprint(ADAM, 2, 4), 12, 10),
    ],
    ids=["adam bf16", "lion fp32", "adagrad fp32", "adam bf16 master fp32 states"],
)
def test_each_rule_and_dtype_replays_its_own_bytes_and_agrees_with_the_model(footprint, up, down) -> None:  # noqa: ANN001
    rates, meta = load_profile("paper-h100x4")
    sizes = sub_group_sizes(20_000_000_000, meta["gpus_per_node"], 100_000_000)
    plan = auto_plan(sizes, rates, 2, int(0.9 * meta["device_free_bytes"]), footprint=footprint).update_plan
    result = simulate(sizes, plan, rates, 2, footprint=footprint)
    streamed = sum(sizes[i] for i in plan.streamed_indices)
    host = sum(sizes[i] for i in plan.host_indices)
    assert result.replayed.h2d_bytes == pytest.approx(up * streamed + 2 * host, rel=1e-3)
    assert result.replayed.d2h_bytes == pytest.approx(down * streamed, rel=1e-3)
    assert result.predicted.h2d_bytes == up * streamed + 2 * host and result.predicted.d2h_bytes == down * streamed
    assert result.races == 0
    assert result.ratio == pytest.approx(1.0, abs=0.10), (result.replayed.time_s, result.predicted.time_s)


def test_simulate_command_takes_the_optimizer_and_dtypes(tmp_path, capsys) -> None:  # noqa: ANN001
    trace = str(tmp_path / "sim.json")
    args = ["simulate", "--params", "20e9", "--trace", trace, "--json"]
    assert main(args) == 0
    adam = json.loads(capsys.readouterr().out)
    assert main([*args, "--master-dtype", "bf16", "--state-dtype", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert (adam["optimizer"], adam["master_dtype"], adam["state_dtype"]) == ("adam", "fp32", "fp32")
    assert (bf16["master_dtype"], bf16["state_dtype"]) == ("bf16", "bf16")
    assert bf16["bytes_per_element"] == {
        "host_state": 6, "streamed_up": 8, "streamed_down": 6, "resident_up": 0, "device": 8
    }  # fmt: skip
    # Half the bytes per streamed element: more of the model streams, and the update is shorter.
    assert bf16["plan"]["streamed"] >= adam["plan"]["streamed"] and bf16["update_s"] < adam["update_s"]
    assert main([*args, "--optimizer", "lion", "--budget", "25.6e9"]) == 0
    lion = json.loads(capsys.readouterr().out)
    resident = lion["plan"]["resident"]
    assert resident > 0 and lion["held_between_updates_bytes"] == 12 * resident * 100_000_000
    assert main([*args, "--state-dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--state-dtype bf16 needs --master-dtype bf16" in err
    assert main([*args, "--optimizer", "sgd"]) == 2
    assert "adam, adamw, adagrad, lion" in capsys.readouterr().err


def test_a_sub_groups_update_is_charged_once_at_the_rules_rate_however_many_kernels_ran_it() -> None:
    """torch's path for a rule or dtype the host kernel does not compile runs conversions and a kernel per term;
    a tiled path runs the update in pieces; the compiled pass is one operation. The replay charges each
    sub-group's update once at the rule's rate (the rate calibration measured for the whole update), plus one
    cast of its elements."""
    n, lion = 1_000_000, Footprint(LION)
    compiled = [
        LoggedOp("op", HOST, "host_adam", elements=n, sub_group=0),
        LoggedOp("op", HOST, "host_cast", n, sub_group=0),
    ]
    torch_path = [
        *(LoggedOp("op", HOST, "host_cast", n, sub_group=0) for _ in range(3)),  # bf16 -> fp32 conversions
        *(LoggedOp("op", HOST, "host_elementwise", n, sub_group=0) for _ in range(9)),  # one kernel per term
        LoggedOp("op", HOST, "host_cast", n, sub_group=0),
    ]
    tiled = [LoggedOp("op", HOST, "host_adam", elements=n // 4, sub_group=0) for _ in range(4)]
    tiled.append(LoggedOp("op", HOST, "host_cast", n, sub_group=0))
    expected = n * 20 / 28 / RATES.host_adam_eps + n / RATES.host_cast_eps  # Lion fp32 touches 20 bytes, Adam 28
    for log in (compiled, torch_path, tiled):
        assert replay(log, RATES, footprint=lion).time_s == pytest.approx(expected)
    # On the device: the update at the rule's device rate, the cast at the bandwidth Adam's rate implies.
    device = [
        *(LoggedOp("op", 0, "device_elementwise", n, sub_group=3) for _ in range(9)),
        LoggedOp("op", 0, "cast", n, sub_group=3),
    ]
    update_s = n * 20 / 28 / RATES.device_adam_eps
    cast_s = n * (4 + 2) / (RATES.device_adam_eps * 28)
    assert replay(device, RATES, footprint=lion).time_s == pytest.approx(update_s + cast_s)
    # Two sub-groups are two updates; operations of no sub-group are charged as they are.
    two = [*compiled, *(replace(op, sub_group=1) for op in compiled)]
    assert replay(two, RATES, footprint=lion).time_s == pytest.approx(2 * expected)
    loose = [LoggedOp("op", HOST, "host_adam", elements=n), LoggedOp("op", HOST, "host_adam", elements=n)]
    assert replay(loose, RATES).time_s == pytest.approx(2 * n / RATES.host_adam_eps)


def test_simulate_replays_the_nvme_tier_beside_the_model_and_stock_for_each_host_budget(tmp_path, capsys) -> None:  # noqa: ANN001
    """The engine's update with the state past each host budget on the simulated drive, replayed: within 10% of
    the performance model, the drive's bytes exactly the model's, no race on the staging slabs, never under the
    drive's floor, faster with more host memory, and ahead of stock's pipelined swapper (>= 1.6x at half)."""
    trace = tmp_path / "t.json"
    args = ["simulate", "--params", "8e9", "--profile", "paper-h100x4", "--trace", str(trace)]
    nvme = ["--nvme-read-gbs", "25", "--nvme-write-gbs", "10", "--host-budget", "0,0.25,0.5"]
    assert main([*args, *nvme, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["nvme"]
    assert (result["ranks"], result["slots"], result["read_gbs"]) == (4, 4, 25.0)
    rows = result["rows"]
    assert [row["host_budget"] for row in rows] == [0.0, 0.25, 0.5]
    assert [round(row["file_share"], 1) for row in rows] == [1.0, 0.8, 0.5]
    for row in rows:
        assert 0.9 <= row["replay_over_prediction"] <= 1.1, row
        assert row["ours_read_gb"] == pytest.approx(row["ours_predicted_read_gb"], rel=1e-4), row
        assert row["races"] == 0
        assert row["ours_s"] >= row["ours_disk_floor_s"] * (1 - 1e-9)
        lanes = {event["name"] for event in json.loads(Path(row["trace"]).read_text())["traceEvents"]}
        assert {"nvme_read", "nvme_write", "host_adam", "upload"} <= lanes
    assert rows[0]["ours_s"] > rows[1]["ours_s"] > rows[2]["ours_s"]
    assert rows[0]["ours_vs_stock"] >= 1.0 and rows[2]["ours_vs_stock"] >= 1.6
    assert main([*args, *nvme]) == 0
    table = capsys.readouterr().out
    assert "NVMe tier" in table and "replay/" in table and "stream races found: 0" in table
    assert main([*args, "--nvme-read-gbs", "25"]) == 2
    assert "--nvme-write-gbs" in capsys.readouterr().err


def test_simulate_a_recipe_in_the_order_its_forward_needs_the_sub_groups(tmp_path, capsys) -> None:  # noqa: ANN001
    """``--recipe``: the sub-groups of the recipe's model, cut as the strategy cuts them, in the order its forward
    needs them (recorded on the meta device: the tiny GPT's no-decay group, packed last, is needed first); the model
    predicts every overlap mode's iteration within 10% of the virtual node's replay in that order."""
    args = ["simulate", "--recipe", "recipes/gpt-tiny.yaml", "--gpus-per-node", "1", "--sub-group-size", "50000"]
    args += ["--forward-s", "0.0003", "--backward-s", "0.0006", "--trace", str(tmp_path / "sim.json"), "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sub_groups_per_rank"] == 18 and summary["need_order"][:3] == [16, 17, 0]
    for mode in ("off", "forward", "auto"):
        replayed, predicted = summary["iteration_s"][mode], summary["iteration_predicted_s"][mode]
        assert replayed == pytest.approx(predicted, rel=0.10), mode
    assert main(args[:-1]) == 0
    assert "order: as the recipe's forward needs them (16, 17, 0, 1, ..." in capsys.readouterr().out
    # `plan` predicts the same iterations: the same sub-groups, in the same order, planned as the strategy plans.
    assert main(["plan", *args[1:-3], "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["overlapped"]
    for mode in ("forward", "auto"):
        assert planned[mode]["iteration_s"] == pytest.approx(summary["iteration_predicted_s"][mode]), mode


def test_the_replay_charges_the_copies_share_beside_the_host_update_as_the_model_does() -> None:
    """A calibrated profile whose copies run at 60% beside the host update (``overlap_copy_speed``): the replayed
    update stays within 5% of the performance model's, which charges that share where host sub-groups run."""
    rates = replace(load_profile("paper-h100x4")[0], overlap_copy_speed=0.6)
    sizes = sub_group_sizes(int(20e9), 4, int(1e8))
    plan = auto_plan(sizes, rates, 2, None).plan
    assert plan.host_indices and plan.streamed_indices
    result = simulate(sizes, plan, rates, 2)
    assert result.replayed.time_s == pytest.approx(result.predicted.time_s, rel=0.05), result.ratio
    plain = simulate(sizes, plan, replace(rates, overlap_copy_speed=1.0), 2)
    assert result.replayed.time_s > plain.replayed.time_s
