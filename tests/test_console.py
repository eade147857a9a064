"""The console at 80 columns in a pipe (as in a default terminal or a log file): every command the README gives
that runs on CPU (fit, validate, report, the NVMe form of fit, calibrate, plan, simulate), run as it is written
with only its size cut down, prints no line over 80 columns, none ending in spaces and no carriage return; the
progress bar's last frame is one line, no header or cell is cut to ``…``, and a run without a GPU shows no GPU
rows of zeros. The README's GPU commands (the gpt-7b recipe; gpt-13b and gpt-20b over 8 devices, torchrun, srun)
are not run here: they need GPUs."""

from __future__ import annotations

import io
import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from rich.cells import cell_len

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.host import disk
from lightning_dos.integration.callbacks import DOSMonitor, DOSProgressBar
from lightning_dos.integration.callbacks.summary import informative_columns
from tests.helpers import TinyLM, clean_env, loader, trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")
#: Rows of the medians table that only an accelerator fills (zeros on a CPU run).
DEVICE_ROWS = ("host to device", "device to host", "PCIe utilisation", "device share")


def _run_at_80(*args: str, timeout: int = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m lightning_dos ARGS`` with COLUMNS=80, stdout and stderr into pipes (not a terminal)."""
    env = {**clean_env(), "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lightning_dos", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _too_wide(text: str, width: int = 80) -> list[str]:
    """Lines wider than ``width`` terminal cells (a box-drawing character is one cell, three UTF-8 bytes)."""
    return [line for line in text.splitlines() if cell_len(line.rstrip()) > width]


def _faults(text: str, width: int = 80) -> list[str]:
    """Each line over ``width`` cells, ending in spaces, or holding a carriage return (a tqdm bar's frames)."""
    return [
        repr(line) for line in text.split("\n") if cell_len(line) > width or line != line.rstrip(" ") or "\r" in line
    ]


#: The model the README's tiny-recipe commands are cut down to (validate must build the one fit trained).
SMALL_MODEL = ("--model.n_layer", "1", "--model.warmup_steps", "2", "--data.max_bytes", "100000")
#: fit's size, cut down: 12 steps, validated every 6 on one batch, logged every 3.
FAST_FIT = (
    *("--trainer.max_steps", "12", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "1"),
    *("--trainer.log_every_n_steps", "3", *SMALL_MODEL),
)


@pytest.fixture(scope="module")
def readme_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``lightning-dos fit --config recipes/gpt-tiny.yaml``, cut down, run once for this module in a folder of its
    own, so that the run lands in ``runs/gpt-tiny`` there as the README's validate and report expect."""
    where = tmp_path_factory.mktemp("readme")
    return where, _run_at_80("fit", "--config", TINY, *FAST_FIT, cwd=where)


def test_the_main_job_at_80_columns_in_a_pipe(readme_fit: tuple[Path, subprocess.CompletedProcess]) -> None:
    """The tiny recipe through the CLI, shrunk to stay fast, printed into a pipe at 80 columns."""
    where, done = readme_fit
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert _faults(console) == [], console
    assert (where / "runs" / "gpt-tiny" / "checkpoints" / "last.ckpt").is_dir()
    assert "…" not in console, console
    assert [line for line in console.splitlines() if "warning" in line.lower()] == [], console
    lines = [line.rstrip() for line in done.stdout.splitlines() if line.strip()]
    # The progress bar's last frame is the last line, whole: nothing of it wrapped onto a line of its own.
    bar = lines[-1]
    assert bar.startswith("Epoch 0") and "12/12" in bar, done.stdout[-2000:]
    assert all(f" {item}: " in f" {bar}" for item in ("loss", "val", "tok/s")), bar
    assert bar.split("tok/s: ")[1].strip(), bar
    # Tables whole (every box line closed on the right); the model summary without FLOPs nobody counted.
    boxed = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert boxed and all(line[-1:] in "┓┃┩│┘" for line in boxed), boxed
    assert any("Name" in line and "Params" in line for line in boxed), done.stdout
    assert "FLOPs" not in console, done.stdout
    # The medians table: no GPU rows (zeros) in a run with no GPU; the rows with data are there.
    assert "medians over 12 steps" in console
    assert [row for row in DEVICE_ROWS if row in console] == [], done.stdout
    assert all(row in console for row in ("forward", "backward", "update", "peak memory, update")), done.stdout


#: The README's commands that run on CPU, as it writes them (less ``.venv/bin/``); each is run below, cut down.
README_CPU = {
    "fit": "lightning-dos fit --config recipes/gpt-tiny.yaml",
    "validate": "lightning-dos validate --config recipes/gpt-tiny.yaml --ckpt_path runs/gpt-tiny/checkpoints/last.ckpt",
    "report": "lightning-dos report runs/gpt-tiny",
    "nvme": "lightning-dos fit --config recipes/gpt-tiny.yaml "
    "--trainer.strategy.init_args.offload_optimizer_device nvme --trainer.strategy.init_args.nvme_path /local_nvme "
    "--trainer.strategy.init_args.host_memory_budget 0",
    "calibrate": "lightning-dos calibrate --out my-node.yaml",
    "plan": "lightning-dos plan --params 20e9 --gpus-per-node 4 --profile paper-h100x4",
    "simulate": "lightning-dos simulate --params 20e9 --profile paper-h100x4 --trace sim.json",
}
#: The README's commands that need GPUs (not run here), by the recipe each names.
README_GPU = ("recipes/gpt-7b.yaml", "recipes/gpt-13b.yaml", "recipes/gpt-20b.yaml")


def _readme_commands() -> list[str]:
    """Every ``lightning-dos`` command in the README's bash blocks: continued lines joined, comments and
    ``.venv/bin/`` dropped, spaces collapsed."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = [" ".join(re.sub(r"(^|\s)#.*", "", line).replace(".venv/bin/", "").split()) for line in lines]
    return [c for c in commands if "lightning-dos" in c or "lightning_dos" in c]


def test_every_readme_command_is_checked_here_or_needs_a_gpu() -> None:
    """A command added to the README is run by a test below, or names a GPU recipe."""
    found = _readme_commands()
    unchecked = [c for c in found if c not in README_CPU.values() and not any(r in c for r in README_GPU)]
    assert unchecked == [], f"README commands with no console test (add to README_CPU): {unchecked}"
    assert sorted(set(README_CPU.values()) - set(found)) == [], "README_CPU names a command the README dropped"


def _readme_run(name: str, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    """README command ``name`` run as written (plus ``extra``, which cuts it down) at 80 columns in ``cwd``."""
    args = [TINY if arg == "recipes/gpt-tiny.yaml" else arg for arg in shlex.split(README_CPU[name])[1:]]
    return _run_at_80(*args, *extra, cwd=cwd)


def test_readme_validate_at_80_columns(readme_fit: tuple[Path, subprocess.CompletedProcess]) -> None:
    """validate on the README's checkpoint: DeepSpeed's converter's tqdm bars (carriage returns) are not shown in
    a pipe, and the bar's last frame has no trailing spaces."""
    where, fit = readme_fit
    assert fit.returncode == 0, fit.stderr[-3000:]
    done = _readme_run("validate", "--trainer.limit_val_batches", "1", *SMALL_MODEL, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert _faults(console) == [], console
    assert "val/loss" in done.stdout and "Validation" in done.stdout, console


def test_readme_report_at_80_columns(readme_fit: tuple[Path, subprocess.CompletedProcess]) -> None:
    where, fit = readme_fit
    assert fit.returncode == 0, fit.stderr[-3000:]
    done = _readme_run("report", cwd=where)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _faults(done.stdout + done.stderr) == [], done.stdout + done.stderr


@pytest.mark.skipif(
    disk.aio_unavailable() is not None, reason="libaio-dev is not installed (scripts/nvme-tools.sh installs it)"
)
def test_readme_nvme_fit_at_80_columns(tmp_path: Path) -> None:
    """The README's command-line form of the NVMe tier, on a directory here and cut down (4 steps)."""
    drive = tmp_path / "nvme"
    drive.mkdir()
    args = ["--trainer.strategy.init_args.nvme_path", str(drive), "--trainer.max_steps", "4"]
    args += ["--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", *SMALL_MODEL]
    done = _readme_run("nvme", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert _faults(console) == [], console
    assert console.count("datacenter SSD") == 1, "DeepSpeed's SSD-wear notice, once in our words"


def test_readme_calibrate_at_80_columns(tmp_path: Path) -> None:
    done = _readme_run("calibrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _faults(done.stdout + done.stderr) == [], done.stdout + done.stderr
    assert (tmp_path / "my-node.yaml").is_file()


def test_readme_plan_at_80_columns_says_its_profile(tmp_path: Path) -> None:
    done = _readme_run("plan", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _faults(done.stdout + done.stderr) == [], done.stdout
    assert [line for line in done.stdout.splitlines() if "paper-h100x4" in line] == [
        "PREDICTED (not measured) for profile paper-h100x4"
    ], done.stdout


def test_readme_simulate_at_80_columns(tmp_path: Path) -> None:
    done = _readme_run("simulate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _faults(done.stdout + done.stderr) == [], done.stdout + done.stderr
    assert (tmp_path / "sim.json").is_file()


@pytest.mark.parametrize("timed", [False, True], ids=["update only", "with forward and backward"])
def test_plan_at_80_columns_in_a_pipe(timed: bool) -> None:
    # With times, also a budget: TwinFlow's rows (and 'over') appear only when resident state is planned.
    extra = ("--forward-s", "0.4", "--backward-s", "0.9", "--budget", "30e9") if timed else ()
    done = _run_at_80("plan", "--params", "20e9", "--profile", "paper-h100x4", *extra, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _too_wide(done.stdout) == [], done.stdout
    assert [line for line in done.stdout.splitlines() if line.endswith(" ")] == [], "rich pads centred lines"
    assert "…" not in done.stdout, done.stdout
    header = "\n".join(line for line in done.stdout.splitlines() if line.startswith("┃"))
    for word in ("scheme", "update", "B params", "per s", "floor", "GPU", "held", "GB"):
        assert word in header, header
    assert ("iteration" in header) == timed, "the iteration column only when forward/backward times are given"
    # With the iteration column and TwinFlow's rows, long scheme names fold onto a second line (never cut).
    cells = ("stock ZeRO-3", "ours (auto)", "floor T(r*)")
    for cell in cells + (("TwinFlow ratio", "40.00 over") if timed else ()):
        assert cell in done.stdout, done.stdout
    assert "floor at r* =" in done.stdout


@pytest.mark.parametrize("command", ["", "plan", "simulate", "report", "calibrate"])
def test_help_at_80_columns_in_a_pipe(command: str) -> None:
    done = _run_at_80(*([command] if command else []), "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and _too_wide(done.stdout) == [], done.stdout


def test_simulate_at_80_columns_in_a_pipe(tmp_path: Path) -> None:
    trace = tmp_path / "sim.json"
    nvme = ("--nvme-read-gbs", "25", "--nvme-write-gbs", "10")  # and the NVMe tier's table
    done = _run_at_80("simulate", "--params", "20e9", "--profile", "paper-h100x4", "--trace", str(trace), *nvme)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _too_wide(done.stdout) == [], done.stdout
    assert "…" not in done.stdout, done.stdout
    assert "SIMULATED (not measured)" in done.stdout and "stream races found" in done.stdout
    assert "NVMe tier" in done.stdout and "replay/" in done.stdout
    assert trace.exists()


class _LoggedLM(TinyLM):
    """TinyLM with its losses on the progress bar, as the recipe GPT logs them."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        self.log("val/loss", self.loss(batch), prog_bar=True)


@pytest.mark.parametrize("columns", [80, 56])
def test_the_bar_with_a_device_share_keeps_to_one_line(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A real DOS fit (CPU, half the elements on the "device", so ``dev`` shows) whose bar is printed at
    ``columns``: at 80 everything fits on one line with a narrower bar; at 56 the least useful items go
    (``dev`` first, then ``tok/s``) and ``loss`` stays."""
    monkeypatch.setenv("COLUMNS", str(columns))  # rich reads it when Lightning builds the bar's console
    bar = DOSProgressBar()
    run = trainer(
        DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=2_000),
        steps=8,
        callbacks=[bar, DOSMonitor(summary=False)],
        enable_progress_bar=True,
        val_check_interval=4,
        limit_val_batches=1,
    )
    run.fit(_LoggedLM(), train_dataloaders=loader(), val_dataloaders=loader())
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines() if line.strip()]
    last = printed[-1]
    assert last.startswith("Epoch 0") and "8/8" in last, printed
    assert _too_wide("\n".join(printed), columns) == [], printed
    assert " loss: " in last, last
    if columns == 80:
        assert " dev: 50%" in last and " tok/s: " in last and " val: " in last, last
    else:
        assert " dev: " not in last, last


def test_summary_columns_that_say_nothing_are_left_out() -> None:
    data = [
        (" ", ["0", "1"]),
        ("Name", ["a", "b"]),
        ("Params", ["1.0 K", "0  "]),
        ("Params per Device", ["1.0 K", "0  "]),
        ("Mode", ["train", "train"]),
        ("FLOPs", ["0  ", "0  "]),
    ]
    assert [name for name, _ in informative_columns(data, total_flops=0)] == [" ", "Name", "Params", "Mode"]
    sharded = [*data[:3], ("Params per Device", ["512  ", "0  "]), data[4], ("FLOPs", ["2.0 K", "0  "])]
    kept = [name for name, _ in informative_columns(sharded, total_flops=2000)]
    assert kept == [" ", "Name", "Params", "Params per Device", "Mode", "FLOPs"]


def _printed(table: object) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=80).print(table)
    return out.getvalue()


def test_the_medians_table_leaves_out_device_rows_of_zeros_only_without_an_accelerator() -> None:
    from lightning_dos.integration.callbacks.monitor import summary_table

    idle = [{"dos/step_s": 1.0, "dos/update_s": 0.5, "dos/h2d_gbps": 0.0, "dos/gpu_fraction": 0.0}] * 3
    cpu = _printed(summary_table(idle, on_accelerator=False))
    assert "host to device" not in cpu and "device share" not in cpu and "update" in cpu
    gpu = _printed(summary_table(idle, on_accelerator=True))
    assert "host to device" in gpu and "device share" in gpu, "on a GPU a 0% share is a finding"
    busy = [{**idle[0], "dos/gpu_fraction": 0.5}]
    assert "device share" in _printed(summary_table(busy, on_accelerator=False)), "a share with data stays"


def test_lightnings_note_about_the_summary_is_dropped_only_for_ours() -> None:
    """Lightning says it skips its default summary when one is given: not said for DOSModelSummary (the CLI
    adds it), still said for a user's own."""
    from lightning_dos.host import quiet

    quiet.install()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    head = "Trainer already configured with model summary callbacks: "
    ours = head + "[<class 'lightning_dos.integration.callbacks.summary.DOSModelSummary'>]. Skipping setting a default"
    theirs = head + "[<class 'my.Summary'>]. Skipping setting a default"

    def shown(message: str) -> bool:
        record = logging.LogRecord(log.name, logging.INFO, __file__, 0, message, None, None)
        return all(f.filter(record) for f in log.filters)

    assert (shown(ours), shown(theirs)) == (False, True)


#: A CUDA build of torch on a machine without a GPU, in a fresh process: torch.utils.cpp_extension, imported by
#: DeepSpeed's op builder on every run, finds CUDA_HOME and logs that no CUDA runtime is found (this torch is a CPU
#: build, so the test makes it look like a CUDA one: the same condition, `_find_cuda_home`'s, as on such a machine).
_CUDA_BUILD_WITHOUT_A_GPU = """
import logging, sys
import torch
torch.cuda._is_compiled = lambda: True
torch.version.cuda = "12.8"
torch.cuda.is_available = lambda: False
if sys.argv[1] == "quiet":
    from lightning_dos.host import quiet
    quiet.install()
elif sys.argv[1] == "op builder":
    from lightning_dos.host.extensions import announce_op_builds
    announce_op_builds()
import torch.utils.cpp_extension
logging.getLogger("torch.utils.cpp_extension").warning("another warning of the same logger")
print("CUDA_HOME", torch.utils.cpp_extension.CUDA_HOME)
"""


@pytest.mark.parametrize("how", ["none", "quiet", "op builder"])
def test_no_cuda_runtime_message_of_a_cuda_torch_is_silenced_on_cpu_runs(how: str) -> None:
    """Exactly that message: another warning of torch's logger still shows, and without the filters it is there."""
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_BUILD_WITHOUT_A_GPU, how],
        cwd=ROOT,
        env={**clean_env(), "CUDA_HOME": "/usr/local"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "CUDA_HOME /usr/local" in done.stdout, "torch.utils.cpp_extension took the CUDA build's path"
    said = "No CUDA runtime is found, using CUDA_HOME='/usr/local'" in done.stderr
    assert said == (how == "none"), done.stderr
    assert "another warning of the same logger" in done.stderr
