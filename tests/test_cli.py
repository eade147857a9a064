"""The command line: help, a real fit through LightningCLI with the default bar and loggers, extra subcommands."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dos.integration.callbacks import DOSProgressBar
from lightning_dos.integration.callbacks.progress import format_dos_metrics
from lightning_dos.integration.cpu_strategy import cpu_supports_fp16
from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")
FP16_RUNS_HERE = (
    "this CPU runs fp16, so nothing is refused; test_fp16_is_refused_up_front_where_deepspeed_cannot_run_it "
    "covers the refusal with the capability forced off"
)


def _run(
    *args: str, timeout: int = 600, script: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_dos`` (or the installed ``lightning-dos`` script) in a clean environment."""
    console_script = Path(sys.executable).with_name("lightning-dos")
    if script and console_script.exists():
        command = [str(console_script), *args]
    else:
        command = [sys.executable, "-m", "lightning_dos", *args]
    return subprocess.run(command, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", [True, False], ids=["lightning-dos", "python-m"])
def test_help_lists_every_subcommand(script: bool) -> None:
    done = _run("--help", script=script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: lightning-dos")
    from lightning_dos.commands.main import EXTRA_COMMANDS, TRAINING_COMMANDS

    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(TRAINING_COMMANDS) | set(EXTRA_COMMANDS), done.stdout


def test_help_and_the_extra_subcommands_import_neither_torch_nor_lightning() -> None:
    """What keeps ``--help`` fast (well under 2 s): torch and Lightning are imported only to train."""
    code = (
        "import sys\n"
        "from lightning_dos.commands.main import main\n"
        "for args in (['--help'], ['plan', '--help'], ['report', '--help'], ['calibrate', '--help'],"
        " ['plan', '--params', '1e9', '--json']):\n"
        "    assert main(args) == 0, args\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'deepspeed') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_misspelt_option_exits_non_zero_naming_it() -> None:
    done = _run("fit", "--config", TINY, "--model.n_layerz", "3")
    assert done.returncode != 0
    assert "n_layerz" in done.stderr


#: What a run printed before it was made quiet (none may come back): per-step deprecations of the pinned
#: torch/DeepSpeed/Lightning, the false LR-scheduler warning, and start-up chatter.
NOISE = (
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "LeafSpec",
    "lr_scheduler.step()",
    "litlogger",
    "tensorboardX",
    "Setting accelerator to CPU",
    "built successfully",
    "TPU available",
    "Warning",
)


def test_a_30_step_fit_is_quiet_and_logs_one_row_per_step(tmp_path: Path) -> None:
    """The tiny recipe through the CLI (DOS strategy, CPU, default bar and loggers), shrunk to stay fast: no
    known noise on the console, one metrics.csv row per logged step with loss, learning rates and dos/*, and
    the progress bar on one line at 100 columns."""
    env = {**clean_env(), "COLUMNS": "100"}
    env.pop("DS_ACCELERATOR")  # DeepSpeed then finds its accelerator itself (and must not say so)
    done = _run(
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps",
        "30",
        "--trainer.log_every_n_steps",
        "5",
        "--trainer.val_check_interval",
        "15",
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
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert [noise for noise in NOISE if noise in console] == [], done.stderr[-3000:]
    metrics = next((tmp_path / "csv").rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [4, 9, 14, 19, 24, 29], "one row per logged step"
    for row in rows:
        assert row["epoch"] and row["dos/update_s"] and row["train/tokens_per_step"], row
        assert float(row["lr-AdamW/pg1"]) > 0 and float(row["lr-AdamW/pg2"]) > 0, row
    losses = [float(r["train/loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5, losses
    lrs = [float(r["lr-AdamW/pg1"]) for r in rows]
    assert lrs[0] > lrs[-1], "the learning rate follows the recipe's schedule (warm-up, then cosine decay)"
    with metrics.open() as handle:
        assert any("val/ppl" in r and r["val/ppl"] for r in csv.DictReader(handle))
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*")), "TensorBoard logs when installed"
    bar = [line for line in done.stdout.splitlines() if "Epoch 0" in line]
    assert bar and all("loss:" in line and "tok/s:" in line for line in bar), done.stdout[-2000:]
    assert max(len(line.rstrip()) for line in bar) <= 100


def _error_lines(stderr: str) -> list[str]:
    """What a refused run printed on stderr, less the seed line every run prints before its settings are built."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("Seed set to")]


def test_a_refused_strategy_setting_is_one_message_in_80_columns_from_the_command() -> None:
    """jsonargparse types ``trainer.strategy`` as ``str | Strategy`` and buried the strategy's refusal under
    "Does not validate against any of the Union subtypes" and a 1,400-character dump of every init argument; then
    it was one line of 121 characters."""
    done = _run("fit", "--config", TINY, "--trainer.strategy.init_args.gpu_fraction", "1.5", script=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert _error_lines(done.stderr) == [
        "lightning-dos: error: gpu_fraction=1.5 is not valid; use 'auto', a number in",
        "  [0, 1], or 'stride:K' with an integer K >= 1",
    ]


def test_a_refusal_wraps_at_80_columns_keeping_values_and_paths_whole() -> None:
    from lightning_dos.commands.main import refusal

    overlap = "overlap='bogus' is not valid for DeepOptimizerStatesStrategy; use one of 'off', 'forward', 'auto'"
    assert refusal(ValueError(overlap)).splitlines() == [
        "lightning-dos: error: overlap='bogus' is not valid for",
        "  DeepOptimizerStatesStrategy; use one of 'off', 'forward', 'auto'",
    ]
    path = "/data/" + "x" * 90 + ".json"
    lines = refusal(ValueError(f"config={path} does not exist\nsee the user guide")).splitlines()
    assert lines == ["lightning-dos: error:", f"  config={path}", "  does not exist", "see the user guide"]
    assert refusal(ValueError("short")) == "lightning-dos: error: short"


def _message(lines: list[str]) -> str:
    """A refusal's wrapped lines as the one sentence they wrap."""
    return " ".join(line.strip() for line in lines)


#: Runs the command's entry point in one process for every bad setting the strategy's own tests cover (a process
#: each would spend most of a minute importing torch, Lightning and DeepSpeed again).
_EVERY_BAD_SETTING = """
import contextlib, io, json, math, sys
from lightning_dos.commands.main import main
from tests.test_strategy_config import BAD_SETTINGS

def on_the_command_line(value):
    if isinstance(value, float) and math.isnan(value):
        return ".nan"  # YAML's NaN
    return value if isinstance(value, str) else json.dumps(value)

recipe = sys.argv.pop(1)  # LightningCLI warns when given both args and command-line arguments
results = []
for kwargs, setting, valid in BAD_SETTINGS:
    argv = ["fit", "--config", recipe]
    for key, value in kwargs.items():
        argv += [f"--trainer.strategy.init_args.{key}", on_the_command_line(value)]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    results.append({"argv": argv[3:], "rc": rc, "stderr": stderr.getvalue(), "setting": setting, "valid": valid})
print(json.dumps(results))
"""


def test_every_refused_strategy_setting_is_one_message_in_80_columns_naming_it_and_what_is_valid() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EVERY_BAD_SETTING, TINY],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) >= 30
    wrong = []
    for result in results:
        lines = _error_lines(result["stderr"])
        message = _message(lines)
        one_message = bool(lines) and lines[0].startswith("lightning-dos: error: ")
        in_80 = one_message and all(len(line) <= 80 or " " not in line.strip() for line in lines)  # a path stays whole
        if result["rc"] != 2 or not in_80 or result["setting"] not in message or result["valid"] not in message:
            wrong.append(f"{' '.join(result['argv'])}: rc {result['rc']}, {lines}")
    assert not wrong, "\n".join(wrong)


def test_extra_subcommands_are_dispatched() -> None:
    from lightning_dos.commands.main import main

    assert main(["plan", "--help"]) == 0
    assert main(["report", "/no/such/run"]) == 1


def test_missing_subcommand_module_is_a_clear_error(monkeypatch, capsys) -> None:  # noqa: ANN001
    from lightning_dos.commands import main as cli

    monkeypatch.setitem(cli.EXTRA_COMMANDS, "report", ("lightning_dos.no_such_module", "draw a run"))
    assert cli.main(["report", "runs/x"]) == 2
    assert "lightning-dos report is unavailable" in capsys.readouterr().err


def test_progress_bar_items_are_compact_and_only_present_ones() -> None:
    assert format_dos_metrics({"dos/gpu_fraction": 0.4, "dos/step_s": 1.5, "dos/h2d_gbps": 12.0}) == {"dev": "40%"}
    assert format_dos_metrics({}) == {}
    assert format_dos_metrics({"dos/gpu_fraction": 0.0}, show_zero_share=False) == {}
    assert format_dos_metrics({"dos/gpu_fraction": 0.0}) == {"dev": "0%"}
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
