"""What a rank will hold in host memory once DeepSpeed and the engine have allocated: the pre-flight figure.

Counted per rank, from DeepSpeed 0.19.8's ZeRO-3 optimizer with CPU optimizer offload (``stage3.py``):

- a gradient buffer per DeepSpeed sub-group, in the master weights' dtype (``master_weights_and_grads_dtype``:
  fp32, or bf16 under ``bf16.bf16_master_weights_and_grads``), each pinned on its own
  (``initialize_optimizer_states``);
- ``grad_partitions_flat_buffer``, the rank's whole partition in the gradient-accumulation dtype (the model's
  dtype unless ``data_types.grad_accum_dtype`` says otherwise), pinned (``_setup_for_real_optimizer``);
- with parameter offload to the CPU on an accelerator, a 16-bit flat buffer per parameter group, pinned
  (``_create_param_groups_fp16_flat_cpu_memory``); without an accelerator the 16-bit model is the model itself;
- the engine's slabs: master weights and the optimizer's state tensors in their dtypes
  (:attr:`~lightning_dos.model.update_rules.Footprint.optimizer_state` bytes per element: 12 for Adam in fp32,
  6 for Adam with bf16 master weights and states, 8 for Lion or Adagrad in fp32; DeepSpeed's own master
  partition becomes a view of them), and a 16-bit staging ring where the 16-bit parameters are not in host
  memory. Registered exactly.

DeepSpeed pins through ``tensor.pin_memory()``: torch's caching host allocator rounds each block up to a power
of two, and keeps it cached after it is freed. With ``DS_PIN_MEMORY_BACKEND=native`` DeepSpeed's own page-aligned
``mlock`` allocator pins whole pages instead. Without CUDA nothing is pinned (DeepSpeed's CPU accelerator
returns the tensor as it is), so nothing is rounded. :func:`pin_backend` tells which applies.

Not counted: the process's baseline (libraries, the model as built, activations), and transients that end
before the first step (DeepSpeed's own master partitions, freed as the engine adopts them, at most about 256 MB
at a time; the pageable source of each ``pin_memory`` copy).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_dos.engine.hostslab import page_rounded
from lightning_dos.engine.pool import BufferPool
from lightning_dos.model.plan import auto_sub_group_size
from lightning_dos.model.update_rules import ADAM, ADAM_FP32, Footprint, UpdateRule

FP32_BYTES = 4
#: ``data_types.grad_accum_dtype`` spellings DeepSpeed accepts, and their dtypes.
GRAD_ACCUM_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def power_of_two_ceil(nbytes: int) -> int:
    """The block torch's caching host allocator hands out for a request of ``nbytes`` (``PowerOf2Ceil``)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def pinned_block_bytes(nbytes: int, backend: str) -> int:
    """Host bytes a pinned buffer of ``nbytes`` really takes under ``backend``.

    Args:
        nbytes: the buffer's own bytes.
        backend: ``"torch"`` (caching host allocator: a power of two), ``"native"`` (DeepSpeed's page-aligned
            allocator: whole pages) or ``"none"`` (not pinned: its bytes).
    """
    if backend == "torch":
        return power_of_two_ceil(nbytes)
    if backend == "native":
        return page_rounded(nbytes)
    if backend == "none":
        return nbytes
    raise ValueError(f"pin backend {backend!r} is not one of 'torch', 'native', 'none'")


def pin_backend(pins_on_cuda: bool, env: Mapping[str, str] = os.environ) -> str:
    """How DeepSpeed's ``pin_memory`` calls pin in this process.

    Args:
        pins_on_cuda: the run trains on CUDA (DeepSpeed's CUDA accelerator pins through torch).
        env: the environment (``DS_PIN_MEMORY_BACKEND=native`` selects DeepSpeed's own allocator, on CPU too).
    """
    if env.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() == "native":
        return "native"
    return "torch" if pins_on_cuda else "none"


def deepspeed_sub_groups(group_numels: Sequence[Sequence[int]], sub_group_size: int | None) -> list[int]:
    """Elements of each DeepSpeed sub-group, as ``_create_fp16_sub_groups`` packs them.

    Args:
        group_numels: per optimizer parameter group, each trainable parameter's partition size on this rank.
        sub_group_size: DeepSpeed's ``zero_optimization.sub_group_size``.
    """
    sizes = []
    for numels in group_numels:
        total = sum(numels)
        if sub_group_size is None or sub_group_size >= total:
            sizes.append(total)
            continue
        current = 0
        for i, numel in enumerate(numels):
            current += numel
            if current >= sub_group_size or i == len(numels) - 1:
                sizes.append(current)
                current = 0
    return sizes


def least_rounded_sub_group_size(
    group_numels: Sequence[Sequence[int]], default: int, grad_bytes: int = FP32_BYTES
) -> int:
    """A DeepSpeed ``sub_group_size`` near ``default`` whose fp32 gradient buffers waste the least when torch pins
    them (each rounded up to a power of two of bytes).

    DeepSpeed closes a sub-group at the parameter that reaches the size, so sub-groups of about ``default``
    elements (1e8: 400 MB, pinned as 512 MiB) waste a third or more. A size of ``2**k`` less the largest
    parameter keeps every sub-group at or under ``2**k`` elements, a power of two of fp32 bytes; the candidates
    are those for 2**24 elements up to the power of two at or above ``default`` (none under 2**23), and
    ``default`` itself; the one with the fewest pinned bytes wins (the largest among equals: fewer flats).

    Args:
        group_numels: per optimizer parameter group, each trainable parameter's partition size on this rank.
        default: the size used otherwise.
        grad_bytes: bytes per element of DeepSpeed's gradient buffers (its master dtype: 4, or 2 under bf16
            master weights; a power of two of elements is then a power of two of bytes as well).
    """
    largest = max((n for numels in group_numels for n in numels), default=0)
    candidates = {default}
    for k in range(24, default.bit_length() + 1):
        size = (1 << k) - largest
        if size >= 1 << 23:
            candidates.add(size)

    def pinned(size: int) -> tuple[int, int]:
        blocks = sum(power_of_two_ceil(grad_bytes * n) for n in deepspeed_sub_groups(group_numels, size))
        return blocks, -size

    return min(candidates, key=pinned)


def engine_host_bytes(
    total_numel: int,
    lp_dtype: torch.dtype,
    lp_on_host: bool,
    largest_sub_group: int | None,
    footprint: Footprint = ADAM_FP32,
) -> int:
    """Host bytes the engine's buffer pool allocates for ``footprint``: master weights and state tensors of every
    element, and the 16-bit staging ring (``BufferPool.ring_shape``) where the 16-bit parameters are not on the
    host. For Adam in fp32 this is ``BufferPool.planned_host_bytes``."""
    slots, slot = BufferPool.ring_shape(total_numel, largest_sub_group, lp_on_host)
    lp_size = torch.empty((), dtype=lp_dtype).element_size()
    return footprint.optimizer_state * total_numel + lp_size * slots * slot


def _dtype_name(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16"}.get(nbytes, f"{8 * nbytes}-bit")


def config_footprint(config: Mapping[str, object], rule: UpdateRule = ADAM) -> Footprint:
    """``rule`` with the master weights' and states' dtypes a DeepSpeed config asks for: bf16 master weights and
    gradients under ``bf16.bf16_master_weights_and_grads``, bf16 states under ``bf16.bf16_optimizer_states``
    (which DeepSpeed accepts only with bf16 master weights), fp32 otherwise.

    Raises ValueError naming the setting for bf16 states without bf16 master weights, as DeepSpeed refuses it.
    """
    bf16 = config.get("bf16") or {}
    enabled = bool(bf16.get("enabled"))
    master = enabled and bool(bf16.get("bf16_master_weights_and_grads"))
    states = enabled and bool(bf16.get("bf16_optimizer_states"))
    if states and not master:
        raise ValueError(
            "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads (DeepSpeed requires it); valid: "
            "both true, or bf16_optimizer_states false"
        )
    return Footprint(rule, 2 if master else 4, 2 if states else 4)


@dataclass
class HostFigure:
    """The pre-flight figure of one rank: each buffer's bytes as it will really be held.

    Attributes:
        items: (what, bytes) per kind of buffer.
        nominal: the same buffers' own bytes, before any rounding.
        backend: how DeepSpeed pins (see :func:`pin_backend`).
    """

    items: list[tuple[str, int]] = field(default_factory=list)
    nominal: int = 0
    backend: str = "none"

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes in self.items)

    def describe(self, params: int) -> str:
        """One line: bytes per parameter of each part."""
        parts = ", ".join(f"{what} {nbytes / max(1, params):.2f}" for what, nbytes in self.items)
        return f"{self.total / max(1, params):.2f} B/param ({parts}; DeepSpeed pins via {self.backend})"


def rank_host_figure(
    group_numels: Sequence[Sequence[int]],
    *,
    lp_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype,
    deepspeed_sub_group_size: int | None,
    engine_sub_group_size: int,
    on_accelerator: bool,
    params_on_host: bool,
    backend: str,
    state_owner: str = "engine",
    footprint: Footprint = ADAM_FP32,
    engine_on_accelerator: bool | None = None,
) -> HostFigure:
    """Host bytes one rank holds once DeepSpeed and the engine have allocated (see the module's docstring).

    Args:
        group_numels: per optimizer parameter group, each trainable parameter's partition size on this rank.
        lp_dtype: the model's (16-bit) dtype.
        grad_accum_dtype: DeepSpeed's gradient-accumulation dtype.
        deepspeed_sub_group_size: DeepSpeed's ``sub_group_size``.
        engine_sub_group_size: the engine's largest sub-group, in elements (its staging-ring slot).
        on_accelerator: training runs on an accelerator (else the engine's device side is the CPU).
        params_on_host: parameter offload to the CPU is on.
        backend: how DeepSpeed pins (:func:`pin_backend`).
        state_owner: ``"engine"`` (its slabs hold master weights and states) or ``"deepspeed"`` (stock offload:
            DeepSpeed's own master partitions and its CPU optimizer's states, not pinned).
        footprint: the optimizer's rule, the master weights' and gradients' bytes per element (DeepSpeed's
            ``master_weights_and_grads_dtype``) and the states' (``bf16_optimizer_states``): DeepSpeed's gradient
            buffers take the master dtype, master weights and states ``footprint.optimizer_state`` bytes per
            element (12 for Adam in fp32).
        engine_on_accelerator: the engine runs an accelerator's path (its 16-bit staging ring), where DeepSpeed
            does not (the simulated accelerator on a CPU); None: ``on_accelerator``.
    """
    total = sum(sum(numels) for numels in group_numels)
    lp_size = torch.empty((), dtype=lp_dtype).element_size()
    accum_size = torch.empty((), dtype=grad_accum_dtype).element_size()
    figure = HostFigure(backend=backend)

    def add(what: str, sizes: list[int]) -> None:
        figure.items.append((what, sum(pinned_block_bytes(n, backend) for n in sizes)))
        figure.nominal += sum(sizes)

    sub_groups = deepspeed_sub_groups(group_numels, deepspeed_sub_group_size)
    add(f"DeepSpeed {_dtype_name(footprint.master)} gradients", [footprint.master * n for n in sub_groups])
    add("DeepSpeed gradient partitions", [accum_size * total])
    if params_on_host and on_accelerator:
        add("DeepSpeed offloaded 16-bit parameters", [lp_size * sum(numels) for numels in group_numels])
    if state_owner == "deepspeed":
        figure.items.append(("DeepSpeed master weights and optimizer states", footprint.optimizer_state * total))
        figure.nominal += footprint.optimizer_state * total
        return figure
    engine_accelerated = on_accelerator if engine_on_accelerator is None else engine_on_accelerator
    engine = engine_host_bytes(
        total, lp_dtype, params_on_host or not engine_accelerated, engine_sub_group_size, footprint=footprint
    )
    figure.items.append(("engine slabs", engine))
    figure.nominal += engine
    return figure


def partition_numels(
    model: torch.nn.Module, param_groups: Sequence[Mapping[str, object]], world_size: int
) -> list[list[int]]:
    """Per optimizer parameter group with trainable parameters, each one's partition size on a rank (ZeRO-3 pads
    a parameter to a multiple of the world size and gives each rank an equal share)."""
    world = max(1, world_size)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    groups = [
        [-(-int(getattr(p, "ds_numel", p.numel())) // world) for p in group["params"] if id(p) in trainable]
        for group in param_groups
    ]
    return [numels for numels in groups if numels]


def figure_for(
    model: torch.nn.Module,
    param_groups: Sequence[Mapping[str, object]],
    config: Mapping[str, object],
    *,
    world_size: int,
    on_accelerator: bool,
    engine_sub_group_size: int | str,
    state_owner: str = "engine",
    env: Mapping[str, str] = os.environ,
    rule: UpdateRule = ADAM,
    footprint: Footprint | None = None,
    engine_on_accelerator: bool | None = None,
) -> HostFigure:
    """:func:`rank_host_figure` for ``model`` trained with ``param_groups`` under DeepSpeed ``config``.

    Args:
        model: the model, before DeepSpeed partitions it (or after: ``ds_numel`` is read where present).
        param_groups: the optimizer's parameter groups (each a mapping with ``"params"``).
        config: the DeepSpeed config as it will be given to ``deepspeed.initialize``.
        world_size: data-parallel ranks the parameters are partitioned over.
        on_accelerator: training runs on CUDA.
        engine_sub_group_size: the engine's sub-group size, or ``"auto"``.
        state_owner: see :func:`rank_host_figure`.
        env: the environment (for ``DS_PIN_MEMORY_BACKEND``).
        rule: the optimizer's update rule (its state tensors are counted), with the dtypes ``config`` asks for
            (:func:`config_footprint`).
        footprint: the rule and dtypes the engine runs, when the caller knows them (overrides ``rule`` and the
            config's dtypes).
        engine_on_accelerator: see :func:`rank_host_figure`.
    """
    group_numels = partition_numels(model, param_groups, world_size)
    per_rank = sum(sum(numels) for numels in group_numels)
    zero = config.get("zero_optimization") or {}
    params_on_host = str((zero.get("offload_param") or {}).get("device", "none")).lower() == "cpu"
    lp_dtype = torch.float32
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled"):
            lp_dtype = dtype
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    return rank_host_figure(
        group_numels,
        lp_dtype=lp_dtype,
        grad_accum_dtype=lp_dtype if accum is None else GRAD_ACCUM_DTYPES.get(str(accum).lower(), torch.float32),
        deepspeed_sub_group_size=zero.get("sub_group_size"),
        engine_sub_group_size=(
            auto_sub_group_size(per_rank) if engine_sub_group_size == "auto" else int(engine_sub_group_size)
        ),
        on_accelerator=on_accelerator,
        params_on_host=params_on_host,
        backend=pin_backend(on_accelerator, env),
        state_owner=state_owner,
        footprint=footprint if footprint is not None else config_footprint(config, rule),
        engine_on_accelerator=engine_on_accelerator,
    )
