"""The one-pass host update (unscale + Adam + cast: compiled, or torch's kernels tile by tile) against the
three-pass reference built from torch's fused Adam kernel."""

from __future__ import annotations

import pytest
import torch

from lightning_dos.engine import host_workers
from lightning_dos.engine.kernels import (
    HOST_TILE_ELEMENTS,
    Hyper,
    SubGroupTensors,
    UpdateStep,
    host_update,
    step_tensor,
    tiled_update,
)
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAM

ADAMW = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
ADAM_L2 = Hyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01, decoupled=False)
#: Loss scale alone (a power of two, as fp16 dynamic scaling uses), and loss scale times a clip coefficient.
SCALES = [1.0, 2.0**16, 3.7 * 2.0**12]


def _state(numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(numel, generator=gen) for _ in range(3))
    exp_avg_sq = torch.rand(numel, generator=gen)
    return [param, grad, exp_avg, exp_avg_sq]


def _three_pass(state: list[torch.Tensor], step: int, hyper: Hyper, scale: float, lp: torch.Tensor) -> None:
    """The reference: unscale the whole gradient, torch's fused Adam over the whole sub-group, then cast."""
    param, grad, exp_avg, exp_avg_sq = state
    if scale != 1.0:
        grad.mul_(1.0 / scale)
    ADAM.torch_update(param, grad, (exp_avg, exp_avg_sq), step_tensor(step, torch.device("cpu")), hyper)
    lp.copy_(param)


@pytest.fixture
def one_thread():  # noqa: ANN201
    """torch's CPU Adam kernel computes the last few elements of each thread's chunk (fewer than a vector's
    width) on a scalar path that can round differently; with one thread, tiles that are multiples of the
    vector width leave exactly the same elements on that path as one call over the whole sub-group."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Both host paths: the engine's (compiled where a C compiler is, else torch's tiles) and torch's tiles.
def _adam(update):  # noqa: ANN001, ANN202
    """``update`` (:func:`host_update` or :func:`tiled_update`) of Adam, taking its two moments and the step's
    values as arguments (the tests below spell them out)."""

    def run(param, grad, exp_avg, exp_avg_sq, step, hyper, inv_grad_scale=1.0, lp_out=None, tile=HOST_TILE_ELEMENTS):  # noqa: ANN001, ANN202, E501
        tensors = SubGroupTensors(param, grad, (exp_avg, exp_avg_sq), lp_out)
        update(ADAM, tensors, UpdateStep(step, hyper, inv_grad_scale), tile=tile)

    return run


ENGINE_ADAM, TILED_ADAM = _adam(host_update), _adam(tiled_update)
PATHS = {"engine": ENGINE_ADAM, "tiles": TILED_ADAM}
#: Both paths leave the gradient as it came: the compiled kernel unscales in registers, torch's tiles into a temporary.
STATE_NAMES = ("param", "grad", "exp_avg", "exp_avg_sq", "lp")


def _run_both(numel, tile, hyper, scale, lp_dtype, steps=3, update=ENGINE_ADAM):  # noqa: ANN001, ANN202
    """Three steps of the one-pass update and of the three-pass reference, from the same state. The gradient
    the reference leaves (unscaled) is put back as it came, so the gradients compare whichever path ran."""
    ours, ref = _state(numel, seed=numel + tile), _state(numel, seed=numel + tile)
    lp_ours, lp_ref = torch.zeros(numel, dtype=lp_dtype), torch.zeros(numel, dtype=lp_dtype)
    for step in range(1, steps + 1):
        grad = _state(numel, seed=100 * step + numel)[1].mul_(scale)  # gradients arrive scaled
        ours[1].copy_(grad)
        ref[1].copy_(grad)
        update(*ours, step_tensor(step, torch.device("cpu")), hyper, 1.0 / scale, lp_ours, tile=tile)
        _three_pass(ref, step, hyper, scale, lp_ref)
        assert torch.equal(lp_ours, ours[0].to(lp_dtype)), "the 16-bit copy is the rounded master, bit for bit"
        for state in (ours, ref):
            state[1].copy_(grad)
    return [*ours, lp_ours], [*ref, lp_ref]


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("hyper", [ADAMW, ADAM_L2], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("numel,tile", [(1000, 64), (1000, 1000), (4099, 1024)])
@pytest.mark.parametrize("path", PATHS)
def test_fused_update_is_bit_identical_to_three_passes(one_thread, path, lp_dtype, scale, hyper, numel, tile) -> None:  # noqa: ANN001
    """Every element bit for bit: torch's kernel computes the last numel % 16 (AVX-512; % 8 with AVX2) elements of
    a call on a scalar path that its compiler contracts differently, and the compiled kernel does the same on the
    same elements (tests/test_native_kernel.py); tiles of torch's kernel (whole multiples of 16 but the last) put
    the same elements on that path as the reference does."""
    ours, ref = _run_both(numel, tile, hyper, scale, lp_dtype, update=PATHS[path])
    for name, mine, theirs in zip(STATE_NAMES, ours, ref):
        assert torch.equal(mine, theirs), name


#: The workers pin themselves with OpenMP's per-thread count; under another threading backend the caller runs the tiles.
needs_openmp = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="torch is not built with OpenMP threading: no workers"
)


@needs_openmp
def test_worker_threads_give_the_one_thread_result_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several host threads, each on its own aligned share of tiles, compute what one thread computes."""
    monkeypatch.setattr(host_workers, "ENABLED", True)  # opt-in (LIGHTNING_DOS_HOST_WORKERS=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, ref = _run_both(5007, 256, ADAMW, 3.7 * 2.0**12, torch.bfloat16, update=TILED_ADAM)
        torch.set_num_threads(2)
        assert host_workers.workers() is not None
        ours, _ = _run_both(5007, 256, ADAMW, 3.7 * 2.0**12, torch.bfloat16, update=TILED_ADAM)
        assert host_workers.workers() is not None and 5007 > 256 * torch.get_num_threads(), "workers ran"
    finally:
        torch.set_num_threads(threads)
    for name, mine, theirs in zip(STATE_NAMES, ours, ref):
        assert torch.equal(mine, theirs), name


@needs_openmp
def test_worker_threads_keep_one_torch_thread_and_leave_the_callers_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller has 2 threads (set here, whatever an earlier test or the machine left): 2 workers, each at
    one thread, and the caller's 2 left as they were."""
    monkeypatch.setattr(host_workers, "ENABLED", True)  # opt-in (LIGHTNING_DOS_HOST_WORKERS=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = host_workers.workers()
        assert pool is not None, "two caller threads under OpenMP: workers"
        assert [f.result() for f in [pool.submit(torch.get_num_threads) for _ in range(2)]] == [1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert host_workers.shares(1000, 3, 64) == [(0, 384), (384, 768), (768, 1000)]


@pytest.mark.parametrize("tile", [1, 7, 48, 1000])
@pytest.mark.parametrize("hyper", [ADAMW, ADAM_L2], ids=["adamw", "adam-l2"])
def test_any_tile_and_thread_count_stays_within_rounding_of_the_three_pass_path(tile, hyper) -> None:  # noqa: ANN001
    """Odd tiles put more elements on torch's scalar path; those differ by a few ulp at most, well
    inside the 1e-5 bound of the equivalence tests."""
    ours, ref = _run_both(777, tile, hyper, 3.7 * 2.0**12, torch.bfloat16, update=TILED_ADAM)
    for mine, theirs in zip(ours[:4], ref[:4]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("path", PATHS)
def test_default_tile_splits_a_large_sub_group_and_matches_plain_adamw(path: str) -> None:
    """More elements than one tile (and than one thread's minimum share), checked against torch.optim.AdamW
    fed the unscaled gradient."""
    numel, scale = HOST_TILE_ELEMENTS + 12_345, 2.0**10
    param, grad, exp_avg, exp_avg_sq = _state(numel, seed=7)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    reference = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([reference], lr=ADAMW.lr, betas=(ADAMW.beta1, ADAMW.beta2), eps=ADAMW.eps,
                            weight_decay=ADAMW.weight_decay, foreach=False)  # fmt: skip
    reference.grad = grad.clone()
    opt.step()
    lp = torch.empty(numel, dtype=torch.bfloat16)
    grad.mul_(scale)
    PATHS[path](param, grad, exp_avg, exp_avg_sq, step_tensor(1, torch.device("cpu")), ADAMW, 1 / scale, lp)
    torch.testing.assert_close(param, reference.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, opt.state[reference]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert torch.equal(lp, param.to(torch.bfloat16))


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_gradients_propagate_exactly_as_in_the_three_pass_path(path: str) -> None:
    """With no overflow check in front (fp32/bf16), inf and NaN reach the state just as before."""
    ours, ref = _state(500, seed=3), _state(500, seed=3)
    for state in (ours, ref):
        state[1][[5, 77, 300]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    lp_ours, lp_ref = torch.zeros(500, dtype=torch.bfloat16), torch.zeros(500, dtype=torch.bfloat16)
    PATHS[path](*ours, step_tensor(1, torch.device("cpu")), ADAMW, 2.0**-8, lp_ours, tile=64)
    _three_pass(ref, 1, ADAMW, 2.0**8, lp_ref)
    for name, mine, theirs in zip(STATE_NAMES, [*ours, lp_ours], [*ref, lp_ref]):
        if name != "grad":  # the compiled kernel leaves the gradient as it came
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


def _engine_and_inputs(grads: list[torch.Tensor], scale: float, steps: int) -> tuple[InterleavedUpdate, StepInputs]:
    engine = InterleavedUpdate([300, 211], [0, 0], 64, torch.device("cpu"), torch.bfloat16)
    engine.pool.param.copy_(_state(511, seed=11)[0])
    lp = [torch.zeros(300, dtype=torch.bfloat16), torch.zeros(211, dtype=torch.bfloat16)]
    return engine, StepInputs([g.clone() for g in grads], lp, [ADAMW], [steps, steps], inv_grad_scale=1 / scale)


def test_fp16_overflow_skips_the_step_and_leaves_state_for_the_next_one() -> None:
    """An overflowing step (non-finite scaled gradients) is skipped before any kernel runs, as DeepSpeed
    does; the state and the 16-bit copy are untouched, and the next step matches a run that never saw it."""
    scale = 2.0**16
    gen = torch.Generator().manual_seed(5)
    finite = [[torch.randn(n, generator=gen) * scale for n in (300, 211)] for _ in range(2)]
    overflow = [g.clone() for g in finite[0]]
    overflow[1][17] = float("inf")
    plan = Plan(tuple(Place.DEVICE if i % 2 else Place.HOST for i in range(9)))

    ours, inputs = _engine_and_inputs(finite[0], scale, steps=1)
    ours.step(plan, inputs)
    lp_before = [t.clone() for t in inputs.lp_targets]
    slabs_before = [t.clone() for t in (ours.pool.param, ours.pool.state("exp_avg"), ours.pool.state("exp_avg_sq"))]
    assert not all(torch.isfinite(g).all() for g in overflow)
    ours.skip(plan)  # the adapter's decision on an fp16 overflow: no sub-group is updated
    for before, after in zip(
        slabs_before, (ours.pool.param, ours.pool.state("exp_avg"), ours.pool.state("exp_avg_sq"))
    ):
        assert torch.equal(before, after)
    _, next_inputs = _engine_and_inputs(finite[1], scale, steps=2)
    next_inputs.lp_targets = lp_before
    ours.step(plan, next_inputs)

    reference, ref_inputs = _engine_and_inputs(finite[0], scale, steps=1)
    reference.step(plan, ref_inputs)
    _, ref_next = _engine_and_inputs(finite[1], scale, steps=2)
    reference.step(plan, ref_next)
    assert torch.equal(ours.pool.param, reference.pool.param)
    assert torch.equal(ours.pool.state("exp_avg_sq"), reference.pool.state("exp_avg_sq"))
    for mine, theirs in zip(next_inputs.lp_targets, ref_next.lp_targets):
        assert torch.equal(mine, theirs)


def test_host_and_device_sides_compute_bit_identical_results() -> None:
    """Same kernel, same unscale on both sides: placement changes nothing, to the bit (sub-groups here are
    smaller than a tile, so the host's tiling leaves the kernel's split over threads as it is)."""
    scale = 3.7 * 2.0**12
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale for n in (300, 211)]
    results = []
    for place in (Place.HOST, Place.DEVICE, Place.RESIDENT):
        engine, inputs = _engine_and_inputs(grads, scale, steps=1)
        engine.step(Plan((place,) * len(engine.sub_groups)), inputs)
        engine.flush_resident()  # resident state lives on the device until brought home
        results.append((engine.pool.param.clone(), engine.pool.state("exp_avg_sq").clone(), inputs.lp_targets))
    for param, exp_avg_sq, lp in results[1:]:
        assert torch.equal(param, results[0][0])
        assert torch.equal(exp_avg_sq, results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(lp, results[0][2]))


def test_host_update_refuses_bad_arguments() -> None:
    param, grad, exp_avg, exp_avg_sq = _state(10, seed=0)
    step = step_tensor(1, torch.device("cpu"))
    with pytest.raises(ValueError, match="tile"):
        ENGINE_ADAM(param, grad, exp_avg, exp_avg_sq, step, ADAMW, tile=0)
    with pytest.raises(ValueError, match="lp_out"):
        ENGINE_ADAM(param, grad, exp_avg, exp_avg_sq, step, ADAMW, lp_out=torch.zeros(9))
