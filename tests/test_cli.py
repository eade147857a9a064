"""The command line: help, a real fit through LightningCLI with the default bar and loggers, extra subcommands."""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dos.callbacks import DOSProgressBar
from lightning_dos.callbacks.progress import format_dos_metrics
from lightning_dos.strategy import cpu_supports_fp16
from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")
FP16_RUNS_HERE = (
    "this CPU runs fp16, so nothing is refused; test_fp16_is_refused_up_front_where_deepspeed_cannot_run_it "
    "covers the refusal with the capability forced off"
)


def _run(*args: str, timeout: int = 600, script: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_dos`` (or the installed ``lightning-dos`` script) in a clean environment."""
    console_script = Path(sys.executable).with_name("lightning-dos")
    if script and console_script.exists():
        command = [str(console_script), *args]
    else:
        command = [sys.executable, "-m", "lightning_dos", *args]
    return subprocess.run(command, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", [True, False], ids=["lightning-dos", "python-m"])
def test_help_lists_every_subcommand(script: bool) -> None:
    done = _run("--help", script=script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("lightning-dos")
    for name in ("fit", "validate", "test", "calibrate", "plan", "report"):
        assert name in done.stdout


def test_misspelt_option_exits_non_zero_naming_it() -> None:
    done = _run("fit", "--config", TINY, "--model.n_layerz", "3")
    assert done.returncode != 0
    assert "n_layerz" in done.stderr


def test_fit_through_the_cli_logs_a_falling_loss(tmp_path: Path) -> None:
    """A short real fit of the tiny recipe (DOS strategy, CPU), with the default progress bar and loggers."""
    done = _run(
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps",
        "24",
        "--trainer.log_every_n_steps",
        "4",
        "--trainer.val_check_interval",
        "12",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.n_layer",
        "2",
        "--model.warmup_steps",
        "4",
        "--data.max_bytes",
        "300000",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = next((tmp_path / "csv").rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert any(r.get("val/ppl") for r in rows)
    assert any(r.get("train/tokens") for r in rows)
    assert any(r.get("dos/update_s") for r in rows), "the monitor runs by default"
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*")), "TensorBoard logs when installed"
    assert "tok/s" in done.stdout, "the DOS progress bar is on by default"


def test_extra_subcommands_are_dispatched() -> None:
    from lightning_dos.cli import main

    assert main(["plan", "--help"]) == 0
    assert main(["report", "/no/such/run"]) == 1


def test_missing_subcommand_module_is_a_clear_error(monkeypatch, capsys) -> None:  # noqa: ANN001
    from lightning_dos import cli

    monkeypatch.setitem(cli.EXTRA_COMMANDS, "report", ("lightning_dos.no_such_module", "draw a run"))
    assert cli.main(["report", "runs/x"]) == 2
    assert "lightning-dos report is unavailable" in capsys.readouterr().err


def test_progress_bar_items_are_compact_and_only_present_ones() -> None:
    full = {
        "dos/step_s": 1.5,
        "dos/forward_s": 0.25,
        "dos/backward_s": 0.5,
        "dos/update_s": 0.75,
        "dos/gpu_fraction": 0.4,
        "dos/h2d_gbps": 12.0,
        "dos/d2h_gbps": 11.5,
    }
    assert format_dos_metrics(full) == {
        "step": "1.50s",
        "f/b/u": "0.25/0.50/0.75",
        "device": "40%",
        "PCIe": "↑12.0 ↓11.5 GB/s",
    }
    assert format_dos_metrics({}) == {}
    assert format_dos_metrics({"dos/update_s": 0.5}) == {"update": "0.50s"}
    assert format_dos_metrics({"dos/h2d_gbps": 3.0}) == {"PCIe": "↑3.0 GB/s"}
    with pytest.raises(ValueError, match="smoothing=0"):
        DOSProgressBar(smoothing=0)


@pytest.mark.skipif(cpu_supports_fp16(), reason=FP16_RUNS_HERE)
def test_fp16_on_a_cpu_that_cannot_run_it_is_one_error_line() -> None:
    done = _run("fit", "--config", TINY, "--trainer.precision", "16-mixed", "--trainer.max_steps", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "precision='16-mixed'" in done.stderr and "bf16-mixed" in done.stderr
    assert "Traceback" not in done.stderr


def test_cpu_deepspeed_tests_run_in_a_process_told_to_use_cuda() -> None:
    """The GPU machine exports DS_ACCELERATOR=cuda: the CPU pass still runs the CPU-DeepSpeed tests there."""
    env = {**clean_env(), "DS_ACCELERATOR": "cuda"}
    test = "tests/test_equivalence.py::test_adam_with_l2_decay_matches_plain_adam"  # a real DeepSpeed fit on CPU
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed" in done.stdout
