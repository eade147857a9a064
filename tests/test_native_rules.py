"""The compiled host kernel for every rule (Adam, Adagrad, Lion) and every storage it takes (fp32; bf16 master
weights and gradient with fp32 states; all bf16): the rule's torch formula (``UpdateRule.torch_update``; Lion:
DeepSpeed's ``DeepSpeedCPULion``, checked against DeepSpeed's op itself) bit for bit, computed in fp32 from the
16-bit values and rounded back, with the unscale and the cast in the same pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dos.engine import native
from lightning_dos.model.update_rules import RULES, Hyper

#: Each rule with each of its loop-invariant choices (every loop of host_adam.c is one of these with one storage,
#: unscaled or not): Adam and AdamW with both forms of torch's lerp, Adagrad with and without an L2 term and an lr
#: decay, Lion with and without decay.
CASES = {
    "adamw": ("adam", Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)),
    "adam-l2": ("adam", Hyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01, decoupled=False)),
    "adam-no-decay": ("adam", Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)),
    "adamw-lerp-second-form": ("adam", Hyper(lr=1e-3, beta1=0.3, weight_decay=0.05, decoupled=True)),
    "adam-l2-lerp-second-form": ("adam", Hyper(lr=2e-3, beta1=0.2, beta2=0.9, eps=1e-7, weight_decay=0.02)),
    "adagrad": ("adagrad", Hyper(lr=1e-2, eps=1e-10)),
    "adagrad-l2-lr-decay": ("adagrad", Hyper(lr=1e-2, eps=1e-10, weight_decay=0.1, lr_decay=0.01)),
    "lion": ("lion", Hyper(lr=1e-4, beta1=0.9, beta2=0.99)),
    "lion-decay": ("lion", Hyper(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.1)),
}
#: (master weights and gradient, states): what DeepSpeed runs (bf16 states only beside bf16 master weights).
STORAGES = {
    "fp32": (torch.float32, torch.float32),
    "bf16-master": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
}
LP_DTYPES = [None, torch.bfloat16, torch.float16, torch.float32]
SCALES = {"unscaled": 1.0, "scaled": 3.7 * 2.0**12}
#: Two threads' worth (native.MIN_ELEMENTS_PER_THREAD each), and a remainder that is no multiple of any vector
#: width: every loop's vector body and its scalar tail.
NUMEL = 2 * native.MIN_ELEMENTS_PER_THREAD + 16 * 7 + 5
STEPS = (1, 2, 3)

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason=f"the compiled kernel is unavailable here ({native.unavailable_reason()}); "
    "test_native_kernel.py::test_without_a_compiler_the_engine_warns_once_and_uses_torchs_kernels covers the fallback",
)
#: torch's vector path: elsewhere torch runs its generic kernels, which round differently (e.g. no fused add).
needs_torch_vector_path = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch runs its generic (non-SIMD) CPU kernels here, which round differently from its vector path; "
    "test_the_result_does_not_depend_on_threads_or_where_a_sub_group_is_cut still checks the kernel against itself",
)


def initial_state(rule: str, storage: str, numel: int = NUMEL, seed: int = 1) -> list[torch.Tensor]:
    """param, then the rule's states (non-negative where the rule needs it), in the storage's dtypes. Some
    elements have a zero moment and gradient (Lion's direction is then +0: its sign is taken as +1)."""
    master, state_dtype = STORAGES[storage]
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    param[1::7] *= 3e-6  # fp16 subnormals in the copy
    param[2::7] = 1.0 + 2.0**-8  # a bf16 tie
    states = [torch.randn(numel, generator=gen) for _ in RULES[rule].states]
    if rule == "adam":
        states[1].abs_()
    if rule == "adagrad":
        states[0].abs_()
    states[0][3::11] = 0.0
    return [param.to(master), *(s.to(state_dtype) for s in states)]


def gradients(storage: str, scale: float, numel: int = NUMEL) -> list[torch.Tensor]:
    """Each step's gradient in the master dtype, multiplied by the loss scale ``scale``; zero where the initial
    moment is zero at step 1."""
    grads = []
    for step in STEPS:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(10 + step)).mul_(scale)
        if step == 1:
            grad[3::11] = 0.0
        grads.append(grad.to(STORAGES[storage][0]))
    return grads


def reference_step(
    rule: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    step: int,
    hyper: Hyper,
    inv_scale: float,
    lp_out: torch.Tensor | None,
    lion_form: tuple[int, bool] | None = None,
) -> None:
    """The kernel's definition: load into fp32, unscale in fp32, the rule's torch formula (Lion: DeepSpeed's,
    :func:`deepspeed_lion`, in ``lion_form``, by default the engine's build's), store back (rounded to nearest even
    for bf16), cast the stored master weights into ``lp_out`` (as DeepSpeed copies its 16-bit partition from its
    master partition)."""
    p32, states32 = param.float(), [s.float() for s in states]
    g32 = grad.float() * inv_scale
    if rule == "lion":
        width, fused = lion_form or native.lion_form(param.dtype, states[0].dtype)
        deepspeed_lion(p32, g32, states32[0], hyper, width, fused)
    else:
        RULES[rule].torch_update(p32, g32, states32, torch.tensor(float(step)), hyper)
    param.copy_(p32)
    for s, s32 in zip(states, states32):
        s.copy_(s32)
    if lp_out is not None:
        lp_out.copy_(param)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 tensors rounded once (C's fmaf): the product is exact in fp64, the sum is rounded to
    odd (to nearest, then one fp64 ulp towards the exact sum, known from TwoSum, when inexact and even), and an fp64
    rounded to odd rounds to fp32 as the exact sum would (host_adam.c's fma_by_double)."""
    product, addend = a.double() * b.double(), c.double()
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    bits = total.view(torch.int64)
    inexact, even = (error > 0) | (error < 0), (bits & 1) == 0
    toward = torch.where((error > 0) == (total > 0), 1, -1)
    return torch.where(inexact & even, bits + toward, bits).view(torch.float64).float()


def deepspeed_lion(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, hyper: Hyper, width: int, fused: bool
) -> None:
    """One step of DeepSpeed's ``DeepSpeedCPULion`` on fp32 tensors, in place, as host_adam.c's Lion describes it:
    the scalars derived in fp32 from fp32 hyperparameters, the vector body on the first ``numel - numel % width``
    elements (none for ``width`` 0), the scalar loop on the rest (``fused``: as DeepSpeed's compiler contracts it
    where the CPU has FMA; otherwise every product rounded)."""
    b1, b2, lr, wd = (torch.tensor(x, dtype=torch.float32) for x in (hyper.beta1, hyper.beta2, hyper.lr,
                                                                     hyper.weight_decay))  # fmt: skip
    one = torch.tensor(1.0)
    omb1, omb2 = one - b1, one - b2
    after_decay = fma(-lr, wd, one) if fused else one - lr * wd
    numel = param.numel()
    body = numel - numel % width if width else 0
    for span, vector in ((slice(0, body), True), (slice(body, numel), False)):
        p, g, m = param[span], grad[span], exp_avg[span]
        if vector:
            c, m_next = fma(g, omb1, m * b1), fma(g, omb2, m * b2)
        elif fused:
            c, m_next = fma(m, b1, g * omb1), fma(m, b2, g * omb2)
        else:
            c, m_next = m * b1 + g * omb1, m * b2 + g * omb2
        move = torch.copysign(lr.expand_as(c), c).neg()
        if hyper.weight_decay <= 0:
            p_next = p + move
        elif vector or fused:
            p_next = fma(p, after_decay, move)
        else:
            p_next = p * after_decay + move
        p.copy_(p_next)
        m.copy_(m_next)


def run(
    case: str,
    storage: str,
    scale: float,
    lp_dtype: torch.dtype | None,
    threads: int | None,
    ours: bool,
    update: Callable[..., None] = native.host_update,
    lion_form: tuple[int, bool] | None = None,
) -> list[torch.Tensor]:
    """The state and the copy after :data:`STEPS` of the kernel (``ours``: ``update``, called as
    :func:`native.host_update`) or of the reference on one thread (Lion: in ``lion_form``, see
    :func:`reference_step`)."""
    rule, hyper = CASES[case]
    state = initial_state(rule, storage)
    lp = None if lp_dtype is None else torch.empty(NUMEL, dtype=lp_dtype)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference: torch's vector body, and its scalar remainder on the last NUMEL % 16
    try:
        for step, grad in zip(STEPS, gradients(storage, scale)):
            before = grad.clone()
            if ours:
                update(rule, state[0], grad, state[1:], step, hyper, 1 / scale, lp, threads)
            else:
                reference_step(rule, state[0], grad, state[1:], step, hyper, 1 / scale, lp, lion_form)
            assert torch.equal(grad, before), "the gradient is read, not written"
    finally:
        torch.set_num_threads(torch_threads)
    return [*state] + ([] if lp is None else [lp])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``, so that NaNs compare and -0 differs from +0."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@needs_torch_vector_path
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", CASES)
def test_bit_identical_to_the_rules_torch_formula_in_every_storage(case: str, storage: str) -> None:
    """Three steps from the same state, unscaled and scaled, into no copy, bf16, fp16 and fp32, on 1 and 2
    threads: the weights, the states and the copy have the reference's bits on every element (Adam: torch's vector
    body and its scalar remainder on the last NUMEL % 16; Lion: DeepSpeed's formula, :func:`deepspeed_lion`)."""
    for scale_name, scale in SCALES.items():
        for lp_dtype in LP_DTYPES:
            reference = run(case, storage, scale, lp_dtype, None, ours=False)
            for threads in (1, 2):
                result = run(case, storage, scale, lp_dtype, threads, ours=True)
                what = f"{case}, {storage}, {scale_name}, copy {lp_dtype}, {threads} thread(s)"
                assert_matches_reference(case, result, reference, what)


def assert_matches_reference(case: str, result: list[torch.Tensor], reference: list[torch.Tensor], what: str) -> None:
    """``result`` has ``reference``'s bits on every element, NaN patterns and signed zeros included."""
    rule = CASES[case][0]
    assert len(result) == len(reference)
    for name, mine, theirs in zip(["param", *RULES[rule].states, "copy"], result, reference):
        assert mine.dtype == theirs.dtype
        assert torch.equal(bits(mine), bits(theirs)), f"{what}: {name}"


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", ["adamw", "adagrad-l2-lr-decay", "lion-decay"])
def test_the_result_does_not_depend_on_threads_or_where_a_sub_group_is_cut(case: str, storage: str) -> None:
    """1, 2 or 3 threads, or the tensors cut into pieces (Adagrad: at odd offsets, bf16 pieces starting anywhere, on
    any byte pair): the same bits, NaN patterns included. Adam's and Lion's cuts are at multiples of 64 elements, as
    the engine cuts DeepSpeed's flat partitions: torch's fused Adam and DeepSpeed's Lion round the last few elements
    of each call their own way, so a cut elsewhere moves them (as it does for the reference called on the piece)."""
    rule, hyper = CASES[case]
    numel = 3 * native.MIN_ELEMENTS_PER_THREAD + 4099
    odd_cuts = [5, 1001, 20_003, 40_001] if rule == "adagrad" else [64, 1024, 20_032, 40_000]
    results = []
    for threads, cuts in ((1, []), (2, []), (3, []), (1, odd_cuts)):
        state = initial_state(rule, storage, numel, seed=7)
        grad = gradients(storage, 2.0**8, numel)[1]
        lp = torch.empty(numel, dtype=torch.float16)
        bounds = [0, *cuts, numel]
        for begin, end in zip(bounds, bounds[1:]):
            piece = [t[begin:end] for t in state]
            native.host_update(rule, piece[0], grad[begin:end], piece[1:], 2, hyper, 2.0**-8, lp[begin:end], threads)
        results.append([bits(t) for t in (*state, lp)])
    for other in results[1:]:
        for mine, theirs in zip(other, results[0]):
            assert torch.equal(mine, theirs)


def test_supports_names_the_storages_deepspeed_runs() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for rule in RULES:
        assert all(native.supports(rule, master, states) for master, states in STORAGES.values())
        assert not native.supports(rule, f32, bf16), "bf16 states only beside bf16 master weights"
        assert not native.supports(rule, f16, f32) and not native.supports(rule, f16, f16)
    assert not native.supports("sgd", f32, f32)


def test_bad_arguments_are_refused_before_anything_changes() -> None:
    """Each mistake is a ValueError naming it, and no tensor has changed."""
    param, exp_avg, exp_avg_sq = initial_state("adam", "fp32", 64)
    grad = torch.randn(64)
    hyper = CASES["adamw"][1]
    watched = [param, exp_avg, exp_avg_sq]
    before = [t.clone() for t in watched]
    bad = [
        ("unknown update rule 'sgd'", "sgd", param, grad, [exp_avg], None),
        ("adam takes 2 state tensor", "adam", param, grad, [exp_avg], None),
        ("are not supported", "adam", param, grad, [exp_avg.bfloat16(), exp_avg_sq.bfloat16()], None),
        ("grad is torch.bfloat16", "adam", param, grad.bfloat16(), [exp_avg, exp_avg_sq], None),
        ("the states must be one dtype", "adam", param.bfloat16(), grad.bfloat16(), [exp_avg, exp_avg_sq.half()], None),
        ("grad must be a contiguous CPU tensor", "adam", param, torch.randn(128)[::2], [exp_avg, exp_avg_sq], None),
        ("exp_avg_sq must be a contiguous CPU tensor of 64", "adam", param, grad, [exp_avg, exp_avg_sq[:63]], None),
        ("lp_out", "adam", param, grad, [exp_avg, exp_avg_sq], torch.empty(64, dtype=torch.int16)),
        ("are not supported", "lion", param.half(), grad.half(), [exp_avg.half()], None),
    ]
    for message, rule, p, g, states, lp in bad:
        with pytest.raises(ValueError, match=message):
            native.host_update(rule, p, g, states, 1, hyper, 0.5, lp)
    for now, then in zip(watched, before):
        assert torch.equal(now, then)


class _Recorder(TorchDispatchMode):
    """Records each op's name and the tensors its schema marks written."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        written = []
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                values = value if isinstance(value, (list, tuple)) else [value]
                written += [id(v) for v in values if isinstance(v, torch.Tensor)]
        self.calls.append((func._schema.name, written))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_which_tensors_the_kernel_writes() -> None:
    """The kernel is the torch op ``lightning_dos::host_update``: a dispatch mode (as the stream-race checker is)
    sees it write the weights, every state tensor and the copy, and only read the gradient."""
    for rule in RULES:
        param, *states = initial_state(rule, "bf16", 100)
        grad, lp = torch.randn(100).bfloat16(), torch.empty(100, dtype=torch.float16)
        with _Recorder() as recorder:
            native.host_update(rule, param, grad, states, 1, Hyper(lr=1e-3), 1.0, lp)
        assert recorder.calls == [("lightning_dos::host_update", [id(param), *map(id, states), id(lp)])], rule


def test_the_kernel_bench_times_every_optimizer_against_deepspeeds_op(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/kernels.py --optimizers`` prints one row per optimizer and storage, ours beside DeepSpeed's CPU op
    plus the cast, with the ratio (DeepSpeed's CPU ops build on first use, as they do for training)."""
    from bench import kernels as bench_kernels

    threads = torch.get_num_threads()
    assert bench_kernels.main(["--optimizers", "--numel", "40000", "--rounds", "1", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads, "the bench gives its caller's thread count back (tests run after)"
    printed = capsys.readouterr().out
    assert "CPU: " in printed and "DeepSpeed's time / ours" in printed
    for name in bench_kernels.OPTIMIZER_CASES:
        row = next(line for line in printed.splitlines() if line.startswith(f"| {name} |"))
        assert "n/a" not in row and row.rstrip(" |").endswith("x"), row


#: Lion's loop-invariant choices against DeepSpeed's own op (DeepSpeed's defaults, its rounding of 1 - beta in
#: float: 1 - 0.9 is 0.100000024 there, 0.100000001 from Python's double), and a decay whose factor
#: 1 - lr * wd rounds differently fused (0.99910897, DeepSpeed's build with FMA) and as two roundings (0.999109).
LION_CASES = {
    "no-decay": Hyper(lr=1e-4, beta1=0.9, beta2=0.99),
    "decay": Hyper(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.1),
    "decay-fused-factor": Hyper(lr=2.7e-3, beta1=0.9, beta2=0.999, weight_decay=0.33),
}
#: Ten steps, so that states drift from where they started.
LION_STEPS = range(1, 11)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", LION_CASES)
def test_lion_is_bit_identical_to_deepspeeds_cpu_lion(case: str, storage: str) -> None:
    """``DeepSpeedCPULion`` on the same tensors (its vector body and its scalar loop: NUMEL is no multiple of any
    vector width; bf16 runs DeepSpeed's scalar loop throughout on AVX2, its vector body on AVX-512), ten steps,
    unscaled and scaled by a power of two (the unscaled gradient is then exact, DeepSpeed's input), on 1 and 2
    threads: the engine's weights and moment have DeepSpeed's bits on every element, the sign of zero included."""
    from deepspeed.ops.lion import DeepSpeedCPULion

    hyper = LION_CASES[case]
    master, state_dtype = STORAGES[storage]
    param, exp_avg = initial_state("lion", storage)
    grads = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(20 + step)) for step in LION_STEPS]
    grads[0][3::11] = 0.0  # where the moment starts at zero: the direction is +0, taken as positive
    for grad in grads:
        grad[5::13] = 0.0
        grad[6::13] = -0.0
    grads = [grad.to(master) for grad in grads]
    # DeepSpeed's op, its state seeded with ours (it takes the state it finds).
    theirs = torch.nn.Parameter(param.clone())
    optimizer = DeepSpeedCPULion(
        [theirs], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), weight_decay=hyper.weight_decay,
        fp32_optimizer_states=state_dtype == torch.float32,
    )  # fmt: skip
    optimizer.state[theirs] = {"step": 0, "exp_avg": exp_avg.clone(), "exp_avg_sq": torch.zeros_like(exp_avg)}
    expected = []
    for grad in grads:
        theirs.grad = grad.clone()
        optimizer.step()
        expected.append((bits(theirs.detach().clone()), bits(optimizer.state[theirs]["exp_avg"].clone())))
    for scale in (1.0, 2.0**12):
        for threads in (1, 2):
            ours = [param.clone(), exp_avg.clone()]
            for step, (grad, (param_bits, moment_bits)) in enumerate(zip(grads, expected), 1):
                native.host_update("lion", ours[0], grad * scale, ours[1:], step, hyper, 1 / scale, None, threads)
                what = f"{case}, {storage}, scale {scale}, {threads} thread(s), step {step}"
                mismatched = (bits(ours[0]) != param_bits).sum().item()
                assert mismatched == 0, f"{what}: {mismatched} of {NUMEL} weights differ from DeepSpeed's"
                mismatched = (bits(ours[1]) != moment_bits).sum().item()
                assert mismatched == 0, f"{what}: {mismatched} of {NUMEL} moments differ from DeepSpeed's"
