"""Smoke run of the benchmark harness: one system of each kind, tiny model, a few steps (so the harness cannot
rot); every default system's name makes its strategy."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

import bench.run
from bench.run import DEFAULT_SYSTEMS, main, make_strategy
from lightning_dos.host import disk

#: One of each kind the harness runs: stock, TwinFlow, a stride, a fraction with an overlap mode, the planner.
SYSTEMS = "stock,twinflow:0.3,stride:2,0.25@off,auto"


def test_bench_runs_each_kind_of_system_and_writes_a_table_and_json(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]
    argv.append("--drive-each-step")
    assert main([*argv, "--systems", SYSTEMS]) == 0
    printed = capsys.readouterr().out
    systems = SYSTEMS.split(",")
    for system in systems:
        assert f"| {system} |" in printed
    payload = json.loads(out.read_text())
    assert [r["system"] for r in payload["results"]] == systems
    for result in payload["results"]:
        assert result["update_s"] > 0 and result["step_s"] >= result["update_s"]
        assert result["update_params_per_s"] > 0
    ours = [r for r in payload["results"] if r["system"].startswith(("stride:", "0.25"))]
    assert len(ours) == 2 and all(r["d2h_gbps"] > 0 and 0 < r["device_share"] < 1 for r in ours)
    # The labels (issue 52): the floor from the calibrated rates, not the planner's corrected ones; each predicted
    # column says what it predicts; the medians over the steady steps, after the warm-up (no re-plan here).
    from lightning_dos.model.perfmodel import HardwareRates, floor

    for result in payload["results"]:
        extra = result["extra"]
        assert extra["steady_steps"] == [1, 2]
        if "floor_s" in extra:
            calibrated = HardwareRates.from_dict(extra["calibrated_rates"])
            assert extra["floor_s"] == floor(extra["update_elements"], calibrated, extra["lp_bytes"])[1]
    assert "Floor T(r*) of the update phase from the calibrated rates (not the planner's corrected ones)" in printed
    head = "| system | steady steps | update loop s | predicted update loop s | update s | predicted update s |"
    assert head in printed and "| auto | 2 | " in printed


def test_rounds_rotate_the_systems_and_set_each_rounds_ratios_beside_their_median(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--steps", "1", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]
    assert main([*argv, "--systems", "stock,0.25@off", "--rounds", "2"]) == 0
    printed = capsys.readouterr().out
    assert "## Round 1 of 2 (run in the order stock, 0.25@off)" in printed
    assert "## Round 2 of 2 (run in the order 0.25@off, stock)" in printed
    summary = printed.split("## Over the rounds")[1]
    rounds = json.loads(out.read_text())["rounds"]
    assert [[r["system"] for r in results] for results in rounds] == [["stock", "0.25@off"]] * 2
    ratios = [results[0]["update_s"] / results[1]["update_s"] for results in rounds]
    row = next(line for line in summary.splitlines() if line.startswith("| 0.25@off |"))
    assert " ".join(f"{x:.2f}x" for x in ratios) in row  # each round's ratio, against that round's stock
    with pytest.raises(SystemExit):
        main([*argv, "--rounds", "0"])


def test_aio_settings_reach_both_nvme_systems_and_the_json(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    monkeypatch.setattr(bench.run, "AIO", dict(bench.run.AIO))
    args = bench.run.parse_args(["--aio", "524288,16,1"])
    assert args.aio == "524288,16,1"
    assert bench.run.AIO["block_size"] == 524288 and bench.run.AIO["queue_depth"] == 16
    stock, _ = make_strategy(f"stock-nvme:{tmp_path}", 1000)
    ours, _ = make_strategy(f"nvme:0.5:{tmp_path}@off", 1000, 12_000)
    for strategy in (stock, ours):
        aio = strategy.config["aio"]
        assert (aio["block_size"], aio["queue_depth"], aio["intra_op_parallelism"]) == (524288, 16, 1)
    with pytest.raises(SystemExit):
        bench.run.parse_args(["--aio", "1M,32"])
    with pytest.raises(SystemExit):
        bench.run.parse_args(["--drive-warmup", "-1"])
    deeper, _ = make_strategy(f"stock-nvme:{tmp_path}:32", 1000)  # stock's swapper with 32 tensor buffers
    offload = deeper.config["zero_optimization"]["offload_optimizer"]
    assert (offload["nvme_path"], offload["buffer_count"]) == (str(tmp_path), 32)
    assert stock.config["zero_optimization"]["offload_optimizer"]["buffer_count"] == bench.run.STOCK_BUFFERS


def test_every_default_system_names_a_strategy() -> None:
    kinds = [make_strategy(system, 1000)[1] for system in DEFAULT_SYSTEMS.split(",")]
    assert kinds.count(False) == 6 and kinds.count(True) == 4  # stock and five TwinFlow ratios; ours


@pytest.mark.skipif(disk.aio_unavailable() is not None, reason="libaio-dev is not installed: no NVMe offload here")
def test_stock_and_our_nvme_offload_run_and_are_set_beside_their_drive_floors(tmp_path: Path, capfd) -> None:  # noqa: ANN001
    """capfd, not capsys: DeepSpeed's own libaio check points the stderr file descriptor elsewhere meanwhile, and
    answers "incompatible" under a sys.stderr that has none."""
    drive, mine_drive, out = tmp_path / "drive", tmp_path / "ours", tmp_path / "bench.json"
    drive.mkdir()
    mine_drive.mkdir()
    system, ours = f"stock-nvme:{drive}", f"nvme:0.5:{mine_drive}@off"
    argv = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]
    argv += ["--drive-each-step", "--drive-warmup", "0.1"]
    assert main([*argv, "--systems", f"{system},{ours}"]) == 0
    printed = capfd.readouterr().out
    assert "# drives warmed for" in printed and "(each read and written 1x)" in printed
    # The first NVMe system fitted once, unmeasured, before the first round: no measured system is the run's first.
    assert f"# primed: one unmeasured fit of {system} before the first round" in printed
    assert "not every system runs first" not in printed
    assert f"Drive floor of {system}:" in printed and f"Drive floor of {ours}:" in printed
    assert "x stock NVMe's update" in printed
    stock, mine = json.loads(out.read_text())["results"]
    assert stock["update_s"] > 0 and stock["extra"]["disk_floor_s"] > 0 and stock["predicted_update_s"] > 0
    # Ours kept half of the state in host memory: the other half crossed the drive each step.
    assert 0 < mine["extra"]["state_gb"] < stock["extra"]["state_gb"] and mine["extra"]["read_gb_per_step"] > 0
    # The drive measured before each measured step and after the last: each step's floor at the rates around it,
    # and the ratio reported is the median of each step's update over its own floor (two steps: their mean).
    for result in (stock, mine):
        windows = result["extra"]["drive_steps"]
        assert len(windows) == 2
        for window in windows:
            assert window["floor_s"] == min(window["serial_floor_s"], window["overlapped_floor_s"]) > 0
        updates = result["extra"]["step_updates_s"]
        ratios = [u / w["floor_s"] for u, w in zip(updates, windows, strict=True)]
        assert result["extra"]["update_over_floor"] == pytest.approx(sum(ratios) / 2)
        assert result["update_s"] == pytest.approx(sum(updates) / 2)
    assert mine["extra"]["written_gb_per_step"] > 0
    assert list(mine_drive.iterdir()) == []  # ours removed its swap file
    assert list(drive.iterdir()) == []  # the bench removed the swap folder DeepSpeed made and left behind


@pytest.mark.skipif(disk.aio_unavailable() is not None, reason="libaio-dev is not installed: no NVMe offload here")
def test_the_tiers_requests_alone_are_set_beside_the_drive_floor_for_each_slab_count(tmp_path: Path, capfd) -> None:  # noqa: ANN001
    """bench/drive_pattern.py: every record read into a slab and written back from it, each slab count's passes
    beside the floor the drive measured around each of them; nothing left in the directory."""
    from bench import drive_pattern

    drive, out = tmp_path / "drive", tmp_path / "pattern.json"
    drive.mkdir()
    argv = ["--path", str(drive), "--records", "3", "--record-elements", "5000", "--slabs", "1,2", "--passes", "2"]
    assert drive_pattern.main([*argv, "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "# 3 records of 0.1 MB read and written back per pass" in printed
    assert "\n| 1 | 0 |" in printed and "\n| 2 | 0 |" in printed
    passes = json.loads(out.read_text())["passes"]
    assert set(passes) == {"1", "2"}
    # The master weights and two moments, each padded to 4 KiB, the whole to 4 KiB per I/O thread.
    share = 4096 * drive_pattern.AIO["intra_op_parallelism"]
    record = -(-3 * 20480 // share) * share
    for rows in passes.values():
        assert len(rows) == 2
        for row in rows:
            assert row["read_bytes"] == row["written_bytes"] == 3 * record
            assert row["floor_s"] == min(row["serial_floor_s"], row["overlapped_floor_s"]) > 0
            assert row["over_floor"] == pytest.approx(row["pass_s"] / row["floor_s"])
    assert list(drive.iterdir()) == []


def test_drive_pattern_refuses_a_slab_count_below_one(capsys) -> None:  # noqa: ANN001
    from bench import drive_pattern

    with pytest.raises(SystemExit):
        drive_pattern.parse_args(["--path", ".", "--slabs", "4,0"])
    assert "--slabs must each be at least 1, got [4, 0]" in capsys.readouterr().err


def test_a_cuda_only_peer_is_a_row_saying_why_and_stock_is_exact_against_itself(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """bench/peers.py: SuperOffload asserts a CUDA accelerator; on CPU its row (run in a process of its own) says so
    instead of crashing the bench. Stock offload is the exactness reference: 0 from itself, its injected non-finite
    batch skipped and its weights finite."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: SuperOffload runs there")
    out = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--steps", "1", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]
    assert main([*argv, "--exactness", "--systems", "superoffload:0.9,stock"]) == 0
    printed = capsys.readouterr().out
    why = "not run here: AssertionError: SuperOffload only supports NVIDIA CUDA GPUs"
    assert printed.count(f"| superoffload:0.9 | {why}") == 2  # in the times' table and the exactness table
    assert "| stock | " in printed.split("After 2 steps on the same batches")[1]
    peer, stock = json.loads(out.read_text())["results"]
    assert peer["system"] == "superoffload:0.9" and "superoffload_stage3.py" in peer["extra"]["unavailable"]
    assert stock["extra"]["rel_err"] == 0.0 and stock["extra"]["skipped"] == 0 and stock["extra"]["loss"] > 0
    assert stock["extra"]["injected"] == {"skipped": True, "nonfinite": 0, "rel_err": 0.0}
    # Its process's log and result beside the JSON; the reference weights went elsewhere and are removed.
    assert sorted(p.name for p in (tmp_path / "bench-systems").iterdir()) == [
        "superoffload_0.9.json",
        "superoffload_0.9.log",
    ]
    assert not list(Path(tempfile.gettempdir()).glob("bench-exact-*"))
    with pytest.raises(SystemExit):
        main([*argv, "--exactness", "--systems", "auto"])  # nothing to measure against


def test_steady_steps_leave_out_the_warmup_the_planners_timed_iteration_and_plan_switches() -> None:
    """bench/steps.py's rule, on the pattern of a GPU run with gpu_fraction="auto" and overlap: the planner times the
    2nd iteration (its forward waits for the whole update), then plans again from it (a switch)."""
    from bench.steps import StepRecorder, _Batch
    from lightning_dos.model.plan import Place, Plan
    from lightning_dos.model.step_report import StepReport

    update_best, iteration_best = (
        Plan((Place.HOST, Place.DEVICE, Place.HOST)),
        Plan((Place.DEVICE,) + (Place.HOST,) * 2),
    )
    recorder = StepRecorder(warmup=1)
    for step, plan in enumerate([update_best] * 2 + [iteration_best] * 4):
        report = StepReport(step + 1, plan, (8, 8, 8), skipped=step == 4)
        recorder._batches[step] = _Batch(step, 0.0, phase_timing=step == 1, report=report)
    rows = [{"dos/step_s": float(step)} for step in range(6)]
    assert recorder.steady(rows, 6) == ([rows[3], rows[5]], [3, 5])
    assert recorder.flags(2) == {
        "warmup": False, "phase_timing": False, "plan_switch": True, "skipped": False, "steady": False,
    }  # fmt: skip
    assert not recorder.flags(4)["steady"] and recorder.flags(0)["warmup"]
    # A run too short for any steady step is measured over every step after the warm-up.
    assert recorder.steady(rows, 3) == ([rows[1], rows[2]], [1, 2])
