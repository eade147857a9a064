"""Functional optimizer kernels: each update rule (``update_rules``), the same formula on both sides.

On the host every update goes through one compiled loop per rule (``host_adam.c``, built with the system C
compiler on first use; ``native``) that unscales the gradient, runs the rule and casts the
fresh weights into the model's dtype in one pass over memory: ~30 bytes per element for Adam and a bf16 model,
against ~42 for three kernels. Its arithmetic is the rule's torch formula, operation for operation (bit for bit
with torch 2.13 on this project's CPU; tests/test_native_kernel.py), and it is the same for every element, so
the result does not depend on how sub-groups are cut or split over threads. On an accelerator the update is the
rule's torch formula (for Adam torch's fused kernel, ``torch._fused_adamw_`` or ``torch._fused_adam_``): the
same formula up to float rounding. Which of the two runs follows where the engine placed the sub-group
(:func:`apply_update` for a device's, :func:`host_update` for the host's), never the tensors' device, so the
simulated accelerator, whose device memory is CPU memory, runs the device formula as a GPU does (without an
accelerator the engine's device placements run on the CPU and call :func:`host_update`). bf16 master weights or
states are computed in fp32 and stored rounded to nearest even on both sides. All of them are functional: the
step count is passed in, so a sub-group's count is right whichever side updated it last.

Without a C compiler (or with LIGHTNING_DOS_NATIVE=0) the host runs torch's kernels instead:
:func:`tiled_update` unscales, updates and casts one cache-sized tile at a time (each kernel on torch's
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

from collections.abc import Sequence
from dataclasses import replace

import torch

from lightning_dos.engine import host_workers, native
from lightning_dos.engine.update_operands import SubGroupTensors, UpdateStep
from lightning_dos.model.update_rules import Hyper, UpdateRule

__all__ = [
    "Hyper",
    "SubGroupTensors",
    "UpdateStep",
    "apply_update",
    "host_update",
    "step_tensor",
    "tiled_update",
]

#: Elements per tile of the host update, per host thread: 4 MiB of fp32 state, in the shared L3. Measured with
#: ``bench/kernels.py --tiles`` on this project's CPU (2 threads, 1 MiB L2 per core, 32 MiB L3, shared and
#: loaded; bench/RESULTS.md): 128K-256K fastest, 16K-64K slower (per-tile Python and GIL costs), 512K-1M
#: slightly slower.
HOST_TILE_ELEMENTS = 1 << 18
#: Worker shares start on multiples of this many elements, so every share's vector loop is aligned.
_SHARE_ALIGN = 64


def apply_update(rule: UpdateRule, tensors: SubGroupTensors, update_step: UpdateStep) -> None:
    """The device side's update: unscale, one step of ``rule`` and the cast into ``lp_out``, in place on ``param``
    and ``states`` (``tensors``), with the rule's torch formula (:func:`torch_update`) whatever device the tensors
    are on.

    The engine calls it for the sub-groups it places on an accelerator (streamed and resident), real or
    simulated, and :func:`host_update` for those it places on the host: the code path follows the placement, not
    ``param.device``, so the simulated accelerator (whose device memory is CPU memory) runs the code a GPU runs.
    On CPU tensors torch's fused Adam rounds the last ``numel % 16`` elements (its scalar tail) differently from
    the compiled host kernel, which is why a CPU device without an accelerator runs :func:`host_update` for its
    device placements. The gradient may be left unscaled (it is the engine's own copy or is rewritten by the next
    backward). Nothing here reads a device value on the host: the step count stays a tensor on ``param``'s device
    (``update_step.step``; the engine passes ``update_step.step_number`` too, so that no formula reads it back).
    """
    torch_update(rule, tensors, update_step)


def torch_update(rule: UpdateRule, tensors: SubGroupTensors, update_step: UpdateStep, keep_grad: bool = False) -> None:
    """:func:`apply_update` with torch's kernels: the rule's formula in fp32 whatever the storage dtypes.

    bf16 master weights, gradients or states are loaded into fp32 copies, updated, and stored back rounded to
    nearest even (what DeepSpeed's CPU optimizers do with bf16 state); the gradient is unscaled in fp32. With
    fp32 storage the update runs in place and the gradient is unscaled in place, unless ``keep_grad`` (the same
    values, into a temporary: a speculative update must leave the gradient for its redo). Other arguments as for
    :func:`apply_update`.
    """
    param, grad, states, lp_out = tensors.param, tensors.grad, tensors.states, tensors.lp_out
    step, hyper, inv_grad_scale = update_step.step, update_step.hyper, update_step.inv_grad_scale
    stored = (param, *states)
    if all(t.dtype == torch.float32 for t in (*stored, grad)):
        if inv_grad_scale != 1.0:
            grad = grad * inv_grad_scale if keep_grad else grad.mul_(inv_grad_scale)
        rule.torch_update(param, grad, states, step, hyper, update_step.step_number)
    else:
        work = [t.float() if t.dtype != torch.float32 else t for t in stored]
        grad32 = grad.float() if grad.dtype != torch.float32 else grad
        if inv_grad_scale != 1.0:
            grad32 = grad32 * inv_grad_scale
        rule.torch_update(work[0], grad32, work[1:], step, hyper, update_step.step_number)
        for target, value in zip(stored, work, strict=True):
            if target is not value:
                target.copy_(value)
    if lp_out is not None:
        # From the stored master weights, rounded as they are kept (DeepSpeed copies its 16-bit partition from them).
        lp_out.copy_(param)


def _native_fits(rule: UpdateRule, tensors: SubGroupTensors) -> bool:
    """The compiled kernel takes contiguous CPU tensors in the dtypes it was built for (the engine's slabs and
    buffers always are contiguous)."""
    param, grad, states, lp_out = tensors.param, tensors.grad, tensors.states, tensors.lp_out
    if not native.available() or (lp_out is not None and not lp_out.is_contiguous()):
        return False
    if not all(t.is_contiguous() for t in (param, grad, *states)) or grad.dtype != param.dtype:
        return False
    state_dtype = states[0].dtype if states else param.dtype
    return native.supports(rule.name, param.dtype, state_dtype)


def _native(
    rule: UpdateRule,
    tensors: SubGroupTensors,
    update_step: UpdateStep,
    out: tuple[torch.Tensor, Sequence[torch.Tensor]] | None,
) -> None:
    number = update_step.step_number
    number = float(update_step.step.item()) if number is None else float(number)
    native.host_update(
        rule.name, tensors.param, tensors.grad, tensors.states, number, update_step.hyper,
        update_step.inv_grad_scale, tensors.lp_out, out=out,
    )  # fmt: skip


def host_update(
    rule: UpdateRule,
    tensors: SubGroupTensors,
    update_step: UpdateStep,
    tile: int = HOST_TILE_ELEMENTS,
    out: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None,
) -> None:
    """Unscale, the update and the copy into the model's partition in one pass over host memory.

    Runs the compiled kernel (``native``) when it runs ``rule`` in these dtypes, :func:`tiled_update`
    otherwise. Either way the result is the same as :func:`torch_update` over the whole sub-group (bit for bit
    with the compiled kernel; with torch's tiles, bit for bit but for the last few elements of a thread's chunk,
    which may differ by rounding). The update of a sub-group is not divisible: the engine records its unscale,
    update and cast as reached together once this returns. Nothing here can fail part-way in practice
    (arguments are checked before any state changes, and the engine holds signals during the update).

    Args:
        rule: the optimizer's update rule.
        tensors: the sub-group's master weights (1-D, host), gradient, states and 16-bit copy.
        update_step: the step applied (its step tensor on the CPU); without ``step_number``, ``step`` is read.
        tile: elements per tile of torch's path (positive); the default was measured on this project's CPU.
        out: ``(master weights, states)`` of the same dtypes and sizes to write the result into, leaving ``param``
            and ``states`` as they were (a speculative update); None updates in place. The compiled kernel reads
            the old and writes the new in its one pass (1.39x an update in place on AVX2: the CPU reads each line
            it writes first); torch's path copies the state into ``out`` first and updates it there.
    """
    if tile < 1:
        raise ValueError(f"tile must be a positive number of elements, got {tile}")
    numel, lp_out = tensors.param.numel(), tensors.lp_out
    if lp_out is not None and lp_out.numel() != numel:
        raise ValueError(f"lp_out has {lp_out.numel()} elements where param has {numel}")
    if _native_fits(rule, tensors):
        _native(rule, tensors, update_step, out)
        return
    if out is not None:
        param, states = _copied_into(out, tensors.param, tensors.states)
        tensors = replace(tensors, param=param, states=states)
    tiled_update(rule, tensors, update_step, tile)


def _copied_into(
    out: tuple[torch.Tensor, Sequence[torch.Tensor]], param: torch.Tensor, states: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """``out`` holding a copy of ``param`` and ``states`` (torch's path updates out of place as copy and update)."""
    out_param, out_states = out
    if len(out_states) != len(states):
        raise ValueError(f"out holds {len(out_states)} state tensor(s) where the rule has {len(states)}")
    for target, source in zip((out_param, *out_states), (param, *states), strict=True):
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"out's {tuple(target.shape)} {target.dtype} does not match {tuple(source.shape)} "
                             f"{source.dtype}")  # fmt: skip
        target.copy_(source)
    return out_param, out_states


def tiled_update(
    rule: UpdateRule, tensors: SubGroupTensors, update_step: UpdateStep, tile: int = HOST_TILE_ELEMENTS
) -> None:
    """:func:`host_update` with torch's kernels, for machines without a C compiler.

    The sub-group is processed in tiles of ``tile`` elements: each tile is unscaled, updated and cast by
    :func:`torch_update`, each step reading what the previous one left in cache; the host gradient is left as it
    is (as the compiled kernel leaves it: a speculative update is redone from it). With more than one torch thread
    and the opt-in host workers enabled, each worker thread takes a contiguous share and runs its tiles on its
    own (no barrier between kernels; see ``host_workers``); otherwise the caller runs the tiles with torch's own
    threads. Arguments as for :func:`host_update`.
    """
    numel = tensors.param.numel()

    def run_tiles(begin: int, end: int) -> None:
        for start in range(begin, end, tile):
            torch_update(rule, tensors.span(slice(start, min(end, start + tile))), update_step, keep_grad=True)

    pool = host_workers.workers()
    if pool is None or numel <= tile * torch.get_num_threads():
        run_tiles(0, numel)
        return
    host_workers.run_shares(pool, run_tiles, host_workers.shares(numel, torch.get_num_threads(), _SHARE_ALIGN))


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """A 0-d step tensor made on ``device`` by a fill kernel (no host-to-device copy, no sync)."""
    return torch.full((), float(step), dtype=torch.float32, device=device)
