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
an accelerator), host sub-groups are worked through while the device pipeline runs.
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass


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


def split_into_sub_groups(
    flat_numels: Sequence[int], flat_param_groups: Sequence[int], sub_group_size: int
) -> list[SubGroup]:
    """Cut DeepSpeed's flat partitions into sub-groups of at most ``sub_group_size`` elements.

    Args:
        flat_numels: element count of each DeepSpeed flat partition, in order.
        flat_param_groups: optimizer param group of each flat partition.
        sub_group_size: largest number of elements per sub-group (must be positive).
    """
    if sub_group_size <= 0:
        raise ValueError(f"sub_group_size must be a positive integer, got {sub_group_size}")
    groups: list[SubGroup] = []
    slab_offset = 0
    for ds_group, (numel, param_group) in enumerate(zip(flat_numels, flat_param_groups, strict=True)):
        for start in range(0, numel, sub_group_size):
            size = min(sub_group_size, numel - start)
            groups.append(SubGroup(len(groups), ds_group, start, size, param_group, slab_offset + start))
        slab_offset += numel
    return groups


@dataclass(frozen=True)
class Plan:
    """Placement of every sub-group for one iteration.

    Attributes:
        places: one :class:`Place` per sub-group, indexed like the engine's sub-group list.
        device_buffers: how many device staging buffers the pipeline may keep in flight (>= 1
            when any sub-group is placed on the device).
    """

    places: tuple[Place, ...]
    device_buffers: int = 2

    def indices(self, *places: Place) -> list[int]:
        """Indices of the sub-groups placed at any of ``places``, in plan order."""
        return [i for i, p in enumerate(self.places) if p in places]

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
        return Plan(tuple(Place.HOST if i in moved else p for i, p in enumerate(self.places)), self.device_buffers)


def all_host(n: int) -> Plan:
    """A plan that updates every one of ``n`` sub-groups on the host (stock ZeRO-Offload placement)."""
    return Plan((Place.HOST,) * n)


def even_plan(n: int, fraction: float, device_buffers: int = 2) -> Plan:
    """Place ``round(fraction * n)`` of ``n`` sub-groups on the device, spread evenly.

    Spreading keeps device and host work interleaved through the whole partition, so neither side
    starts late; ``fraction = 1/k`` gives the same count as the paper's stride ``k``.
    """
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

    def plan(self, n: int, device_buffers: int = 2) -> Plan:
        """The fixed plan this spec gives for ``n`` sub-groups (``"auto"`` is resolved elsewhere)."""
        if self.mode == "stride":
            return stride_plan(n, self.stride, device_buffers)
        if self.mode == "fixed":
            return even_plan(n, self.fraction, device_buffers)
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
