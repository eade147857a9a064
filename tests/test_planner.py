"""`lightning-dos plan` and `calibrate`: the paper's node reproduces the authors' figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dos.cli import main
from lightning_dos.profiles import load_profile

# Authors' update throughput on 4x H100, B params/s: (model, stock ZeRO-3 offload, their method at stride 2).
AUTHORS = [(7e9, 7.9, 14.2), (8.3e9, 6.0, 10.7), (10e9, 6.7, 11.9), (13e9, 7.7, 13.6), (20e9, 8.8, 15.4)]


def _plan(capsys, *args: str) -> dict:  # noqa: ANN001
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("params", "stock", "stride2"), AUTHORS)
def test_paper_profile_predicts_the_authors_throughput_within_25_percent(capsys, params, stock, stride2) -> None:  # noqa: ANN001
    result = _plan(capsys, "--params", str(params), "--gpus-per-node", "4", "--profile", "paper-h100x4")
    rows = {r["scheme"]: r["update_params_per_s"] / 1e9 for r in result["rows"]}
    assert rows["stock ZeRO-3 offload"] == pytest.approx(stock, rel=0.25)
    assert rows["paper stride 2"] == pytest.approx(stride2, rel=0.25)
    assert rows["ours (auto)"] >= max(rows["paper stride 2"], rows["paper stride 3"], rows["paper stride 4"]) * 0.999
    # Within the device memory there is, nothing beats the floor.
    assert all(r["vs_floor"] >= 0.999 for r in result["rows"] if r["fits_budget"])


def test_plan_from_a_recipe_with_iteration_time(capsys) -> None:  # noqa: ANN001
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "gpt-7b.yaml")
    result = _plan(capsys, "--recipe", recipe, "--forward-s", "0.5", "--backward-s", "1.0")
    assert 6e9 < result["params"] < 8e9
    assert all(r["iteration_s"] == pytest.approx(1.5 + r["update_s"]) for r in result["rows"])
    assert main(["plan", "--params", "1e9"]) == 0  # the table form
    assert "floor" in capsys.readouterr().out


def test_calibrate_on_cpu_writes_a_profile_that_loads_back(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "me.yaml"
    assert main(["calibrate", "--device", "cpu", "--out", str(out)]) == 0
    rates, meta = load_profile(out)
    assert rates.host_adam_eps > 0 and rates.shared_cpu and meta["device"] == "cpu"
    assert main(["plan", "--params", "1e8", "--profile", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert result["ours"]["device_share"] == 0, "with no GPU, everything stays on the host"


def test_unknown_profile_is_refused(capsys) -> None:  # noqa: ANN001
    assert main(["plan", "--params", "1e9", "--profile", "no-such-node"]) == 2
    assert "paper-h100x4" in capsys.readouterr().err
