"""What the exactness tests assume of torch's CPU kernels, probed on small fixed inputs at the start of a test run.

A few tests compare the engine's arithmetic with torch's bit for bit. They hold only while torch's kernels round as
they assume, which a new torch (or another CPU) may change. Each assumption has a probe here that runs the kernels
those tests compare on a few hundred fixed elements and compares them the same way; ``tests/conftest.py`` runs the
probes the collected tests need (once per test process) and skips a test only where its probe finds torch rounding
otherwise, saying what the probe found. No torch version is named anywhere.

The assumptions (:data:`PROBES`):

- ``compiled``: the compiled host update (engine/host_adam.c) computes what torch's fused Adam/AdamW CPU kernel
  (``torch._fused_adamw_``/``_fused_adam_``, one thread) computes, bit for bit on every element (torch's vector body
  and its remainder, the last ``numel % 16``, which the kernel reproduces), for every loop of the kernel (Adam with
  L2 and AdamW, both forms of torch's lerp, unscaled and unscaled by a clip coefficient), and its 16-bit copy is
  torch's own cast of the master weights.
- ``tiles``: torch's fused Adam kernel on one thread, run tile by tile (tiles starting at multiples of 16) after an
  unscale into a temporary, computes every element, the scalar tail included, as one call over the whole tensor
  after an unscale in place does.
- ``engine``: the engine's host path, which is the compiled kernel where it is built and torch's tiles elsewhere:
  ``compiled``'s probe, or ``tiles``' where the kernel is unavailable.
- each with non-finite gradients (inf, -inf, NaN in the body) as well: ``... non-finite``, NaN equal to NaN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lightning_dos.engine import native
from lightning_dos.engine.kernels import Hyper, SubGroupTensors, UpdateStep, step_tensor, tiled_update
from lightning_dos.model.update_rules import ADAM

#: Every loop of the compiled kernel (unscale or not, decoupled decay or L2, lerp's two forms: beta1 >= 0.5 or not).
HYPERS = (
    Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True),
    Hyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01, decoupled=False),
    Hyper(lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=True),
    Hyper(lr=2e-3, beta1=0.2, beta2=0.9, eps=1e-7, weight_decay=0.02, decoupled=False),
)
SCALES = (1.0, 3.7 * 2.0**12)
#: Elements probed: a vector body of 17 x 16 and a remainder of 13 (under torch's AVX-512 kernels 8 of them
#: vectorized once more, 5 scalar; all 13 scalar under AVX2).
NUMEL = 16 * 17 + 13
STEPS = (1, 2)
#: Tiles of the ``tiles`` probe: each starts on a multiple of 16, the last one ends in the whole call's tail.
TILE = 64
NON_FINITE = {5: float("inf"), 77: float("-inf"), 130: float("nan")}
STATES = ("param", "exp_avg", "exp_avg_sq")


def _state(seed: int) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq: fixed random values."""
    gen = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(NUMEL, generator=gen) for _ in range(3))
    return [param, grad, exp_avg, torch.rand(NUMEL, generator=gen)]


def _gradient(step: int, scale: float, non_finite: bool) -> torch.Tensor:
    grad = _state(100 + step)[1].mul_(scale)
    if non_finite:
        for index, value in NON_FINITE.items():
            grad[index] = value
    return grad


def _reference(state: list[torch.Tensor], grad: torch.Tensor, step: int, hyper: Hyper, scale: float) -> None:
    """What the tests compare with: the gradient unscaled in place, then torch's fused Adam over the whole tensor."""
    state[1].copy_(grad)
    if scale != 1.0:
        state[1].mul_(1 / scale)
    ADAM.torch_update(state[0], state[1], state[2:], step_tensor(step, torch.device("cpu")), hyper)


def _first_difference(mine: torch.Tensor, theirs: torch.Tensor, upto: int) -> int | None:
    """The first of ``upto`` elements whose bits differ (NaN equal to NaN), or None."""
    same = (mine[:upto] == theirs[:upto]) | (mine[:upto].isnan() & theirs[:upto].isnan())
    wrong = (~same).nonzero()
    return None if wrong.numel() == 0 else int(wrong[0])


def _one_thread(probe: Callable[[], str | None]) -> str | None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return probe()
    finally:
        torch.set_num_threads(threads)


def _named(hyper: Hyper) -> str:
    rule = "AdamW" if hyper.decoupled else "Adam (L2)"
    return f"{rule} lr={hyper.lr} betas=({hyper.beta1}, {hyper.beta2}) eps={hyper.eps} decay={hyper.weight_decay}"


def _compare(
    what: str, names: tuple[str, ...], mine: list[torch.Tensor], theirs: list[torch.Tensor], upto: int
) -> str | None:
    """None where each of ``mine`` has ``theirs``' bits in its first ``upto`` elements; else where they differ."""
    for name, a, b in zip(names, mine, theirs):
        index = _first_difference(a, b, upto)
        if index is not None:
            return f"{what}: {name}[{index}] is {a[index].item()!r}, torch's {b[index].item()!r}"
    return None


def compiled(non_finite: bool = False) -> str | None:
    """None where the compiled host update equals torch's fused Adam on every element and casts as torch casts;
    else what differed first. None as well where the kernel is not built (nothing compiled to compare)."""
    if not native.available():
        return None

    def probe() -> str | None:
        for hyper in HYPERS:
            for scale in SCALES:
                for lp_dtype in (torch.bfloat16, torch.float16):
                    ours, ref, lp = _state(1), _state(1), torch.empty(NUMEL, dtype=lp_dtype)
                    for step in STEPS:
                        grad = _gradient(step, scale, non_finite)
                        ours[1].copy_(grad)
                        native.host_update("adam", ours[0], ours[1], ours[2:], step, hyper, 1 / scale, lp, threads=1)
                        _reference(ref, grad, step, hyper, scale)
                    what = f"{_named(hyper)}, scale {scale}, after step {STEPS[-1]}"
                    found = _compare(what, STATES, [ours[0], *ours[2:]], [ref[0], *ref[2:]], NUMEL)
                    if found is None:
                        found = _compare(f"{what}, {lp_dtype}", ("copy",), [lp], [ours[0].to(lp_dtype)], NUMEL)
                    if found is not None:
                        return found
        return None

    return _one_thread(probe)


def tiles(non_finite: bool = False) -> str | None:
    """None where torch's fused Adam over tiles computes every element as one call over the whole tensor does;
    else what differed first."""

    def probe() -> str | None:
        for hyper in HYPERS:
            for scale in SCALES:
                ours, ref, lp = _state(2), _state(2), torch.empty(NUMEL, dtype=torch.bfloat16)
                for step in STEPS:
                    grad = _gradient(step, scale, non_finite)
                    ours[1].copy_(grad)
                    update_step = UpdateStep(step_tensor(step, torch.device("cpu")), hyper, 1 / scale)
                    tiled_update(ADAM, SubGroupTensors(ours[0], ours[1], ours[2:], lp), update_step, tile=TILE)
                    _reference(ref, grad, step, hyper, scale)
                found = _compare(
                    f"{_named(hyper)}, scale {scale}, tiles of {TILE}, after step {STEPS[-1]}",
                    (*STATES, "copy"),
                    [ours[0], *ours[2:], lp],
                    [ref[0], *ref[2:], ref[0].to(torch.bfloat16)],
                    NUMEL,
                )
                if found is not None:
                    return found
        return None

    return _one_thread(probe)


def engine(non_finite: bool = False) -> str | None:
    """The engine's host path: :func:`compiled` where the kernel is built, else :func:`tiles`."""
    return compiled(non_finite) if native.available() else tiles(non_finite)


#: Probe name -> (what the tests assume, the probe: None where it holds, else what differed).
PROBES: dict[str, tuple[str, Callable[[], str | None]]] = {
    "compiled": (
        "the compiled host update computes torch's fused Adam CPU kernel bit for bit, its remainder included",
        compiled,
    ),
    "tiles": ("torch's fused Adam CPU kernel computes the same bits tile by tile as over the whole tensor", tiles),
    "engine": ("the engine's host path computes torch's fused Adam CPU kernel bit for bit", engine),
}
PROBES.update(
    {
        f"{name} non-finite": (f"{assumes}, with non-finite gradients", functools.partial(probe, non_finite=True))
        for name, (assumes, probe) in list(PROBES.items())
    }
)


@functools.cache
def result(name: str) -> str | None:
    """:data:`PROBES`' ``name`` run once per process: None where torch rounds as assumed, else what differed."""
    return PROBES[name][1]()


def skip_reason(names: tuple[str, ...]) -> str | None:
    """Why a test assuming probes ``names`` skips here (the first that fails), or None where all hold."""
    for name in names:
        found = result(name)
        if found is not None:
            return (
                f"torch {torch.__version__} rounds otherwise than this test assumes ({PROBES[name][0]}): "
                f"probe {name!r} found {found}"
            )
    return None
