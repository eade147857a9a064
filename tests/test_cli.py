"""The command line: help, a real fit through LightningCLI, and a seq_len the model cannot take."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = clean_env()
    return subprocess.run(
        [sys.executable, "-m", "lightning_dos", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_subcommand() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for name in ("fit", "validate", "test", "calibrate", "plan", "report"):
        assert name in done.stdout


def test_fit_through_the_cli_logs_a_falling_loss(tmp_path: Path) -> None:
    done = _run(
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps",
        "40",
        "--trainer.val_check_interval",
        "20",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--model.n_layer",
        "2",
        "--data.max_bytes",
        "300000",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = next(tmp_path.rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5
    assert any(r.get("val/ppl") for r in rows)
    assert any(r.get("dos/update_s") for r in rows), "the monitor runs by default"


def test_sequence_longer_than_the_model_is_refused_before_training(tmp_path: Path) -> None:
    done = _run(
        "fit",
        "--config",
        TINY,
        "--data.seq_len",
        "256",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    )
    assert done.returncode != 0
    assert "data.seq_len=256 is longer than model.block_size=128" in done.stderr
    assert (
        not list(tmp_path.rglob("metrics.csv")) or "train/loss" not in next(tmp_path.rglob("metrics.csv")).read_text()
    )
