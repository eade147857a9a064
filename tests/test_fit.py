"""The model's capture on CPU and its fit: ``scripts/gpu-check.sh capture --accelerator cpu`` (the GPU machine's
first step, on the tiny preset) writes every file a CPU session fits the model from, and ``bench/fit.py`` sets each
system's measured phases beside the model's; the example capture committed under bench/captures/ still fits."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import clean_env

from bench import fit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
SYSTEMS = ("stock", "auto", "auto@off", "auto@forward")
#: The capture's steps on CPU: warm-up, then measured (scripts/gpu-check.sh).
WARMUP, MEASURED = 2, 3


def test_the_cpu_capture_writes_every_file_and_the_fit_sets_each_mode_beside_the_model(tmp_path: Path) -> None:
    capture = tmp_path / "capture"
    done = subprocess.run(
        ["bash", str(SCRIPT), "capture", "--out", str(capture), "--accelerator", "cpu"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "nothing appended to bench/RESULTS.md" in done.stdout
    env = (capture / "env.txt").read_text()
    assert "## lscpu" in env and "## memlock limit (ulimit -l)" in env
    assert "host_adam_eps" in json.loads((capture / "profile.json").read_text())["rates"]
    # The clipped run clips at 1.25x the largest gradient norm of the steady steps without clipping.
    runs, steps = fit.load(capture)
    clips = sorted({run["clip"] or 0.0 for run in runs})
    norms = [s["grad_norm"] for s in steps if s["steady"] and not s["clip"]]
    assert clips == [0.0, float(f"{1.25 * max(norms):.3g}")]
    for clip in ("off", f"{clips[1]:g}"):
        for suffix in ("log", "json"):
            assert (capture / f"bench-clip-{clip}.{suffix}").is_file()
    assert [(run["system"], run["clip"] or 0.0) for run in runs] == [(s, c) for c in clips for s in SYSTEMS]
    for run in runs:
        mine = [s for s in steps if (s["system"], s["clip"]) == (run["system"], run["clip"])]
        assert [s["step"] for s in mine] == list(range(WARMUP + MEASURED))
        assert [s["steady"] for s in mine] == [False] * WARMUP + [True] * MEASURED  # no re-plan on CPU
        for step in mine[WARMUP:]:
            assert {"dos/forward_s", "dos/backward_s", "dos/update_s", "dos/step_s"} <= set(step["metrics"])
            if run["overlap"] is None:  # stock offload: the monitor's phases only
                continue
            assert step["predicted"]["update_loop_s"] > 0 and step["rates"]["used"]["host_adam_eps"] > 0
            # The monitor's predictions since issue 52: the engine's loop, and the update phase (the planner's).
            assert {"dos/engine_update_predicted_s", "dos/update_predicted_s"} <= set(step["metrics"]), run["system"]
            assert len(step["plan"]["places"]) == len(run["sizes"]) == len(step["landed_s"])
            # Every sub-group landed, and its update is a span (begun during backward under clipping: speculated).
            assert None not in step["landed_s"]
            assert {span[1] for span in step["spans"] if span[0] in ("host_adam", "host_speculate")} == set(
                range(len(run["sizes"]))
            )
            if run["overlap"] != "off":  # the forward's all-gathers waited on the update in flight
                assert any(phase == "forward" for phase, *_ in step["waits"])
        trace = capture / "traces" / f"{run['system']}_clip-{run['clip'] or 'off'}" / "dos-trace-rank0.json"
        assert json.loads(trace.read_text())["otherData"]["steps"] == [WARMUP, WARMUP + 1]
    printed = (capture / "fit.txt").read_text()
    assert printed.strip() == fit.report(capture).strip()
    assert max(len(line) for line in printed.splitlines()) <= fit.WIDTH and "Most off: " in printed
    rows = {(row.system, row.clip, row.phase): row for row in fit.fit(runs, steps)[0]}
    for clip in ("off", f"{clips[1]:g}"):
        for system in SYSTEMS:
            assert rows[(system, clip, "iteration")].measured > 0
        for system, mode in (("auto@off", "off"), ("auto@forward", "forward"), ("auto", "auto")):
            for phase in fit.LABELS[mode]:
                if phase not in fit.PLANNER_ROWS:  # the planner times forward and backward on a GPU only
                    assert rows[(system, clip, phase)].steps == MEASURED, (system, phase)
            assert rows[(system, clip, "update (planner)")].ratio is not None  # the phase's own prediction
            assert rows[(system, clip, "iteration")].predicted > 0
            assert rows[(system, clip, "update loop (engine)")].ratio is not None
            assert f"\n{system:<13} {clip:<4} iteration " in printed


def test_the_fit_says_clearly_what_is_not_a_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fit.main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere is not a capture: no steps.jsonl there" in capsys.readouterr().err
    (tmp_path / "steps.jsonl").write_text('{"kind": "run", "system": "auto"}\n')
    assert fit.main([str(tmp_path)]) == 2
    assert "is not a capture: 1 run line(s), 0 step line(s)" in capsys.readouterr().err


def test_the_committed_cpu_captures_still_fit() -> None:
    """A capture is fitted for weeks after it was taken: each one committed loads and fits with today's model."""
    captures = sorted(path.parent for path in (ROOT / "bench" / "captures").glob("*/steps.jsonl"))
    assert captures, "no capture committed under bench/captures/"
    for capture in captures:
        printed = fit.report(capture)
        for system in SYSTEMS:
            assert f"\n{system:<13} off  iteration " in printed, capture
        assert sum(path.stat().st_size for path in capture.rglob("*")) < 5_000_000  # a capture stays small


def test_the_fit_of_a_capture_without_its_step_lines_fails(tmp_path: Path) -> None:
    """The example capture less its per-step lines is no capture: the fit refuses it rather than print a table."""
    example = next((ROOT / "bench" / "captures").glob("*/steps.jsonl")).parent
    shutil.copytree(example, tmp_path / "capture", ignore=shutil.ignore_patterns("steps.jsonl"))
    with pytest.raises(fit.CaptureError, match="no steps.jsonl"):
        fit.report(tmp_path / "capture")
