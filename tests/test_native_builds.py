"""engine/host_adam.c built for every CPU a node may have: x86-64-v2 (SSE4.2, no FMA), x86-64-v3 (AVX2),
x86-64-v4 (AVX-512) and aarch64 (NEON, and SVE2 as on Grace). GCC's vectorization report must show the element
loop (each of its variants) and the casts vectorized on each; every build this machine can run computes torch's
fused formula bit for bit: the x86 levels this CPU has in this process, the aarch64 builds under qemu-user.

The aarch64 checks need Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user-static`` (or ``qemu-user``);
``scripts/cross-tools.sh`` installs them (CI runs it; it is best-effort), and without them these tests are
skipped by name."""

from __future__ import annotations

import platform
import re
import shutil
import struct
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

from bench import kernels as bench_kernels
from lightning_dos.engine import native
from lightning_dos.model.update_rules import RULES
from tests import test_native_rules as rules_test
from tests.helpers import built_once, remember_build
from tests.test_native_kernel import (
    HYPERS,
    LP_DTYPES,
    SCALES,
    assert_bit_identical_to_torch,
    kernel_result,
    needs_torch_vector_path,
    torch_reference,
)

HARNESS = Path(__file__).with_name("host_adam_main.c")
#: The markers in host_adam.c naming the loops that must be vectorized.
MARKER = re.compile(r"/\* vectorized: (.+?) \*/")
REPORT_LINE = re.compile(r"host_adam\.c:(\d+):\d+: (optimized|missed): (.*)")
CASTS = ("bf16 cast", "fp16 cast")
#: Each rule's element loop, with its count of variants: one per storage (fp32, bf16 master weights, all bf16)
#: and combination of loop-invariant choices (Adam: unscale, decoupled decay, lerp's form; Adagrad and Lion:
#: unscale, decay; Lion also DeepSpeed's two formulas, its vector body's and its scalar loop's), each in place and
#: out of place (a speculative update).
LOOPS = {"adam loop": 3 * 8 * 2, "adagrad loop": 3 * 4 * 2, "lion loop": 3 * 4 * 2 * 2}
X86, ARM = "x86_64", "aarch64"
#: name: (architecture, flags, the vectors GCC 12 vectorizes with there)
TARGETS = {
    "x86-64-v2": (X86, ["-march=x86-64-v2"], "16 byte"),
    "x86-64-v3": (X86, ["-march=x86-64-v3"], "32 byte"),
    "x86-64-v4": (X86, ["-march=x86-64-v4"], "64 byte"),
    "armv8-a": (ARM, ["-march=armv8-a"], "16 byte"),  # NEON: every Arm server
    "armv9-a": (ARM, ["-march=armv9-a"], "variable length"),  # SVE2, as Grace (Neoverse V2) has
}
_LP_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@cache
def gcc_for(arch: str) -> str | None:
    """A GCC that builds for ``arch``: the system one on that machine, else Debian's cross compiler."""
    names = ["gcc"] if platform.machine() == arch else []
    names.append(f"{arch}-linux-gnu-gcc")
    for name in names:
        path = shutil.which(name)
        if (
            path
            and "Free Software Foundation" in subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        ):
            return path
    return None


def _compiler_or_skip(target: str) -> str:
    arch = TARGETS[target][0]
    compiler = gcc_for(arch)
    if compiler is None:
        package = "gcc" if arch == platform.machine() else f"gcc-{arch.replace('_', '-')}-linux-gnu"
        pytest.skip(f"no GCC for {arch} here (Debian's {package}; scripts/cross-tools.sh installs it)")
    accepted = subprocess.run([compiler, *TARGETS[target][1], "-x", "c", "-c", "-o", "/dev/null", "/dev/null"])
    if accepted.returncode != 0:
        pytest.skip(f"{compiler} does not accept {' '.join(TARGETS[target][1])}")
    return compiler


def marked_loops() -> dict[str, int]:
    """Each marked loop of host_adam.c by its marker, with its line number."""
    lines = native.SOURCE.read_text().splitlines()
    return {match.group(1): number for number, line in enumerate(lines, 1) if (match := MARKER.search(line))}


def vectorization_report(compiler: str, flags: list[str], tmp_path: Path) -> list[tuple[int, str, str]]:
    """(line, optimized or missed, message) for each of GCC's vectorizer remarks on host_adam.c, built as the
    engine builds it with ``flags`` added."""
    command = [compiler, *native.FLAGS, *flags, "-fopenmp", "-fopt-info-vec-all", "-o", str(tmp_path / "lib.so")]
    done = subprocess.run([*command, str(native.SOURCE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    remember_build(compiler, [*flags, "-fopenmp"], tmp_path / "lib.so")  # the remarks change no code: x86_builds
    return [(int(m.group(1)), m.group(2), m.group(3)) for m in map(REPORT_LINE.search, done.stderr.splitlines()) if m]


def test_the_markers_name_the_loops() -> None:
    assert set(marked_loops()) == {*LOOPS, *CASTS}, "host_adam.c marks each rule's element loop and its casts"


@pytest.mark.parametrize("target", TARGETS)
def test_the_element_loop_and_the_casts_are_vectorized(target: str, tmp_path: Path) -> None:
    """From GCC's report: each variant of each rule's element loop (every storage: the bf16 loads and rounded
    stores are integer arithmetic that vectorizes), and each cast, vectorized with the target's widest vectors,
    and no remark that a marked loop was left scalar. (Before issue 20 the Adam loop was
    one loop with the three tests inside, and GCC vectorized it only with AVX-512's or SVE's masks: "control flow in
    loop" for x86-64-v2, x86-64-v3 and armv8-a.)"""
    compiler = _compiler_or_skip(target)
    report = vectorization_report(compiler, TARGETS[target][1], tmp_path)
    vectors = f"loop vectorized using {TARGETS[target][2]} vectors"
    problems = []
    for name, line in marked_loops().items():
        remarks = [(kind, message) for number, kind, message in report if number == line]
        vectorized = [message for kind, message in remarks if kind == "optimized" and message.startswith(vectors)]
        missed = [message for kind, message in remarks if kind == "missed"]
        expected = LOOPS.get(name, 1)
        if missed or len(vectorized) < expected:
            problems.append(f"the {name} (line {line}): {len(vectorized)} of {expected} with {vectors}; {remarks}")
    assert not problems, f"{target}: " + "\n".join(problems)


@cache
def x86_levels_this_cpu_runs() -> frozenset[str]:
    """The x86-64 levels this CPU has, as GCC's own runtime check reads them."""
    compiler = gcc_for(X86)
    if compiler is None or platform.machine() != X86:
        return frozenset()
    levels = [name for name, (arch, _, _) in TARGETS.items() if arch == X86]
    probe = "#include <stdio.h>\nint main(void) {\n" + "".join(
        f'    if (__builtin_cpu_supports("{level}")) puts("{level}");\n' for level in levels
    )
    with tempfile.TemporaryDirectory() as directory:
        program = str(Path(directory) / "probe")
        subprocess.run([compiler, "-x", "c", "-o", program, "-"], input=probe + "}\n", text=True, check=True)
        return frozenset(subprocess.run([program], capture_output=True, text=True, check=True).stdout.split())


#: The x86 builds compared with torch: each level, and the fmaf of double arithmetic x86-64-v2 builds use, in a
#: build that also has FMA3 (so the two fmafs meet on the same elements).
X86_BUILDS = {
    "x86-64-v2": ("x86-64-v2", []),
    "x86-64-v3": ("x86-64-v3", []),
    "x86-64-v4": ("x86-64-v4", []),
    "x86-64-v3, fmaf by double": ("x86-64-v3", ["-DDOS_FMA_BY_DOUBLE"]),
}


@pytest.fixture(scope="module")
def x86_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, native.HostUpdateKernel]:
    builds, directory = {}, tmp_path_factory.mktemp("x86")
    for name, (level, defines) in X86_BUILDS.items():
        if level in x86_levels_this_cpu_runs():
            library = built_once(gcc_for(X86), [*TARGETS[level][1], "-fopenmp", *defines], directory)
            builds[name] = native.HostUpdateKernel(library)
    return builds


@needs_torch_vector_path
@pytest.mark.parametrize("build", X86_BUILDS)
def test_every_x86_build_this_cpu_runs_is_bit_identical_to_torch(
    build: str, x86_builds: dict[str, native.HostUpdateKernel]
) -> None:
    """Every hyperparameter set (each loop variant), scaled and not, into bf16, fp16 and fp32: torch's bits."""
    if build not in x86_builds:
        level = X86_BUILDS[build][0]
        pytest.skip(
            f"this CPU does not run {level} ({sorted(x86_levels_this_cpu_runs()) or 'no x86-64 levels'}); "
            f"test_the_element_loop_and_the_casts_are_vectorized[{level}] still checks its build"
        )
    for hyper_name, hyper in HYPERS.items():
        for scale_name, scale in SCALES.items():
            reference = torch_reference(hyper, scale)
            for lp_dtype in LP_DTYPES:
                result = kernel_result(x86_builds[build], hyper, scale, lp_dtype)
                assert_bit_identical_to_torch(result, reference, f"{build}, {hyper_name}, {scale_name}, {lp_dtype}")


@needs_torch_vector_path
@pytest.mark.parametrize("build", X86_BUILDS)
def test_every_x86_build_runs_every_rule_and_storage_as_the_reference(
    build: str, x86_builds: dict[str, native.HostUpdateKernel]
) -> None:
    """Every rule's loop variants (test_native_rules.CASES) in every storage, scaled into fp16 and unscaled into
    bf16, on two threads: the bits of the reference (test_native_rules.reference_step; Lion: DeepSpeed's formula
    as the build says DeepSpeed runs it on its CPU, its vector body's width and whether it fuses)."""
    if build not in x86_builds:
        pytest.skip(
            f"this CPU does not run {X86_BUILDS[build][0]}; "
            f"test_the_element_loop_and_the_casts_are_vectorized[{X86_BUILDS[build][0]}] still checks its build"
        )
    for case in rules_test.CASES:
        for storage in rules_test.STORAGES:
            for scale, lp_dtype in ((1.0, torch.bfloat16), (3.7 * 2.0**12, torch.float16)):
                form = x86_builds[build].lion_form(*rules_test.STORAGES[storage])
                reference = rules_test.run(case, storage, scale, lp_dtype, None, ours=False, lion_form=form)
                result = rules_test.run(case, storage, scale, lp_dtype, 2, ours=True, update=x86_builds[build].update)
                rules_test.assert_matches_reference(case, result, reference, f"{build}, {case}, {storage}, {lp_dtype}")


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


@pytest.fixture(scope="module")
def arm_programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """host_adam.c with tests/host_adam_main.c, statically linked for each aarch64 target, with its own threads
    (no OpenMP)."""
    compiler, qemu = gcc_for(ARM), _qemu()
    if platform.machine() != ARM and (compiler is None or qemu is None):
        pytest.skip(
            "running the aarch64 builds needs Debian's gcc-aarch64-linux-gnu and qemu-user-static (or qemu-user), "
            "not both installed here (scripts/cross-tools.sh installs them); "
            "test_the_element_loop_and_the_casts_are_vectorized[armv8-a] still checks the build where the "
            "compiler is"
        )
    flags = [flag for flag in native.FLAGS if flag not in ("-shared", "-fPIC")]
    programs = {}
    for name, (arch, target_flags, _) in TARGETS.items():
        if arch == ARM:
            program = tmp_path_factory.mktemp("arm") / name
            command = [compiler, *flags, *target_flags, "-static", "-o", str(program), str(native.SOURCE), str(HARNESS)]
            subprocess.run([*command, "-lm"], check=True, capture_output=True, timeout=300)
            programs[name] = program
    return programs


_RULE_IDS = {"adam": 0, "adagrad": 1, "lion": 2}
#: DeepSpeed's Lion on Arm (HostUpdateKernel.lion_form): no vector body (cpu_lion.h's is AVX only), its scalar loop
#: fused (every aarch64 CPU has FMA).
ARM_LION_FORM = (0, True)
_STORAGE_IDS = {"fp32": 0, "bf16-master": 1, "bf16": 2}


def run_arm(
    program: Path, case: str, storage: str, scale: float, lp_dtype: torch.dtype | None, tmp_path: Path
) -> list[torch.Tensor]:
    """param, the states and the copy after test_native_rules.STEPS of the aarch64 ``program`` (two threads),
    from test_native_rules' initial state and gradients."""
    rule, hyper = rules_test.CASES[case]
    numel = rules_test.NUMEL
    state = rules_test.initial_state(rule, storage)
    lp_kind = 0 if lp_dtype is None else _LP_KIND[lp_dtype]
    header = [_RULE_IDS[rule], _STORAGE_IDS[storage], lp_kind, 2, len(rules_test.STEPS), len(RULES[rule].states)]
    data = [struct.pack("=q6i", numel, *header), *(t.numpy().tobytes() if t.dtype == torch.float32
            else t.view(torch.int16).numpy().tobytes() for t in state)]  # fmt: skip
    for step, grad in zip(rules_test.STEPS, rules_test.gradients(storage, scale)):
        data.append(struct.pack("=f", 1 / scale) + bytes(native.step_scalars(rule, step, hyper)))
        data.append(grad.view(torch.int16 if grad.dtype == torch.bfloat16 else torch.int32).numpy().tobytes())
    (tmp_path / "in").write_bytes(b"".join(data))
    command = [str(program), str(tmp_path / "in"), str(tmp_path / "out")]
    if platform.machine() != ARM:
        command.insert(0, _qemu())
    subprocess.run(command, check=True, timeout=300)
    out, offset, result = (tmp_path / "out").read_bytes(), 0, []
    for t in [*state, *([] if lp_dtype is None else [torch.empty(0, dtype=lp_dtype)])]:
        size = numel * t.element_size()
        result.append(torch.frombuffer(bytearray(out[offset : offset + size]), dtype=t.dtype))
        offset += size
    assert offset == len(out)
    return result


@needs_torch_vector_path
@pytest.mark.parametrize("target", [name for name, (arch, _, _) in TARGETS.items() if arch == ARM])
def test_the_aarch64_builds_under_qemu_are_bit_identical_to_torch_and_to_this_machines_build(
    target: str, arm_programs: dict[str, Path], tmp_path: Path
) -> None:
    """Every rule's loop variants in every storage, scaled and not, into each copy dtype in turn: the reference's
    bits (test_native_rules.reference_step; Adam on torch's vector body; Lion as DeepSpeed runs it on Arm: its
    scalar loop throughout, fused), and the bits of the engine's build on this machine on every element (Lion: where
    this machine's DeepSpeed runs the same formula, as it does without a vector body for the storage)."""
    if not native.available():
        pytest.skip(f"the compiled kernel is unavailable here ({native.unavailable_reason()}) to compare with")
    copies = [None, torch.bfloat16, torch.float16, torch.float32]
    turn = 0
    for case in rules_test.CASES:
        for storage in rules_test.STORAGES:
            for scale_name, scale in SCALES.items():
                lp_dtype = copies[turn % len(copies)]
                turn += 1
                what = f"{target}, {case}, {storage}, {scale_name}, {lp_dtype}"
                result = run_arm(arm_programs[target], case, storage, scale, lp_dtype, tmp_path)
                form = ARM_LION_FORM
                reference = rules_test.run(case, storage, scale, lp_dtype, None, ours=False, lion_form=form)
                rules_test.assert_matches_reference(case, result, reference, what)
                if rules_test.CASES[case][0] == "lion" and native.lion_form(*rules_test.STORAGES[storage]) != form:
                    continue
                here = rules_test.run(case, storage, scale, lp_dtype, 2, ours=True)
                for mine, theirs in zip(result, here):
                    assert torch.equal(rules_test.bits(mine), rules_test.bits(theirs)), f"{what}: this machine's"


@pytest.mark.skipif(not native.available(), reason="the compiled kernel is unavailable here: no rows to time")
def test_the_kernel_bench_builds_and_times_each_target(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/kernels.py --march`` builds each target and times it beside the engine's build, names the CPU's
    flags, and names a target left out (here one the compiler refuses) rather than failing."""
    runnable = sorted(x86_levels_this_cpu_runs())[:1]  # one level is enough to show a row per target built
    targets = [*runnable, "no-such-cpu"]
    argv = ["--numel", "40000", "--rounds", "1", "--threads", "1", "--march", ",".join(targets)]
    threads = torch.get_num_threads()
    assert bench_kernels.main(argv) == 0
    assert torch.get_num_threads() == threads, "the bench gives its caller's thread count back (tests run after)"
    printed = capsys.readouterr().out
    assert "CPU: " in printed and "flags: " in printed
    assert "-march=no-such-cpu: left out, the compiler refused it" in printed
    for row in ["compiled", "three-pass", "memcpy", *(f"compiled, {level}" for level in runnable)]:
        assert f"| {row} |" in printed, row
