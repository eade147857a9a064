"""The compiled one-pass host update (engine/host_adam.c): torch's formula bit for bit, whatever the split,
the thread count, the instruction set or the build; the fallback and its warning without a compiler."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_dos.engine import native
from lightning_dos.engine.kernels import Hyper, SubGroupTensors, UpdateStep, host_update, step_tensor, tiled_update
from lightning_dos.model.update_rules import ADAM, RULES
from tests.helpers import built_once

ADAMW = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
HYPERS = {
    "adamw": ADAMW,
    "adam-l2": Hyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01, decoupled=False),
    "no-decay": Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True),
    "lerp-second-form": Hyper(lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=True),
    "adam-l2-lerp-second-form": Hyper(lr=2e-3, beta1=0.2, beta2=0.9, eps=1e-7, weight_decay=0.02, decoupled=False),
}
LP_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: With the hyperparameters above, every combination of the kernel's three loop-invariant choices (unscale,
#: decoupled decay, lerp's form): each is a loop of its own in host_adam.c.
SCALES = {"unscaled": 1.0, "scaled": 3.7 * 2.0**12}
#: Elements of the torch comparisons: torch's vector path runs all but the last NUMEL % 16, its scalar remainder
#: (which the kernel reproduces too: host_adam.c, adam_scalar_from) the rest.
NUMEL = 4096 + 16 * 7 + 5
STEPS = (1, 2, 3)

needs_compiler = pytest.mark.skipif(
    not native.available(),
    reason=f"the compiled kernel is unavailable here ({native.unavailable_reason()}); "
    "test_without_a_compiler_the_engine_warns_once_and_uses_torchs_kernels covers the fallback",
)


def _state(numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(numel, generator=gen) for _ in range(3))
    return [param, grad, exp_avg, torch.rand(numel, generator=gen)]


def _edge_values(numel: int) -> list[torch.Tensor]:
    """Random state whose updated weights include fp16 overflow, fp16 subnormals, bf16 rounding ties and zero:
    each cast's special cases, on the vector path and the scalar remainder alike."""
    state = _state(numel, seed=numel)
    param = state[0]
    param[::7] *= 7e4  # past fp16's largest finite value
    param[1::7] *= 3e-6  # fp16 subnormals
    param[2::7] = torch.tensor(1.0 + 2.0**-8).expand_as(param[2::7])  # a bf16 tie (rounds to even)
    param[3::11] = 0.0
    return state


def _native_step(state, hyper, step, scale, lp, kernel=None, threads=None):  # noqa: ANN001, ANN202
    """One Adam step of the compiled kernel on ``state`` (param, grad, exp_avg, exp_avg_sq): through torch's
    dispatcher (:func:`native.host_update`), or ``kernel``'s build (a :class:`native.HostUpdateKernel`)."""
    update = native.host_update if kernel is None else kernel.update
    update("adam", state[0], state[1], state[2:4], step, hyper, 1 / scale, lp, threads)


def initial_state() -> list[torch.Tensor]:
    """param, gradient (overwritten by each step's), exp_avg, exp_avg_sq of the torch comparisons."""
    return _state(NUMEL, seed=1)


def gradients(scale: float) -> list[torch.Tensor]:
    """Each step's gradient, multiplied by the loss scale ``scale``."""
    return [_state(NUMEL, seed=10 + step)[1].mul_(scale) for step in STEPS]


def torch_reference(hyper: Hyper, scale: float) -> list[torch.Tensor]:
    """param, exp_avg and exp_avg_sq after :data:`STEPS` from :func:`initial_state`: the gradient unscaled by
    torch, then torch's fused Adam on one thread (its vector path, and its scalar remainder on the last NUMEL % 16)."""
    ref = initial_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step, grad in zip(STEPS, gradients(scale)):
            unscaled = grad.mul_(1 / scale)
            ADAM.torch_update(ref[0], unscaled, (ref[2], ref[3]), step_tensor(step, torch.device("cpu")), hyper)
    finally:
        torch.set_num_threads(threads)
    return [ref[0], ref[2], ref[3]]


def kernel_result(kernel, hyper: Hyper, scale: float, lp_dtype: torch.dtype) -> list[torch.Tensor]:  # noqa: ANN001
    """param, exp_avg, exp_avg_sq and the cast copy after :data:`STEPS` of ``kernel`` (a build; None: the engine's,
    through torch's dispatcher), checking that the gradient is read and never written."""
    state, lp = initial_state(), torch.empty(NUMEL, dtype=lp_dtype)
    for step, grad in zip(STEPS, gradients(scale)):
        state[1].copy_(grad)
        _native_step(state, hyper, step, scale, lp, kernel=kernel)
        assert torch.equal(state[1], grad), "the gradient is read, not written"
    return [state[0], state[2], state[3], lp]


def assert_bit_identical_to_torch(result: list[torch.Tensor], reference: list[torch.Tensor], what: str) -> None:
    """``result`` (param, moments, copy) is torch's bit for bit on every element (torch's vector body and its
    scalar remainder), and the copy is ``param.to(dtype)`` exactly."""
    for name, mine, theirs in zip(("param", "exp_avg", "exp_avg_sq"), result, reference):
        assert torch.equal(mine, theirs), f"{what}: {name}"
    assert torch.equal(result[3], result[0].to(result[3].dtype)), f"{what}: the copy casts as torch casts"


#: torch's vector path: elsewhere torch runs its generic kernels, which round differently.
needs_torch_vector_path = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch runs its generic (non-SIMD) CPU kernels here, which round differently from its vector path; "
    "test_the_result_does_not_depend_on_threads_or_where_a_sub_group_is_cut and "
    "test_every_instruction_set_and_build_gives_the_same_bits still check the kernel against itself",
)


@needs_compiler
@needs_torch_vector_path
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("lp_dtype", LP_DTYPES)
@pytest.mark.parametrize("hyper", HYPERS)
def test_bit_identical_to_torchs_fused_adam_then_cast(hyper: str, lp_dtype: torch.dtype, scale: str) -> None:
    """Three steps from the same state: every element is torch's bit for bit, on torch's vector path (all but the
    last numel % 16) and in its scalar remainder (the last 5 here), the 16-bit copy is ``param.to(dtype)``
    exactly, and the gradient is left as it came; with and without an unscale, Adam and AdamW, both forms of
    torch's lerp."""
    result = kernel_result(None, HYPERS[hyper], SCALES[scale], lp_dtype)
    assert_bit_identical_to_torch(result, torch_reference(HYPERS[hyper], SCALES[scale]), "the engine's build")


@needs_compiler
@pytest.mark.parametrize("lp_dtype", LP_DTYPES)
def test_the_result_does_not_depend_on_threads_or_where_a_sub_group_is_cut(lp_dtype: torch.dtype) -> None:
    """Every element is computed by the same statements, so 1, 2, 3 or 7 threads, or the tensor cut into pieces
    that start anywhere (5 elements past a cache line here; threads start on cache lines), give the same bits. The
    pieces are whole multiples of 16 elements but the last: torch's scalar remainder (which the kernel reproduces)
    is a call's last numel % 16, and the engine cuts DeepSpeed's flat partitions at multiples of 64 elements."""
    numel = 3 * native.MIN_ELEMENTS_PER_THREAD + 4099  # large enough that several threads really run
    results = []
    for threads, cuts in ((1, []), (2, []), (3, []), (7, []), (1, [16, 1008, 70_016, 200_000])):
        state, lp = _edge_values(numel), torch.empty(numel + 5, dtype=lp_dtype)[5:]
        if cuts:  # the same values, 5 elements past the start of each buffer (20 or 10 bytes off a cache line)
            state = [torch.empty(numel + 5, dtype=t.dtype)[5:].copy_(t) for t in state]
        bounds = [0, *cuts, numel]
        for begin, end in zip(bounds, bounds[1:]):
            piece = [t[begin:end] for t in state]
            _native_step(piece, ADAMW, 2, 2.0**8, lp[begin:end], threads=threads)
        results.append([*state, lp])
    for other in results[1:]:
        for mine, theirs in zip(other, results[0]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the builds compared are x86-64 levels")
def test_every_instruction_set_and_build_gives_the_same_bits(tmp_path: Path) -> None:
    """The library for this CPU, for plain x86-64 (SSE2, fmaf by double arithmetic, most loops scalar), for
    x86-64-v3 (AVX2, FMA: the streaming casts), without OpenMP (its own threads), and with fmaf by double
    arithmetic in an x86-64-v3 build (which has FMA) all compute the same bits: the same as the cached build the
    engine runs. (test_native_builds.py compares each x86-64 level and aarch64 with torch; the builds both files
    load are built once, :func:`built_once`.)"""
    compiler = native._compiler()
    builds = {"engine's": native._load()}
    for name, flags in {
        "x86-64": ["-march=x86-64"],
        "x86-64-v3": ["-march=x86-64-v3", "-fopenmp"],
        "no OpenMP": ["-march=native"],
        "fmaf by double": ["-march=x86-64-v3", "-fopenmp", "-DDOS_FMA_BY_DOUBLE"],  # as test_native_builds builds it
    }.items():
        builds[name] = native.HostUpdateKernel(built_once(compiler, flags, tmp_path))
    numel = 2 * native.MIN_ELEMENTS_PER_THREAD + 1037
    for lp_dtype in LP_DTYPES:
        outputs = {}
        for name, kernel in builds.items():
            state, lp = _edge_values(numel), torch.empty(numel, dtype=lp_dtype)
            for step in (1, 2):
                _native_step(state, ADAMW, step, 3.7 * 2.0**12, lp, kernel=kernel, threads=2)
            outputs[name] = [*state, lp]
        for name, result in outputs.items():
            for mine, theirs in zip(result, outputs["engine's"]):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=f"{name}, {lp_dtype}")
        assert torch.equal(outputs["engine's"][4], outputs["engine's"][0].to(lp_dtype)), "casts as torch casts"


@needs_compiler
def test_the_engine_host_path_is_the_compiled_kernel_and_agrees_with_torchs_tiles() -> None:
    """``host_update`` runs the compiled kernel, and one thread of torch's tiles (of 1024 elements: torch's scalar
    remainder is the last tile's, as the kernel's is the call's) gives the same bits on every element; both leave
    the gradient as it came (a speculative update is redone from it)."""
    numel, scale = 5000, 2.0**10
    ours, theirs = _state(numel, seed=4), _state(numel, seed=4)
    grad = ours[1].clone()
    lp_ours, lp_theirs = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    step = step_tensor(1, torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        update_step = UpdateStep(step, ADAMW, 1 / scale)
        host_update(ADAM, SubGroupTensors(ours[0], ours[1], ours[2:], lp_ours), update_step)
        tiled_update(ADAM, SubGroupTensors(theirs[0], theirs[1], theirs[2:], lp_theirs), update_step, tile=1024)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ours[1], grad) and torch.equal(theirs[1], grad)
    for mine, other in zip([ours[0], *ours[2:], lp_ours], [theirs[0], *theirs[2:], lp_theirs]):
        assert torch.equal(mine, other)


@needs_compiler
def test_bad_tensors_are_refused_before_anything_changes() -> None:
    param, grad, exp_avg, exp_avg_sq = _state(64, seed=0)
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]

    def adam(grad: torch.Tensor, lp_out: torch.Tensor | None = None) -> None:
        native.host_update("adam", param, grad, (exp_avg, exp_avg_sq), 1, ADAMW, lp_out=lp_out)

    with pytest.raises(ValueError, match="they must be one dtype"):
        adam(grad.double())
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        adam(torch.randn(128)[::2])
    with pytest.raises(ValueError, match="lp_out"):
        adam(grad, lp_out=torch.empty(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lp_out"):
        adam(grad, lp_out=torch.empty(64, dtype=torch.int16))
    for now, then in zip((param, exp_avg, exp_avg_sq), before):
        assert torch.equal(now, then)


@needs_compiler
def test_the_library_is_built_once_and_found_again(tmp_path: Path) -> None:
    """A second process finds the cached library (same path, not rebuilt); a fresh cache builds it in seconds."""
    script = textwrap.dedent(
        """
        import time
        from lightning_dos.engine import native
        start = time.perf_counter()
        path = native.build()
        print(path, path.stat().st_mtime_ns, round(time.perf_counter() - start, 2))
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    path, mtime, seconds = first.stdout.split()
    # 27 s on this project's 2-core machine alone; more beside the other test worker's tests (scripts/test.sh).
    assert Path(path).is_relative_to(tmp_path) and float(seconds) < 180
    assert second.stdout.split()[:2] == [path, mtime], "found, not rebuilt"
    # The build says what it is before it starts (a first run is otherwise silent for its length); finding it, nothing.
    assert first.stderr.startswith("lightning-dos: building the host update kernel (host_adam.c)"), first.stderr
    assert all(len(line) <= 80 for line in first.stderr.splitlines()) and "lightning-dos" not in second.stderr
    assert not list(Path(path).parent.glob("*.tmp")), "no partial library left behind"


def test_without_a_compiler_the_engine_warns_once_and_uses_torchs_kernels(tmp_path: Path) -> None:
    """No compiler on the machine (here: $CC names one that does not exist, and nothing is cached): the
    engine warns once, with what to do, and its host and device updates use torch's kernels, which give the
    three-pass result. LIGHTNING_DOS_NATIVE=0 does the same without the warning."""
    script = textwrap.dedent(
        """
        import warnings, torch
        from lightning_dos.engine import native
        from lightning_dos.engine.kernels import Hyper, SubGroupTensors, UpdateStep, host_update, step_tensor
        from lightning_dos.model.update_rules import ADAM
        from lightning_dos.engine.loop import InterleavedUpdate
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            InterleavedUpdate([300], [0], 64, torch.device("cpu"), torch.bfloat16)
            InterleavedUpdate([300], [0], 64, torch.device("cpu"), torch.bfloat16)
        print("warnings:", len(caught))
        for w in caught:
            print(w.message)
        print("available:", native.available(), "reason:", native.unavailable_reason())
        torch.set_num_threads(1)
        h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
        gen = torch.Generator().manual_seed(0)
        ours = [torch.randn(999, generator=gen) for _ in range(4)]
        ours[3].abs_()
        ref = [t.clone() for t in ours]
        lp = torch.empty(999, dtype=torch.bfloat16)
        step = step_tensor(1, torch.device("cpu"))
        host_update(ADAM, SubGroupTensors(ours[0], ours[1], ours[2:], lp), UpdateStep(step, h, 0.25))
        grad = ref[1].clone()
        ref[1].mul_(0.25)
        ADAM.torch_update(ref[0], ref[1], ref[2:], step, h)
        same = all(torch.equal(a, b) for a, b in zip([ours[0], *ours[2:]], [ref[0], *ref[2:]]))
        same = same and torch.equal(lp, ref[0].bfloat16()) and torch.equal(ours[1], grad)  # the gradient as it came
        print("three-pass result:", same)
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": "no-such-compiler-dos"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    out = done.stdout
    assert "warnings: 1" in out, out
    assert "no C compiler found" in out and "Install a C compiler" in out and "LIGHTNING_DOS_NATIVE=0" in out
    assert "available: False" in out and "three-pass result: True" in out
    env["LIGHTNING_DOS_NATIVE"] = "0"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert "warnings: 0" in done.stdout and "reason: LIGHTNING_DOS_NATIVE=0" in done.stdout
    assert "three-pass result: True" in done.stdout


def test_a_compiler_that_fails_is_reported_with_its_output(tmp_path: Path) -> None:
    """A compiler that runs but cannot build (here: one that always fails) leaves the engine on torch's kernels
    with the command and the compiler's own message in the reason."""
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'failing-cc: cannot compile' >&2\nexit 1\n")
    failing.chmod(0o755)
    script = "from lightning_dos.engine import native; print(native.available()); print(native.unavailable_reason())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": str(failing)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.startswith("False") and "could not build host_adam.c" in done.stdout
    assert "failing-cc: cannot compile" in done.stdout and "-march=native" in done.stdout
    assert shutil.which("sh"), "the stand-in compiler is a shell script"


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("rule", ["adam", "adagrad", "lion"])
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "bf16-master", "bf16"],
)
def test_an_update_out_of_place_writes_what_one_in_place_writes_and_only_reads_its_input(
    kernel: str, rule: str, dtypes: tuple[torch.dtype, torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative update writes its result elsewhere (``out``): the same bits as the update in place, 16-bit
    copy included, and the master weights and states it read are left as they were (the compiled kernel's out-of-
    place loops; torch's path copies first). An odd size takes every thread's share and the scalar tail."""
    if kernel == "compiled" and not native.available():
        pytest.skip(f"the compiled kernel is unavailable here ({native.unavailable_reason()}); torch's case runs")
    if kernel == "torch":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    master_dtype, state_dtype = dtypes
    update_rule = RULES[rule]
    numel = 3 * (1 << 14) + 77
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(numel, generator=gen).to(master_dtype)
    grad = torch.randn(numel, generator=gen).to(master_dtype)
    states = [torch.rand(numel, generator=gen).to(state_dtype) for _ in update_rule.states]
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 0.0)
    step = step_tensor(4, torch.device("cpu"))
    in_place = (param.clone(), [s.clone() for s in states], torch.empty(numel, dtype=torch.bfloat16))
    update_step = UpdateStep(step, hyper, 0.25)
    host_update(update_rule, SubGroupTensors(in_place[0], grad, in_place[1], in_place[2]), update_step)
    source = (param.clone(), [s.clone() for s in states])
    out = (torch.full_like(param, float("nan")), [torch.full_like(s, float("nan")) for s in states])
    lp = torch.empty(numel, dtype=torch.bfloat16)
    host_update(update_rule, SubGroupTensors(source[0], grad, source[1], lp), update_step, out=out)
    assert torch.equal(out[0], in_place[0]) and torch.equal(lp, in_place[2])
    assert all(torch.equal(a, b) for a, b in zip(out[1], in_place[1], strict=True))
    assert torch.equal(source[0], param) and all(torch.equal(a, b) for a, b in zip(source[1], states, strict=True))
