"""Smoke run of the benchmark harness: every system, tiny model, a few steps (so the harness cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.run import DEFAULT_SYSTEMS, main


def test_bench_runs_every_system_and_writes_a_table_and_json(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--steps", "2", "--warmup", "1", "--max-bytes", "100000", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    systems = DEFAULT_SYSTEMS.split(",")
    for system in systems:
        assert f"| {system} |" in printed
    payload = json.loads(out.read_text())
    assert [r["system"] for r in payload["results"]] == systems
    for result in payload["results"]:
        assert result["update_s"] > 0 and result["step_s"] >= result["update_s"]
        assert result["update_params_per_s"] > 0
    ours = [r for r in payload["results"] if r["system"].startswith("stride:")]
    assert all(r["d2h_gbps"] > 0 and 0 < r["device_share"] < 1 for r in ours)
