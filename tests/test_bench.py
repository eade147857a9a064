"""Smoke run of the benchmark harness: one system of each kind, tiny model, a few steps (so the harness cannot
rot); every default system's name makes its strategy."""

from __future__ import annotations

import json
from pathlib import Path

from bench.run import DEFAULT_SYSTEMS, main, make_strategy

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
