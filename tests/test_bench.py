"""Smoke run of the benchmark harness: one system of each kind, tiny model, a few steps (so the harness cannot
rot); every default system's name makes its strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.run import DEFAULT_SYSTEMS, main, make_strategy
from lightning_dos.host import disk

#: One of each kind the harness runs: stock, TwinFlow, a stride, a fraction with an overlap mode, the planner.
SYSTEMS = "stock,twinflow:0.3,stride:2,0.25@off,auto"


def test_bench_runs_each_kind_of_system_and_writes_a_table_and_json(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]
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
    assert main([*argv, "--systems", f"{system},{ours}"]) == 0
    printed = capfd.readouterr().out
    assert f"Drive floor of {system}:" in printed and f"Drive floor of {ours}:" in printed
    assert "x stock NVMe's update" in printed
    stock, mine = json.loads(out.read_text())["results"]
    assert stock["update_s"] > 0 and stock["extra"]["disk_floor_s"] > 0 and stock["predicted_update_s"] > 0
    # Ours kept half of the state in host memory: the other half crossed the drive each step.
    assert 0 < mine["extra"]["state_gb"] < stock["extra"]["state_gb"] and mine["extra"]["read_gb_per_step"] > 0
    # The drive measured right before the measured steps and right after: the floor at the rates around them.
    for result in (stock, mine):
        (window,) = result["extra"]["drive_steps"]
        assert window["floor_s"] == min(window["serial_floor_s"], window["overlapped_floor_s"]) > 0
        assert result["extra"]["update_over_floor"] == pytest.approx(result["update_s"] / window["floor_s"])
    assert mine["extra"]["written_gb_per_step"] > 0
    assert list(mine_drive.iterdir()) == []  # ours removed its swap file (DeepSpeed leaves its own behind)
