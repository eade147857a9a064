"""Evaluation from checkpoints written by strategy="dos": validate, test and predict in a fresh process, and
through the CLI after the default recipe's run. Real Lightning, real DeepSpeed ZeRO-3, on CPU."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from tests.helpers import TinyLM, clean_env, loader, trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")


@pytest.mark.parametrize(("precision", "fraction"), [("32-true", "0.5"), ("bf16-mixed", "stride:2")])
def test_validate_test_predict_from_a_checkpoint_in_a_fresh_process(
    tmp_path: Path, precision: str, fraction: str
) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    value: float | str = fraction if fraction.startswith("stride") else float(fraction)
    fitted = trainer(DeepOptimizerStatesStrategy(gpu_fraction=value, sub_group_size=700), steps=8, precision=precision)
    fitted.fit(model, loader())
    fitted.save_checkpoint(tmp_path / "dos.ckpt")  # the training engine saves; evaluation builds another
    after_fit = fitted.validate(model, loader(), verbose=False)[0]["val/loss"]
    predictions = torch.cat(fitted.predict(model, loader())).tolist()

    out = tmp_path / "evaluated.json"
    job = [sys.executable, str(ROOT / "tests" / "jobs" / "evaluate.py"), str(tmp_path / "dos.ckpt"), precision]
    done = subprocess.run(
        [*job, fraction, str(out)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert abs(result["untrained"] - after_fit) > 0.05, "the fresh process must start from other weights"
    assert result["validate"] == pytest.approx(after_fit, abs=1e-5)
    assert result["test"] == pytest.approx(after_fit, abs=1e-5)  # test_step computes the same loss
    assert result["predict"] == predictions


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_dos", *args]
    return subprocess.run(command, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)


#: A few steps of the default recipe, small enough for CI; everything else as the recipe says.
SHORT = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2"]
SHORT += ["--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2", "--data.max_bytes", "200000"]


def _val_losses(root: Path) -> list[float]:
    losses = []
    for metrics in sorted((root / "csv").rglob("metrics.csv")):
        losses += [float(r["val/loss"]) for r in csv.DictReader(metrics.open()) if r.get("val/loss")]
    return losses


def test_the_readme_validate_command_works_after_the_default_recipe(tmp_path: Path) -> None:
    """The recipe writes runs/gpt-tiny/checkpoints/last.ckpt; the README's validate command, as printed, reads it."""
    fit = _cli(tmp_path, "fit", "--config", TINY, *SHORT, "--trainer.enable_progress_bar", "false")
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = tmp_path / "runs" / "gpt-tiny" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir(), "the default recipe must write its last checkpoint"
    fit_losses = _val_losses(tmp_path / "runs" / "gpt-tiny")
    assert len(fit_losses) == 1

    ckpt = "runs/gpt-tiny/checkpoints/last.ckpt"
    validate = _cli(tmp_path, "validate", "--config", TINY, *SHORT, "--ckpt_path", ckpt)
    assert validate.returncode == 0, validate.stderr[-3000:]
    losses = _val_losses(tmp_path / "runs" / "gpt-tiny")
    assert len(losses) == 2, "validate logs its own val/loss"
    assert losses[1] == pytest.approx(fit_losses[0], abs=1e-5)
