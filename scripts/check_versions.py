#!/usr/bin/env python3
"""Check the project against one set of dependency versions, in a fresh virtual environment.

    python scripts/check_versions.py torch==2.13.0 lightning==2.6.0 deepspeed==0.19.8 torchmetrics==1.4.0 \\
        rich==13.0.0 'jsonargparse[signatures]==4.39.0' pyyaml==6.0 matplotlib==3.8.0

Every version is pinned with ``==``, torch among them. The script

1. creates a virtual environment in a temporary folder (``--venv DIR`` keeps one there instead),
2. installs torch alone, pinned, first: an unpinned torch, or a later resolution left free to pick one, pulls a CUDA
   build and several GB of CUDA packages; before it downloads anything it asks pip what the install would bring and
   refuses a CUDA build's packages (``nvidia-*``, ``triton``) unless ``--allow-cuda``,
3. installs the project (a copy of this checkout's files, with its ``dev`` extra for pytest) constrained to the pins,
   and checks that pip installed each pin as given,
4. runs the README's main job briefly (``lightning-dos fit --config recipes/gpt-tiny.yaml``, ``--steps`` steps; its
   loss must fall), then ``lightning-dos report`` on it,
5. runs the exactness tests (``--tests``; by default the kernels against torch's and the engine, through Lightning and
   DeepSpeed, against plain AdamW: :data:`EXACTNESS_TESTS`),

and prints a table of what passed. Exit status 0 when every row passed, 1 when one failed, 2 for a usage error.
DeepSpeed's ops are built once per version set (``~/.cache/torch_extensions/check-versions-<set>``); the build's
commands name the environment's path, so a kept ``--venv`` rebuilds nothing on the next run.

The lower bounds in pyproject.toml are the versions of :data:`VERIFIED`, a run of this script that passed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The tests that compare bit for bit (or to float precision with plain AdamW) and depend on the versions checked:
#: torch's kernels, and Lightning driving DeepSpeed ZeRO-3 through the strategy.
EXACTNESS_TESTS = (
    "tests/test_native_kernel.py",
    "tests/test_kernels.py",
    "tests/test_native_rules.py",
    "tests/test_equivalence.py",
    "tests/test_skipped_steps.py",
    "tests/test_deepspeed_surface.py",
    "tests/test_engine_behaviour.py::test_checkpoint_written_mid_run_reloads_with_another_placement",
)
#: The version set whose run set pyproject.toml's lower bounds (tests/test_dependencies.py holds them equal): every
#: row passed with these pins, on 2 cores with no GPU, Python 3.11.7 (docs/tests.md, "Dependency versions", has the
#: command and its table). Older ones that failed: deepspeed 0.19.0 (its ZeRO-3 optimizer lacks what the adapter
#: calls; 0.19.1-0.19.7's sources lack it too), jsonargparse 4.27.7 (LightningCLI 2.6 stops at start-up).
VERIFIED = {
    "torch": "2.13.0",
    "lightning": "2.6.0",
    "deepspeed": "0.19.8",
    "torchmetrics": "1.4.0",
    "rich": "13.0.0",
    "jsonargparse": "4.39.0",
    "pyyaml": "6.0",
    "matplotlib": "3.8.0",
}
#: Packages a CUDA build of torch brings (several GB).
CUDA_PACKAGES = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[A-Za-z0-9_,.-]+\])?==(?P<version>[^=<>!~;\s]+)$")
#: Files copied into the environment's source folder: what git tracks, plus files it does not ignore.
LS_FILES = ("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(pins: list[str]) -> dict[str, tuple[str, str]]:
    """``NAME[extras]==VERSION`` arguments -> {normalized name: (the argument, version)}; torch must be among them.

    Raises:
        ValueError: an argument that is not an exact pin, a package named twice, or no torch.
    """
    parsed: dict[str, tuple[str, str]] = {}
    for pin in pins:
        match = PIN.match(pin.strip())
        if match is None:
            raise ValueError(f"{pin!r} is not an exact pin: write NAME==VERSION (a version set names one of each)")
        name = normalized(match["name"])
        if name in parsed:
            raise ValueError(f"{match['name']} is pinned twice")
        parsed[name] = (pin.strip(), match["version"])
    if "torch" not in parsed:
        raise ValueError("pin torch too (torch==VERSION): an unpinned torch pulls a CUDA build of several GB")
    return parsed


class Table:
    """The rows of the report: check, result, seconds, detail."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, check: str, passed: bool | None, seconds: float | None, detail: str) -> bool:
        result = "not run" if passed is None else ("pass" if passed else "FAIL")
        self.rows.append((check, result, "" if seconds is None else f"{seconds:.0f}", detail))
        print(f"check_versions: {check}: {result} {detail}", flush=True)
        return bool(passed)

    def markdown(self) -> str:
        lines = ["| check | result | seconds | detail |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in self.rows]
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        return all(row[1] == "pass" for row in self.rows)


def run(
    args: list[str], log: Path, timeout: float, stdout_only: bool = False, logged: bool = True, **kwargs: object
) -> tuple[int, str, float]:
    """Run ``args``, its output appended to ``log`` (unless not ``logged``); (exit status, output, seconds). A time-out
    is status 124. ``stdout_only``: the output returned is stdout alone (the log has both)."""
    start = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        status = 124
        out, err = (x.decode() if isinstance(x, bytes) else (x or "") for x in (expired.stdout, expired.stderr))
    if logged:
        with log.open("a") as handle:
            handle.write(f"$ {' '.join(args)}\n{out}{err}\n[exit {status}]\n")
    return status, out if stdout_only else out + err, time.perf_counter() - start


def last_lines(output: str, count: int = 3) -> str:
    return " / ".join(line.strip() for line in output.strip().splitlines()[-count:])


def pip(python: Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", *args]


def cuda_packages(python: Path, torch_pin: str, log: Path) -> tuple[list[str] | None, str]:
    """The CUDA packages installing ``torch_pin`` would bring (pip's dry run: nothing downloaded but metadata)."""
    dry_run = pip(python, "install", "--dry-run", "--quiet", "--report", "-", torch_pin)
    status, output, _ = run(dry_run, log, 900, stdout_only=True, logged=False)
    try:
        install = json.loads(output)["install"]
    except (ValueError, KeyError):
        return None, f"pip's dry run failed (exit {status}; see the log)"
    names = [item["metadata"]["name"] for item in install]
    urls = [item["download_info"]["url"] for item in install if normalized(item["metadata"]["name"]) == "torch"]
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(dry_run)}\nwould install: {', '.join(names)}; torch from {urls}\n")
    return [n for n in names if CUDA_PACKAGES.match(normalized(n))], (urls or ["torch?"])[0].rsplit("/", 1)[-1]


def installed(python: Path, names: list[str]) -> dict[str, str | None]:
    """The installed version of each of ``names`` in the environment of ``python`` (None: not installed)."""
    script = (
        "import json, sys\nfrom importlib import metadata\nout = {}\nfor n in sys.argv[1:]:\n"
        "    try: out[n] = metadata.version(n)\n    except metadata.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run([str(python), "-c", script, *names], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def copy_checkout(target: Path) -> None:
    """This checkout's files (tracked, or untracked and not ignored) into ``target``: pip builds there, not here."""
    files = subprocess.run(LS_FILES, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def losses(run_dir: Path) -> list[float]:
    """The training losses a run's CSVLogger wrote, in step order."""
    values = []
    for metrics in sorted(run_dir.rglob("metrics.csv")):
        with metrics.open() as handle:
            values += [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    return values


def check(pins: dict[str, tuple[str, str]], args: argparse.Namespace, work: Path, table: Table) -> None:
    """The checks, each a row of ``table``; stops at the first that leaves nothing to check after it."""
    log = work / "check_versions.log"
    venv = Path(args.venv) if args.venv else work / "venv"
    python = venv / "bin" / "python"
    torch_pin = pins["torch"][0]
    status, output, seconds = run([args.python, "-m", "venv", str(venv)], log, 300)
    if status == 0:
        status, output, more = run(pip(python, "install", "--quiet", "--upgrade", "pip"), log, 600)
        seconds += more
    if not table.add("virtual environment", status == 0, seconds, str(venv) if status == 0 else last_lines(output)):
        return
    if not args.allow_cuda:
        cuda, chosen = cuda_packages(python, torch_pin, log)
        if cuda is None or cuda:
            why = chosen if cuda is None else f"{chosen} brings {', '.join(cuda[:3])}...: --allow-cuda installs it"
            table.add(f"{torch_pin}, alone", False, None, f"not installed: {why}")
            return
    status, output, seconds = run(pip(python, "install", "--quiet", torch_pin), log, 1800)
    torch_version = installed(python, ["torch"])["torch"] if status == 0 else None
    if not table.add(f"{torch_pin}, alone", status == 0, seconds, torch_version or last_lines(output)):
        return
    source = work / "source"
    copy_checkout(source)
    constraints = work / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, (_, version) in pins.items()))
    requested = [pin for name, (pin, _) in pins.items() if name != "torch"]
    install = pip(python, "install", "--quiet", "-c", str(constraints), f"{source}[dev]", *requested)
    status, output, seconds = run(install, log, 3600)
    versions = installed(python, list(pins)) if status == 0 else {}
    wrong = [f"{name} {versions.get(name)} (pinned {version})" for name, (_, version) in pins.items()
             if versions.get(name) is None or versions[name].split("+")[0] != version]  # fmt: skip
    detail = ", ".join(f"{name} {versions[name]}" for name in pins) if status == 0 and not wrong else None
    if not table.add("the project, with the pins", status == 0 and not wrong, seconds,
                     detail or "; ".join(wrong) or last_lines(output)):  # fmt: skip
        return
    env = {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        # One folder of DeepSpeed ops per version set, apart from every other install's.
        "TORCH_EXTENSIONS_DIR": str(
            Path.home() / ".cache" / "torch_extensions" / f"check-versions-{set_key(pins, args.python)}"
        ),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTHONPATH", None)
    run_dir = work / "run"
    fit = [str(venv / "bin" / "lightning-dos"), "fit", "--config", "recipes/gpt-tiny.yaml",
           "--trainer.max_steps", str(args.steps), "--trainer.default_root_dir", str(run_dir)]  # fmt: skip
    status, output, seconds = run(fit, log, args.timeout, cwd=source, env=env)
    loss = losses(run_dir)
    learned = len(loss) >= 2 and all(math.isfinite(v) for v in loss) and loss[-1] < loss[0]
    detail = f"loss {loss[0]:.2f} -> {loss[-1]:.2f}" if len(loss) >= 2 else last_lines(output)
    main_job = table.add(f"main job, {args.steps} steps", status == 0 and learned, seconds,
                         detail if status == 0 else last_lines(output))  # fmt: skip
    if main_job:
        png = work / "report.png"
        report = [str(venv / "bin" / "lightning-dos"), "report", str(run_dir), "--out", str(png)]
        status, output, seconds = run(report, log, 600, cwd=source, env=env)
        table.add("lightning-dos report", status == 0 and png.is_file(), seconds,
                  png.name if status == 0 else last_lines(output))  # fmt: skip
    else:
        table.add("lightning-dos report", None, None, "no run to draw")
    # Native tracebacks: pytest's own re-parse the failing source, which can fail itself (and end the run).
    tests = [str(python), "-m", "pytest", "-q", "-rfEs", "--tb=native", "-p", "no:cacheprovider", "-p", "no:xdist"]
    status, output, seconds = run([*tests, *args.tests], log, args.timeout, cwd=source, env=env)
    counts = re.compile(r"^=* ?\d+ (passed|failed|skipped|error)")
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if counts.match(line)), None)
    failed = [line.split(" - ")[0] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    table.add("exactness tests", status == 0, seconds, "; ".join([summary or last_lines(output), *failed[:5]]))


def set_key(pins: dict[str, tuple[str, str]], python: str) -> str:
    """A short name for a version set under one Python."""
    text = " ".join(sorted(f"{name}=={version}" for name, (_, version) in pins.items())) + f" {python}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_versions.py",
        description="Install the project with one set of dependency versions in a fresh virtual environment, run "
        "the README's main job briefly and the exactness tests, and print what passed.",
    )
    parser.add_argument("pins", nargs="+", help="NAME==VERSION for each version to check; torch is required")
    parser.add_argument("--steps", type=int, default=30, help="steps of the main job (default 30)")
    parser.add_argument("--tests", nargs="+", default=list(EXACTNESS_TESTS), help="pytest arguments of the tests")
    parser.add_argument("--python", default=sys.executable, help="the Python to make the environment with")
    parser.add_argument("--venv", default=None, help="make (or reuse) the environment here and keep it")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (log, run, environment)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each run may take (default 1800)")
    parser.add_argument("--allow-cuda", action="store_true", help="install torch even if it brings CUDA packages")
    args = parser.parse_args(argv)
    try:
        pins = parse_pins(args.pins)
    except ValueError as error:
        parser.error(str(error))
    work = Path(tempfile.mkdtemp(prefix="lightning-dos-check-versions-"))
    (work / "source").mkdir()
    table = Table()
    try:
        check(pins, args, work, table)
    finally:
        python = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True)
        print(f"\n{' '.join(args.pins)} (Python {python.stdout.decode().strip()}; log {work / 'check_versions.log'})\n")
        print(table.markdown())
        if not args.keep:  # the log stays
            for folder in ("venv", "source", "run"):
                shutil.rmtree(work / folder, ignore_errors=True)
    return 0 if table.passed else 1


if __name__ == "__main__":
    sys.exit(main())
