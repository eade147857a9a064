"""``Fabric(strategy="dos")`` where a process of its own is needed (tests/jobs/fabric_loop.py run as a script): a
checkpoint saved mid-run by ``fabric.save`` continues bit for bit after ``fabric.load`` in a fresh process, whose
console under the defaults is as quiet as the Trainer's at 80 columns; two processes (``devices=2`` on CPU, Fabric's
launcher) equal one. The in-process loops are in tests/test_fabric.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from rich.cells import cell_len

from tests.helpers import clean_env, max_relative_error
from tests.jobs.fabric_loop import same, train

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "fabric_loop.py"
CLIP = 0.5


def _job(tmp_path: Path, name: str, **settings: object) -> tuple[dict, str]:
    """The loop run as a script with ``settings``, at 80 columns into a pipe: what rank 0 saved, and the console."""
    (tmp_path / f"{name}.json").write_text(json.dumps(settings))
    out = tmp_path / f"{name}.pt"
    done = subprocess.run(
        [sys.executable, str(JOB), str(tmp_path / f"{name}.json"), str(out)],
        cwd=ROOT, env={**clean_env(), "COLUMNS": "80"}, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out), done.stdout + done.stderr


def test_fabric_save_mid_run_then_load_in_a_fresh_process_continues_bit_exactly_and_quietly(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    # The defaults: overlap="auto", so the save (after an evaluation under no_grad) waits for the update in flight.
    whole = train({}, steps=6, clip=CLIP, save_at=2, checkpoint=ckpt)
    resumed, console = _job(tmp_path, "resumed", dos={}, steps=6, clip=CLIP, checkpoint=ckpt, resume=True)
    assert same(resumed["params"], whole.params)
    assert resumed["lr"] == whole.lr  # the LR schedule the loop steps was saved and restored with the rest
    assert resumed["losses"] == whole.losses[3:]
    lines = console.splitlines()
    assert [line for line in lines if cell_len(line) > 80 or line != line.rstrip() or "\r" in line] == [], console
    assert [line for line in lines if "warn" in line.lower() or "deepspeed" in line.lower()] == [], console
    assert len(lines) <= 10, console  # the host threads, what overlap runs as, the sub-group size: as the Trainer


def test_two_processes_equal_one(tmp_path: Path) -> None:
    dos = {"sub_group_size": 700, "overlap": "auto"}
    one = train(dos, steps=3, clip=CLIP)
    two, _ = _job(tmp_path, "two", dos=dos, steps=3, clip=CLIP, devices=2)
    assert max_relative_error(two["params"], one.params) < 1e-5
