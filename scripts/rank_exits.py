"""Run a short multi-rank training job over and over and count how its ranks exit (issue: every rank exits 0).

Each run trains TinyLM for 4 steps with the dos strategy on CPU ranks (tests/jobs/exit_ranks.py), gathers the
weights as a user's script would, and exits. A run passes when every rank exits 0 and no rank printed
"terminate" (C++'s std::terminate: a native thread torn down with the interpreter). Runs cycle through fp32 and
bf16-mixed, overlap "auto" and "off". ``--job train`` runs the suite's torchrun job instead
(tests/jobs/train_ranks.py: 8 steps, calibration and planning across ranks, rank 0 saving the weights last), the one
whose rank 1 aborted in CI.

    .venv/bin/python scripts/rank_exits.py --runs 20 --ranks 2 4 --launchers torchrun lightning
    .venv/bin/python scripts/rank_exits.py --runs 20 --ranks 2 --launchers torchrun --job train

Prints one line per run and a table per (ranks, launcher); exits 1 if any run failed. Logs of failed runs are kept
in --logs (default: a temporary folder, named at the end).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"exit": ROOT / "tests" / "jobs" / "exit_ranks.py", "train": ROOT / "tests" / "jobs" / "train_ranks.py"}
SETTINGS = list(itertools.product(("32-true", "bf16-mixed"), ("auto", "off")))
#: Variables of a surrounding distributed run that would make the job join it instead of starting its own.
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


def command(job_name: str, ranks: int, launcher: str, precision: str, overlap: str, out: Path) -> list[str]:
    settings = [precision, overlap] if job_name == "exit" else [str(out / "weights.pt")]
    job = [str(JOBS[job_name]), str(ranks), *settings]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *job]
    return [sys.executable, *job]  # Lightning's launcher re-runs this command line for ranks 1..N-1


def run_once(
    job: str, ranks: int, launcher: str, precision: str, overlap: str, timeout_s: float, out: Path
) -> tuple[bool, str, str]:
    """One run: (passed, why not, the whole output)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env["DS_ACCELERATOR"] = "cpu"
    try:
        done = subprocess.run(
            command(job, ranks, launcher, precision, overlap, out),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as timeout:
        out = (timeout.stdout or b"").decode(errors="replace") + (timeout.stderr or b"").decode(errors="replace")
        return False, f"timed out after {timeout_s:.0f} s", out
    out = done.stdout + done.stderr
    if done.returncode != 0:
        return False, f"exit status {done.returncode}", out
    if "terminate" in out:
        return False, "a rank printed 'terminate'", out
    return True, "", out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per (ranks, launcher), in a row")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--launchers", nargs="+", choices=("torchrun", "lightning"), default=["torchrun", "lightning"])
    parser.add_argument("--job", choices=sorted(JOBS), default="exit", help="the job each run starts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--logs", type=Path, default=None, help="folder for the logs of failed runs")
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="rank-exits-"))
    logs.mkdir(parents=True, exist_ok=True)
    table: list[tuple[int, str, int, int, float]] = []
    for ranks, launcher in itertools.product(args.ranks, args.launchers):
        failed, started = 0, time.monotonic()
        for n in range(args.runs):
            precision, overlap = SETTINGS[n % len(SETTINGS)]
            t0 = time.monotonic()
            ok, why, out = run_once(args.job, ranks, launcher, precision, overlap, args.timeout, logs)
            setting = f"{precision}, overlap={overlap}" if args.job == "exit" else "tests/jobs/train_ranks.py"
            label = f"{ranks} ranks, {launcher}, {setting}, run {n + 1}/{args.runs}"
            if not ok:
                failed += 1
                log = logs / f"{ranks}-{launcher}-{n + 1}.log"
                log.write_text(out)
                print(f"FAIL {label}: {why} ({log})", flush=True)
            else:
                print(f"ok   {label} ({time.monotonic() - t0:.0f} s)", flush=True)
        table.append((ranks, launcher, args.runs, failed, time.monotonic() - started))
    print(f"\n{'ranks':>5}  {'launcher':<9}  {'runs':>4}  {'exit 0':>6}  {'failed':>6}  {'s/run':>5}")
    for ranks, launcher, runs, failed, seconds in table:
        print(f"{ranks:>5}  {launcher:<9}  {runs:>4}  {runs - failed:>6}  {failed:>6}  {seconds / runs:>5.0f}")
    total_failed = sum(row[3] for row in table)
    if total_failed:
        print(f"\n{total_failed} run(s) failed; logs in {logs}")
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
