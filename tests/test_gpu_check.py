"""The GPU checks themselves, on CPU: the delayed-stream harness on the simulated accelerator, the exactness
tests' probes of torch's rounding (a GPU machine runs its own torch), and scripts/gpu-check.sh's steps (the CUDA
tests cannot run here; they must collect and skip cleanly)."""

from __future__ import annotations

import ast
import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_dos.engine.loop as loop_module
from lightning_dos.engine import native
from lightning_dos.sim.sanitizer import StreamSanitizer
from tests import torch_probes
from tests.conftest import EXACTNESS_TESTS, probes_of, torch_skip
from tests.delayed_streams import run
from tests.test_stream_sanitizer import SYNC_MODULES, all_mutations, mutant_engine

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _harness(engine_class: type, lp_on_host: bool) -> tuple[list[str], list]:
    """tests/delayed_streams.py's steps at 64 elements per sub-group on the simulated accelerator, under the
    race checker with DeepSpeed's unsynchronised model (its gradient copies are not waited for at backward's end)."""
    checker = StreamSanitizer()
    outcome = run(
        engine_class,
        lp_on_host=lp_on_host,
        sub_group=64,
        streams=checker.streams(),
        watch=lambda engine: checker.watch(engine, backward_sync=False),
    )
    return outcome.errors, checker.races


@pytest.mark.parametrize("lp_on_host", [False, True], ids=["16-bit on the device", "parameter offload"])
def test_delayed_stream_harness_equals_adamw_and_is_race_free_on_the_simulated_accelerator(lp_on_host: bool) -> None:
    errors, races = _harness(loop_module.InterleavedUpdate, lp_on_host)
    assert errors == [] and races == []


def test_the_delayed_stream_harness_reaches_every_synchronisation_of_the_engine() -> None:
    """Its plans put each wait, host wait and tail event of the engine's modules to use: removing any one is a race
    in one of its runs. On a GPU the sleeping stream turns that race into a wrong result (tests/test_gpu.py)."""
    # The harness runs without overlap; the overlap's own waits (the next forward's, in wait_sub_groups; backward's
    # gradient copies and 16-bit uploads, a speculative update's commit) are the race checker's mutation test's to
    # cover (tests/test_stream_sanitizer.py runs its scenarios overlapped and speculated too).
    overlap_functions = {"wait_sub_groups", "update_during_backward", "_commit"}
    overlap_only, found = {}, set()
    for module in SYNC_MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef) and node.name in overlap_functions:
                overlap_only.setdefault(module, []).append(range(node.lineno, node.end_lineno + 1))
                found.add(node.name)
    assert found == overlap_functions, "the engine renamed an overlap function: update this test"
    mutations = [
        (module, line, what)
        for module, line, what in all_mutations()
        if not any(line in r for r in overlap_only.get(module, ()))
    ]
    assert len(mutations) >= 9
    unreached = []
    for module, line, what in mutations:
        engine_class = mutant_engine(line, module)
        if not any(_harness(engine_class, lp_on_host)[1] for lp_on_host in (False, True)):
            unreached.append(what)
    assert not unreached, f"the harness never needs these: {unreached}"


def test_exactness_tests_skip_only_where_a_probe_finds_torch_rounding_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, by_path in EXACTNESS_TESTS.items():
        module, name = key.split("::")
        assert f"def {name}(" in (ROOT / "tests" / module).read_text(), f"{key} names no test"
        assert all(probe in torch_probes.PROBES for probes in by_path.values() for probe in probes), key
    fused = "tests/test_kernels.py::test_fused_update_is_bit_identical_to_three_passes[engine-x]"
    assert probes_of(fused, {"path": "engine"}) == ("engine",) and probes_of(fused, {"path": "tiles"}) == ("tiles",)
    assert probes_of("tests/test_planner.py::test_unknown_profile_is_refused", {}) == ()
    # No version string decides: a torch whose fused AdamW rounds one element otherwise is caught by the probes,
    # and the skip says what they found.
    kernel = torch._fused_adamw_

    def rounds_otherwise(params, *args, **kwargs) -> None:  # noqa: ANN001
        kernel(params, *args, **kwargs)
        for param in params:
            param[20] = torch.nextafter(param[20], torch.tensor(math.inf))

    monkeypatch.setattr(torch, "_fused_adamw_", rounds_otherwise)
    found = torch_probes.tiles()
    assert found is not None and "tiles of 64" in found and "param[84]" in found, found  # element 20 of tile 2
    if native.available():
        assert "param[20]" in (torch_probes.compiled() or "")
    monkeypatch.setattr(torch_probes, "result", lambda name: torch_probes.PROBES[name][1]())  # uncached
    reason = torch_skip(fused, {"path": "tiles"})
    assert reason is not None and f"torch {torch.__version__}" in reason and "probe 'tiles' found" in reason, reason
    monkeypatch.undo()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # torch's vector path, as on CI's CPU
        failing = {name: torch_probes.result(name) for name in torch_probes.PROBES if torch_probes.result(name)}
        assert failing == {}, "this torch rounds as the exactness tests assume: nothing may skip here"


def test_gpu_check_script_parses_and_says_so_without_a_gpu() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu-check.sh would run its steps (the GPU machine runs it)")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "no CUDA GPU visible" in done.stdout


def test_gpu_check_cpu_parts_cover_every_test_file_once() -> None:
    parts = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^all_steps=/,/^}}/p" {SCRIPT}); for p in 1 2 3; do cpu_files $p; done'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    expected = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_gpu.py")
    assert sorted(parts) == expected


def test_the_cuda_tests_collect_and_skip_cleanly_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA pass runs them")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " skipped" in done.stdout and "passed" not in done.stdout and "error" not in done.stdout.lower()


def test_the_threads_step_runs_a_job_that_compiles_with_both_of_its_checks() -> None:
    """``gpu-check.sh threads`` cannot run here; its job must at least compile and name the checks the step runs."""
    script = SCRIPT.read_text()
    job = ROOT / "tests" / "jobs" / "gpu_threads.py"
    assert "tests/jobs/gpu_threads.py" in script and "for part in binding budget" in script
    source = job.read_text()
    compile(source, str(job), "exec")
    assert 'check_binding() if what == "binding" else check_budget()' in source


def test_the_peers_step_runs_bench_command_lines_that_parse_and_name_a_strategy_for_every_system() -> None:
    """``gpu-check.sh peers`` cannot run here: its bench/run.py command lines (clip off and 1.0) must parse, with
    exactness against stock, and each of its systems must make a strategy."""
    import re
    import shlex

    from bench.run import make_strategy, parse_args

    script = SCRIPT.read_text()
    assert " peers)" in script and "forward-peak peers)" in script  # a step, listed among all_steps
    systems = re.search(r"^peer_systems=(\S+)$", script, re.M).group(1)
    command = re.search(r"bench/run\.py (--preset 1b \\\n.*?)--out", script, re.S).group(1)
    argv = shlex.split(command.replace("\\\n", " ").replace('"$peer_systems"', systems))
    assert argv[-2:] == ["--systems", systems] and "${clip_arg[@]}" in argv
    argv.remove("${clip_arg[@]}")
    for clip in ([], ["--clip", "1.0"]):
        args = parse_args([*argv, *clip, "--out", "/tmp/peers.json"])
        assert (
            args.exactness and args.isolate and args.shape[:3] == (24, 2048, 16) and args.clip == (clip and 1.0 or None)
        )
    names = systems.split(",")
    assert {"stock", "auto", "fsdp-offload"} <= set(names) and any(n.startswith("superoffload:") for n in names)
    assert any(n.startswith("zenflow:") for n in names) and any(n.startswith("twinflow:") for n in names)
    for name in names:
        assert make_strategy(name, 1000)[0] is not None, name


def test_the_capture_is_the_first_step_and_its_options_are_checked_before_anything_runs() -> None:
    """``gpu-check.sh capture`` (run on CPU by tests/test_fit.py): first among every step, and a bad option is refused
    at once, saying what is valid, before any measurement (or the no-GPU exit)."""
    import re

    assert re.search(r"^all_steps=\(capture ", SCRIPT.read_text(), re.M)
    for argv, says in (
        (["--accelerator", "tpu"], "--accelerator takes cuda or cpu, got 'tpu'"),
        (["--accelerator", "cpu", "cuda-tests"], "with --accelerator cpu only the capture runs, not 'cuda-tests'"),
        (["capture", "--bogus"], "unknown option '--bogus'; the capture takes --out, --accelerator"),
        (["capture", "--out"], "--out takes a value"),
    ):
        done = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, check=False)
        assert done.returncode == 2 and says in done.stderr, (argv, done.stderr)
