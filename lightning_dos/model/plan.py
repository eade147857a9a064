"""Sub-groups and placement plans: which slice of the optimizer state is updated where.

A *sub-group* is a contiguous slice of the rank's flat fp32 partition. Adam is element-wise, so the
engine is free to cut DeepSpeed's flat partitions into chunks of its own, as long as a chunk never
spans two optimizer param groups (their hyperparameters differ).

A *plan* says, for every sub-group, where it is updated this iteration:

- ``HOST``: Adam runs on the CPU over pinned host state; the 16-bit copy is cast on the CPU into a
  pinned staging buffer and uploaded asynchronously.
- ``DEVICE``: the fp32 state streams up to the accelerator, Adam and the 16-bit cast run there, and
  the updated fp32 state streams back down (the paper's interleaved offload).
- ``RESIDENT``: the fp32 state stays on the accelerator across iterations (TwinFlow's idea, but
  chosen per iteration): only the gradient goes up, nothing comes down. It costs device memory all
  the time, so the budget decides.

The plan also fixes the order: device sub-groups are launched first (their work is asynchronous on
an accelerator), host sub-groups are worked through while the device pipeline runs, each kind in the
order the next forward needs them (``Plan.order``).
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


class Place(enum.IntEnum):
    """Where a sub-group is updated in one iteration."""

    HOST = 0
    DEVICE = 1
    RESIDENT = 2


@dataclass(frozen=True)
class SubGroup:
    """One contiguous slice of the rank's fp32 optimizer partition.

    Attributes:
        index: position of this sub-group in the engine's list.
        ds_group: index of the DeepSpeed sub-group (flat partition) it was cut from.
        ds_offset: first element of the slice inside that DeepSpeed flat partition.
        numel: number of elements.
        param_group: optimizer param group whose hyperparameters apply.
        slab_offset: first element of the slice inside the engine's pinned slabs.
    """

    index: int
    ds_group: int
    ds_offset: int
    numel: int
    param_group: int
    slab_offset: int


#: ``sub_group_size="auto"``: the paper's size is the ceiling (larger sub-groups only coarsen placement) ...
MAX_AUTO_SUB_GROUP = 100_000_000
#: ... and sub-groups are never cut smaller than this: each sub-group costs some fixed work (kernel launches,
#: events, Python; tens of microseconds), and 1M elements keep it small next to its Adam (~0.7 ms at 1.5 G
#: elements/s on a CPU) or its streaming (28 MB, ~1 ms at 25 GB/s).
MIN_AUTO_SUB_GROUP = 1 << 20
#: How many sub-groups "auto" aims for: placement in steps of ~3% of the partition.
AUTO_SUB_GROUPS = 32


def auto_sub_group_size(partition_numel: int) -> int:
    """The ``sub_group_size`` that ``"auto"`` chooses for a rank's partition of ``partition_numel`` elements.

    About :data:`AUTO_SUB_GROUPS` sub-groups, so a share of the update can be placed finely, but none
    smaller than :data:`MIN_AUTO_SUB_GROUP` elements nor larger than :data:`MAX_AUTO_SUB_GROUP`.
    """
    wanted = math.ceil(max(1, partition_numel) / AUTO_SUB_GROUPS)
    return int(min(MAX_AUTO_SUB_GROUP, max(MIN_AUTO_SUB_GROUP, wanted)))


#: Sub-group boundaries fall on multiples of this many elements (256 bytes of fp32) whenever sub-groups hold
#: at least as many: the fused Adam kernels' vector lanes then line up the same whatever the cut, so the result
#: is bitwise the same as updating each flat partition whole (unaligned cuts differ in the last bit).
ALIGN_ELEMENTS = 64


def split_into_sub_groups(
    flat_numels: Sequence[int], flat_param_groups: Sequence[int], sub_group_size: int
) -> list[SubGroup]:
    """Cut DeepSpeed's flat partitions into near-equal sub-groups of about ``sub_group_size`` elements at most.

    A flat of ``numel`` elements becomes ``ceil(numel / sub_group_size)`` pieces of near-equal size, not
    full-size pieces plus a small remainder (which a placement would then pick unevenly). With
    ``sub_group_size >= ALIGN_ELEMENTS`` every cut falls on a multiple of :data:`ALIGN_ELEMENTS`: sizes then
    differ by at most that many elements and may exceed ``sub_group_size`` by less than that many; below it,
    sizes differ by at most one element and never exceed it.

    Args:
        flat_numels: element count of each DeepSpeed flat partition, in order.
        flat_param_groups: optimizer param group of each flat partition.
        sub_group_size: largest number of elements per sub-group (must be positive).
    """
    if sub_group_size <= 0:
        raise ValueError(f"sub_group_size must be a positive integer, got {sub_group_size}")
    align = ALIGN_ELEMENTS if sub_group_size >= ALIGN_ELEMENTS else 1
    groups: list[SubGroup] = []
    slab_offset = 0
    for ds_group, (numel, param_group) in enumerate(zip(flat_numels, flat_param_groups, strict=True)):
        units = math.ceil(numel / align)  # whole aligned blocks, the last one possibly short
        pieces = min(max(1, math.ceil(numel / sub_group_size)), max(1, units))
        base, extra = divmod(units, pieces)
        start = 0
        for piece in range(pieces):
            # The larger pieces come last: the last one holds the short final block, keeping sizes near-equal.
            size = min((base + (1 if piece >= pieces - extra else 0)) * align, numel - start)
            if size <= 0:
                continue
            groups.append(SubGroup(len(groups), ds_group, start, size, param_group, slab_offset + start))
            start += size
        slab_offset += numel
    return groups


@dataclass(frozen=True)
class Plan:
    """Placement of every sub-group for one iteration.

    Attributes:
        places: one :class:`Place` per sub-group, indexed like the engine's sub-group list.
        device_buffers: how many device staging buffers the pipeline may keep in flight (>= 1
            when any sub-group is placed on the device).
        after_backward: host sub-groups that ``overlap="auto"`` leaves for after backward, updated with the rest
            of the step instead of as soon as their gradients are final. The CPU can update only part of the
            partition during backward, and backward makes the last sub-groups final first: updating whichever
            comes first would leave the next forward waiting for every other sub-group before it can run through
            the last ones, so the planner spreads the CPU's work during backward over the whole partition (the
            forward then finds something ready all along). Ignored by every other mode.
        order: the sub-groups in the order the next forward needs them (its first all-gather's first; recorded by
            the framework in the first forward, :mod:`lightning_dos.model.need_order`), which backward makes final
            in reverse. The engine launches device work, runs host work and lands 16-bit results in this order.
            Empty: index order (nothing recorded).
    """

    places: tuple[Place, ...]
    device_buffers: int = 2
    after_backward: frozenset[int] = field(default=frozenset())
    order: tuple[int, ...] = ()

    @property
    def sequence(self) -> tuple[int, ...]:
        """Every sub-group in the order the next forward needs them (:attr:`order`; index order when empty)."""
        return self.order or tuple(range(len(self.places)))

    def indices(self, *places: Place) -> list[int]:
        """Indices of the sub-groups placed at any of ``places``, in :attr:`sequence`."""
        return [i for i in self.order or range(len(self.places)) if self.places[i] in places]

    def in_order(self, order: Sequence[int]) -> Plan:
        """The same placement taken in ``order`` (empty: index order); ``order`` must hold every sub-group once."""
        order = tuple(order)
        if order == self.order:  # every step, for the plan in force: nothing to check again
            return self
        if order and sorted(order) != list(range(len(self.places))):
            raise ValueError(f"an order of {len(self.places)} sub-groups must hold each once, got {order}")
        return replace(self, order=order)

    @property
    def device_indices(self) -> list[int]:
        return self.indices(Place.DEVICE, Place.RESIDENT)

    @property
    def streamed_indices(self) -> list[int]:
        return self.indices(Place.DEVICE)

    @property
    def resident_indices(self) -> list[int]:
        return self.indices(Place.RESIDENT)

    @property
    def host_indices(self) -> list[int]:
        return self.indices(Place.HOST)

    def device_share(self, sizes: Sequence[int] | None = None) -> float:
        """Share of sub-groups (or of elements, when ``sizes`` is given) updated on the device."""
        if not self.places:
            return 0.0
        if sizes is None:
            return len(self.device_indices) / len(self.places)
        total = sum(sizes)
        return sum(sizes[i] for i in self.device_indices) / total if total else 0.0

    def with_host(self, indices: Sequence[int]) -> Plan:
        """The same plan with ``indices`` moved to the host (used when device memory runs short)."""
        moved = set(indices)
        return replace(self, places=tuple(Place.HOST if i in moved else p for i, p in enumerate(self.places)))


def all_host(n: int) -> Plan:
    """A plan that updates every one of ``n`` sub-groups on the host (stock ZeRO-Offload placement)."""
    return Plan((Place.HOST,) * n)


def even_plan(n: int, fraction: float, device_buffers: int = 2, sizes: Sequence[int] | None = None) -> Plan:
    """Place a ``fraction`` of ``n`` sub-groups (of their elements, when ``sizes`` is given) on the device,
    spread evenly.

    Spreading keeps device and host work interleaved through the whole partition, so neither side
    starts late; ``fraction = 1/k`` gives the same count as the paper's stride ``k``. With ``sizes``,
    ``fraction`` is a share of elements: walking the sub-groups in order, each goes to the device when
    that brings the elements placed so far closer to ``fraction`` of the elements seen so far, so the
    total lands within half a sub-group of the asked share.
    """
    if sizes is not None:
        if len(sizes) != n:
            raise ValueError(f"even_plan got {len(sizes)} sizes for {n} sub-groups")
        places = [Place.HOST] * n
        seen = placed = 0
        for i, size in enumerate(sizes):
            seen += size
            if placed + size / 2 < fraction * seen:  # a tie stays on the host, as with equal sizes above
                places[i] = Place.DEVICE
                placed += size
        return Plan(tuple(places), device_buffers)
    count = round(fraction * n)
    places = [Place.HOST] * n
    for j in range(count):
        # The j-th device slot sits at the end of the j-th of `count` equal stretches.
        places[min(n - 1, math.floor((j + 1) * n / count) - 1)] = Place.DEVICE
    return Plan(tuple(places), device_buffers)


def stride_plan(n: int, k: int, device_buffers: int = 2) -> Plan:
    """The paper's rule: sub-group ``x`` is updated on the device when ``(x + 1) % k == 0``."""
    return Plan(tuple(Place.DEVICE if (x + 1) % k == 0 else Place.HOST for x in range(n)), device_buffers)


def random_plan(
    n: int, rng: random.Random, device_buffers: int = 2, places: Sequence[Place] = (Place.HOST, Place.DEVICE)
) -> Plan:
    """A random placement over ``places`` (tests use it to show that placement never changes the result)."""
    return Plan(tuple(rng.choice(tuple(places)) for _ in range(n)), device_buffers)


@dataclass(frozen=True)
class FractionSpec:
    """A parsed ``gpu_fraction`` setting.

    Attributes:
        mode: ``"auto"`` (the performance model chooses), ``"fixed"`` (a share in [0, 1], spread
            evenly) or ``"stride"`` (the paper's rule with ``stride``).
        fraction: the share for ``"fixed"``.
        stride: ``K`` for ``"stride"``.
    """

    mode: str
    fraction: float = 0.0
    stride: int = 0

    def plan(self, n: int, device_buffers: int = 2, sizes: Sequence[int] | None = None) -> Plan:
        """The fixed plan this spec gives for ``n`` sub-groups (``"auto"`` is resolved elsewhere).

        With ``sizes`` (elements per sub-group), a fixed fraction is a share of elements."""
        if self.mode == "stride":
            return stride_plan(n, self.stride, device_buffers)
        if self.mode == "fixed":
            return even_plan(n, self.fraction, device_buffers, sizes)
        raise ValueError("an 'auto' gpu_fraction is resolved by the performance model, not by a fixed rule")


_STRIDE = re.compile(r"^stride:(\d+)$")
VALID_GPU_FRACTION = "'auto', a number in [0, 1], or 'stride:K' with an integer K >= 1"


def parse_gpu_fraction(value: float | int | str) -> FractionSpec:
    """Validate and parse a ``gpu_fraction`` setting; raise ``ValueError`` naming what is valid."""
    if isinstance(value, bool):
        raise ValueError(f"gpu_fraction={value!r} is not valid; use {VALID_GPU_FRACTION}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return FractionSpec("auto")
        match = _STRIDE.match(text)
        if match and int(match.group(1)) >= 1:
            return FractionSpec("stride", stride=int(match.group(1)))
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"gpu_fraction={value!r} is not valid; use {VALID_GPU_FRACTION}") from None
    if isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= float(value) <= 1.0:
        return FractionSpec("fixed", fraction=float(value))
    raise ValueError(f"gpu_fraction={value!r} is not valid; use {VALID_GPU_FRACTION}")


#: How far (in share of elements) a fixed placement may land from the asked one before it is warned about.
SHARE_TOLERANCE = 0.1


def coarse_share_warning(
    spec: FractionSpec, sizes: Sequence[int], sub_group_size: int, auto: bool = False
) -> str | None:
    """A warning when ``sub_group_size`` makes a fixed ``gpu_fraction`` impossible to honour, else None.

    The device share a fixed spec gets over sub-groups of ``sizes`` is compared with the asked one (``1/K``
    for ``stride:K``); when it is more than :data:`SHARE_TOLERANCE` off, the message names the size to use.
    ``auto`` says that ``sub_group_size`` was chosen by ``"auto"``.
    """
    if spec.mode == "auto" or not sizes:
        return None
    asked = spec.fraction if spec.mode == "fixed" else 1.0 / spec.stride
    if asked in (0.0, 1.0):
        return None
    got = spec.plan(len(sizes), sizes=sizes).device_share(sizes)
    if abs(got - asked) <= SHARE_TOLERANCE:
        return None
    total = sum(sizes)
    suggested = auto_sub_group_size(total)
    if suggested >= sub_group_size or suggested >= total:  # a partition too small for "auto" to split
        suggested = math.ceil(total / math.ceil(1 / SHARE_TOLERANCE))  # enough pieces to land within tolerance
    size_text = f"'auto' ({sub_group_size:,})" if auto else f"{sub_group_size:,}"
    setting = f"gpu_fraction={spec.fraction:g}" if spec.mode == "fixed" else f"gpu_fraction='stride:{spec.stride}'"
    return (
        f"{setting} asks for {asked:.0%} of the update on the device, but sub_group_size={size_text} cuts "
        f"this rank's {total:,} elements into {len(sizes)} sub-group(s), so {got:.0%} is placed; use "
        f"sub_group_size={suggested} for a finer split"
    )
