"""Functional Adam kernels, the same formula on both sides.

On the host, and on a CPU device, every update goes through one compiled loop (``host_adam.c``, built with
the system C compiler on first use; ``native``) that unscales the gradient, runs Adam and casts the fresh
weights into the model's dtype in one pass over memory: ~30 bytes per element for a bf16 model, against ~42
for three kernels. Its arithmetic is torch's fused CPU Adam kernel's, operation for operation (bit for bit
with torch 2.13 on this project's CPU; tests/test_native_kernel.py), and it is the same for every element, so
the result does not depend on how sub-groups are cut or split over threads. On a CUDA device the update is
torch's fused kernel (``torch._fused_adamw_`` for decoupled decay, ``torch._fused_adam_`` for L2): the same
formula up to float rounding. All of them are functional: the step count is passed in, so a sub-group's count
is right whichever side updated it last.

Without a C compiler (or with LIGHTNING_DOS_NATIVE=0) the host runs torch's kernels instead:
:func:`tiled_host_update` unscales, updates and casts one cache-sized tile at a time (each kernel on torch's
threads, or, opted in with LIGHTNING_DOS_HOST_WORKERS=1, each host thread through its own share of tiles:
``host_workers``). ``bench/kernels.py`` measures every path against the three-pass path and DeepSpeed's CPU
Adam followed by its cast.

Unscaling multiplies by the inverse of DeepSpeed's combined scale, as DeepSpeed's own
``unscale_and_clip_grads`` does and as the device side does. torch's kernels can divide by a
``grad_scale`` tensor instead, but ``x / s`` and ``x * (1 / s)`` round differently: with the division
the placement-equivalence tests drift from plain AdamW by 1.23e-5 after 20 clipped steps (9.2e-6 with
the multiplication, bound 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_dos.engine import host_workers, native

#: Elements per tile of the host update, per host thread: 4 MiB of fp32 state, in the shared L3. Measured with
#: ``bench/kernels.py --tiles`` on this project's CPU (2 threads, 1 MiB L2 per core, 32 MiB L3, shared and
#: loaded; bench/RESULTS.md): 128K-256K fastest, 16K-64K slower (per-tile Python and GIL costs), 512K-1M
#: slightly slower.
HOST_TILE_ELEMENTS = 1 << 18
#: Worker shares start on multiples of this many elements, so every share's vector loop is aligned.
_SHARE_ALIGN = 64


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one optimizer param group for one step.

    Attributes:
        lr: learning rate (read from the param group every step, so LR schedules apply).
        beta1: first-moment decay.
        beta2: second-moment decay.
        eps: term added to the denominator.
        weight_decay: weight-decay coefficient.
        decoupled: True for AdamW-style decoupled decay, False for Adam's L2 penalty.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """Apply one Adam step in place to ``param``, ``exp_avg`` and ``exp_avg_sq``.

    On CPU tensors this is the compiled one-pass kernel when it is available (the host's formula, so a CPU
    device computes what the host computes, bit for bit), otherwise :func:`torch_adam_update`.

    Args:
        param: fp32 master weights (1-D), updated in place.
        grad: fp32 gradient of the same shape, already unscaled and clipped.
        exp_avg: first moment, updated in place.
        exp_avg_sq: second moment, updated in place.
        step: 0-d float32 tensor on ``param``'s device holding the step number being applied
            (1 for the first step); the kernel reads it for bias correction and does not change it.
        hyper: the param group's hyperparameters.
    """
    if param.device.type == "cpu" and _native_fits(param, grad, exp_avg, exp_avg_sq):
        _native(param, grad, exp_avg, exp_avg_sq, step, hyper, 1.0, None)
        return
    torch_adam_update(param, grad, exp_avg, exp_avg_sq, step, hyper)


def _native_fits(*tensors: torch.Tensor) -> bool:
    """The compiled kernel takes contiguous fp32 CPU tensors (the engine's slabs and buffers always are)."""
    return native.available() and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _native(param, grad, exp_avg, exp_avg_sq, step, hyper, inv_grad_scale, lp_out) -> None:  # noqa: ANN001
    native.host_adam(
        param, grad, exp_avg, exp_avg_sq, float(step.item()), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
        hyper.weight_decay, hyper.decoupled, inv_grad_scale, lp_out,
    )  # fmt: skip


def torch_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """One Adam step with torch's fused kernel (any device), in place on ``param``, ``exp_avg``, ``exp_avg_sq``.

    Args:
        param: fp32 master weights (1-D), updated in place.
        grad: fp32 gradient of the same shape, already unscaled and clipped.
        exp_avg: first moment, updated in place.
        exp_avg_sq: second moment, updated in place.
        step: 0-d float32 tensor on ``param``'s device holding the step number being applied
            (1 for the first step); the kernel reads it for bias correction and does not change it.
        hyper: the param group's hyperparameters.
    """
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def fused_host_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    inv_grad_scale: float = 1.0,
    lp_out: torch.Tensor | None = None,
    tile: int = HOST_TILE_ELEMENTS,
) -> None:
    """Unscale, Adam and the copy into the model's partition in one pass over host memory.

    Runs the compiled kernel (``native``) when it is available, :func:`tiled_host_update` otherwise. Either way
    the result is the same as multiplying the gradient by ``inv_grad_scale``, running :func:`adam_update` over
    the whole sub-group and then ``lp_out.copy_(param)`` (bit for bit with the compiled kernel; with torch's tiles,
    bit for bit but for the last few elements of a thread's chunk, which may differ by rounding). The
    compiled kernel leaves the gradient as it came; the tiles leave it unscaled. The update of a sub-group is
    not divisible: the engine records its unscale, update and cast as reached together once this returns.
    Nothing here can fail part-way in practice (arguments are checked before any state changes, and the engine
    holds signals during the update).

    Args:
        param: fp32 master weights (1-D, host), updated in place.
        grad: fp32 gradient of the same shape, scaled by the loss scale and not yet clipped.
        exp_avg: first moment, updated in place.
        exp_avg_sq: second moment, updated in place.
        step: 0-d float32 CPU tensor, the step number being applied (see :func:`adam_update`).
        hyper: the param group's hyperparameters.
        inv_grad_scale: what the gradient is multiplied by to unscale and clip it (1 / DeepSpeed's
            combined scale); 1.0 leaves the gradient as it is.
        lp_out: where the updated weights go in the model's dtype (bf16, fp16, or fp32 for an fp32 model),
            as many elements as ``param``; None to skip the copy.
        tile: elements per tile of torch's path (positive); the default was measured on this project's CPU.
    """
    if tile < 1:
        raise ValueError(f"tile must be a positive number of elements, got {tile}")
    numel = param.numel()
    if lp_out is not None and lp_out.numel() != numel:
        raise ValueError(f"lp_out has {lp_out.numel()} elements where param has {numel}")
    if _native_fits(param, grad, exp_avg, exp_avg_sq) and (lp_out is None or lp_out.is_contiguous()):
        _native(param, grad, exp_avg, exp_avg_sq, step, hyper, inv_grad_scale, lp_out)
        return
    tiled_host_update(param, grad, exp_avg, exp_avg_sq, step, hyper, inv_grad_scale, lp_out, tile)


def tiled_host_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    inv_grad_scale: float = 1.0,
    lp_out: torch.Tensor | None = None,
    tile: int = HOST_TILE_ELEMENTS,
) -> None:
    """:func:`fused_host_update` with torch's kernels, for machines without a C compiler.

    The sub-group is processed in tiles of ``tile`` elements: the tile's gradient is unscaled (in place), torch's
    fused Adam updates the tile and its fresh weights are cast into ``lp_out``, each step reading what the
    previous one left in cache. With more than one torch thread and the opt-in host workers enabled, each worker
    thread takes a contiguous share and runs its tiles on its own (no barrier between kernels; see
    ``host_workers``); otherwise the caller runs the tiles with torch's own threads. Arguments as for
    :func:`fused_host_update`.
    """
    numel = param.numel()

    def run_tiles(begin: int, end: int) -> None:
        for start in range(begin, end, tile):
            span = slice(start, min(end, start + tile))
            weights, grads = param[span], grad[span]
            if inv_grad_scale != 1.0:
                grads.mul_(inv_grad_scale)
            torch_adam_update(weights, grads, exp_avg[span], exp_avg_sq[span], step, hyper)
            if lp_out is not None:
                lp_out[span].copy_(weights)

    pool = host_workers.workers()
    if pool is None or numel <= tile * torch.get_num_threads():
        run_tiles(0, numel)
        return
    host_workers.run_shares(pool, run_tiles, host_workers.shares(numel, torch.get_num_threads(), _SHARE_ALIGN))


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """A 0-d step tensor made on ``device`` by a fill kernel (no host-to-device copy, no sync)."""
    return torch.full((), float(step), dtype=torch.float32, device=device)
