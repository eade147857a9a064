"""Host resources per rank and planning time: the tables of issue 12 (points 2 and 6).

1. Threads and CPUs of each rank when CPU ranks train the test model (tests/jobs/train_ranks.py) with
   ``host_threads="auto"``: 2 ranks launched by Lightning, by ``torchrun``, and by hand with nothing set (as
   ``srun`` does); and 1 rank under ``torchrun`` with ``OMP_NUM_THREADS=1``, which torchrun sets whenever it
   starts several ranks per node (on this 2-CPU machine two ranks get one CPU each either way). For each
   rank: torch threads and CPUs as launched, threads during an optimizer step, the CPUs it is bound to, the
   CPUs any of its threads may run on, and ``dos/host_threads`` as logged.
2. ``choose_plan`` time at 25, 50 and 100 sub-groups (resident state allowed, with and without a budget,
   equal and unequal sizes), optionally side by side with the search of an earlier revision.

    python bench/resources.py                            # both tables
    python bench/resources.py --plan-only --baseline 3ca7542 --baseline-max 50
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dos.host.cores import format_cpulist  # noqa: E402
from lightning_dos.model import perfmodel, plan_search  # noqa: E402

JOB = ROOT / "tests" / "jobs" / "train_ranks.py"
#: One H100 rank with a share of a many-core host (the rates tests/test_perfmodel.py uses).
GPU = perfmodel.HardwareRates(2.5e9, 10e9, 150e9, 50e9, 50e9, 30e9, 30e9)


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and k != "OMP_NUM_THREADS"}
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(launcher: str, out: Path, ranks: int = 2) -> list[dict]:
    """Train on ``ranks`` CPU processes started by ``launcher``; every rank's record of its host threads."""
    job = [str(JOB), str(ranks), str(out)]
    env = _env()
    if launcher == "lightning":
        procs = [subprocess.Popen([sys.executable, *job], cwd=ROOT, env=env)]
    elif launcher in ("torchrun", "torchrun-omp1"):
        if launcher == "torchrun-omp1":  # what torchrun sets for jobs of several ranks, here on a single rank
            env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *job]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=env)]
    else:  # by hand, nothing about threads set: what srun does
        port = str(_free_port())
        procs = []
        for rank in range(ranks):
            rank_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks)}
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
            procs.append(subprocess.Popen([sys.executable, *job], cwd=ROOT, env=rank_env))
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"{launcher} run failed (exit {proc.returncode})")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]


def threads_table(launchers: list[str]) -> str:
    """``launchers``: ``name:ranks`` items (name: lightning, torchrun, torchrun-omp1 or by-hand)."""
    rows = [
        "| launcher | ranks | rank | as launched: threads, CPUs | in the step: threads | bound to CPUs"
        " | CPUs any of its threads may use | dos/host_threads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for item in launchers:
            launcher, _, ranks = item.partition(":")
            seen_by_rank = run_ranks(launcher, Path(tmp) / f"{launcher}{ranks}.pt", int(ranks or 2))
            for rank, seen in enumerate(seen_by_rank):
                rows.append(
                    f"| {launcher} | {len(seen_by_rank)} | {rank} |"
                    f" {seen['threads_at_start']}, {format_cpulist(seen['cpus_at_start'])} | {seen['threads']} |"
                    f" {format_cpulist(seen['placement_cores']) or 'as launched'} |"
                    f" {format_cpulist(seen['every_thread_cpus'])} | {seen['logged_host_threads']:g} |"
                )
    return "\n".join(rows)


#: Where the performance model lived before the folders became layers (issue 33), and the modules its imports
#: named there, by where they are now: a baseline from before the move still loads against today's tree.
_OLD_PERFMODEL = "lightning_dos/engine/perfmodel.py"
_MOVED = {b"lightning_dos.engine.plan": b"lightning_dos.model.plan",
          b"lightning_dos.engine.update_rules": b"lightning_dos.model.update_rules",
          b"lightning_dos.engine.report": b"lightning_dos.model.step_report"}  # fmt: skip


def _source_at(revision: str, path: str) -> bytes | None:
    done = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True)
    return done.stdout if done.returncode == 0 else None


def _module_from(name: str, source: bytes) -> ModuleType:
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_baseline(revision: str) -> ModuleType:
    """The module holding ``choose_plan`` at ``revision`` (git), loaded as a module of its own: its
    ``lightning_dos/model/plan_search.py`` over that revision's ``perfmodel.py``; before the search had a module
    of its own, ``lightning_dos/model/perfmodel.py``; before the layout of issue 33,
    ``lightning_dos/engine/perfmodel.py`` (its imports pointed at today's modules)."""
    model = _source_at(revision, "lightning_dos/model/perfmodel.py")
    if model is None:
        model = _source_at(revision, _OLD_PERFMODEL)
        if model is None:
            raise SystemExit(f"{revision}: no performance model found at this revision")
    for old, new in _MOVED.items():
        model = model.replace(old, new)
    perfmodel_then = _module_from(f"perfmodel_{revision}", model)
    search = _source_at(revision, "lightning_dos/model/plan_search.py")
    if search is None:
        return perfmodel_then
    return _module_from(
        f"plan_search_{revision}", search.replace(b"lightning_dos.model.perfmodel", perfmodel_then.__name__.encode())
    )


def _best_ms(fn, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """Best wall and best CPU milliseconds of ``repeats`` runs (CPU time is what a busy machine disturbs least:
    choose_plan is single-threaded Python)."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return 1e3 * wall, 1e3 * cpu


def plan_table(counts: list[int], baseline: ModuleType | None, baseline_max: int, repeats: int) -> str:
    head = "| sub-groups | sizes | budget | ours ms (wall / CPU) | predicted update s | resident / streamed / host |"
    rows = [head + (" baseline CPU ms | baseline / ours (CPU) | same prediction |" if baseline else "")]
    rows.append("|---" * (rows[0].count("|") - 1) + "|")
    for n in counts:
        for kind in ("equal", "unequal"):
            # Unequal: DeepSpeed packs whole parameters, so sub-groups differ by up to a few percent.
            sizes = [100_000_000 - (0 if kind == "equal" else 7_919 * (i % 13)) for i in range(n)]
            for budget in (None, 16 * sum(sizes) // 3):

                def ours(sizes=sizes, budget=budget):  # noqa: ANN202
                    return plan_search.choose_plan(sizes, GPU, budget, 2, allow_resident=True)

                ms, cpu_ms = _best_ms(ours, repeats)
                plan, prediction = ours()
                counts_ = f"{len(plan.resident_indices)} / {len(plan.streamed_indices)} / {len(plan.host_indices)}"
                budget_text = "none" if budget is None else "a third of the state"
                timing = f"{ms:.1f} / {cpu_ms:.1f}"
                row = f"| {n} | {kind} | {budget_text} | {timing} | {prediction.time_s:.4f} | {counts_} |"
                if baseline is not None:
                    if n <= baseline_max:
                        start = time.process_time()
                        _, theirs = baseline.choose_plan(sizes, GPU, budget, 2, allow_resident=True)
                        base_ms = 1e3 * (time.process_time() - start)
                        same = abs(theirs.time_s - prediction.time_s) <= 1e-9 * theirs.time_s
                        verdict = "yes" if same else f"ours {prediction.time_s / theirs.time_s:.4f}x theirs"
                        row += f" {base_ms:.0f} | {base_ms / cpu_ms:.0f}x | {verdict} |"
                    else:
                        row += " not run | | |"
                rows.append(row)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan-only", action="store_true", help="only the choose_plan table")
    parser.add_argument("--threads-only", action="store_true", help="only the per-rank threads table")
    launchers = "lightning:2,torchrun:2,by-hand:2,torchrun-omp1:1"
    parser.add_argument("--launchers", default=launchers, help="name:ranks items, comma-separated")
    parser.add_argument("--counts", default="25,50,100", help="sub-group counts to plan for")
    parser.add_argument("--repeats", type=int, default=5, help="choose_plan runs per case (the best is shown)")
    parser.add_argument("--baseline", help="git revision whose choose_plan to time side by side")
    parser.add_argument("--baseline-max", type=int, default=50, help="largest sub-group count for the baseline")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, usable {format_cpulist(sorted(os.sched_getaffinity(0)))}, load average {load:.1f}")
    if not args.plan_only:
        print("\n" + threads_table(args.launchers.split(",")))
    if not args.threads_only:
        baseline = load_baseline(args.baseline) if args.baseline else None
        counts = [int(c) for c in args.counts.split(",")]
        print("\n" + plan_table(counts, baseline, args.baseline_max, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
