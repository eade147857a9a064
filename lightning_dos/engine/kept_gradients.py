"""Gradients backward made final on the device for resident sub-groups, kept there for the step.

A resident sub-group's optimizer state lives on the device between steps; uploading its gradient from DeepSpeed's
host copy would move bytes that are already on the device. So as backward makes a stretch of a flat partition
final, the part a resident sub-group holds is copied into that sub-group's device gradient slot, and the step reads
it there when every element of the sub-group was kept in the buffer it still has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lightning_dos.engine.pool import DeviceBuffer
from lightning_dos.model.plan import SubGroup


def sub_groups_of(sub_groups: Sequence[SubGroup], flat: int, offset: int, numel: int) -> list[int]:
    """Indices of the sub-groups overlapping elements ``[offset, offset + numel)`` of flat partition ``flat``."""
    return [
        sg.index
        for sg in sub_groups
        if sg.ds_group == flat and sg.ds_offset < offset + numel and offset < sg.ds_offset + sg.numel
    ]


class KeptGradients:
    """Which resident sub-groups' device gradient slots backward has written, and how much of each.

    Args:
        sub_groups: the engine's sub-groups.
    """

    def __init__(self, sub_groups: Sequence[SubGroup]) -> None:
        self.sub_groups = sub_groups
        #: Per sub-group: the buffer its gradient was kept in, and how many of its elements were.
        self._kept: dict[int, tuple[DeviceBuffer, int]] = {}

    def keep(self, flat: int, offset: int, grad: torch.Tensor, resident: Mapping[int, DeviceBuffer]) -> None:
        """Copy the part of ``grad`` (elements ``[offset, offset + grad.numel())`` of flat partition ``flat``) each
        ``resident`` sub-group holds into its device gradient slot, on the caller's current stream."""
        n = grad.numel()
        for index in sub_groups_of(self.sub_groups, flat, offset, n):
            buf = resident.get(index)
            if buf is None:
                continue
            sg = self.sub_groups[index]
            lo, hi = max(offset, sg.ds_offset), min(offset + n, sg.ds_offset + sg.numel)
            buf.grad[lo - sg.ds_offset : hi - sg.ds_offset].copy_(grad[lo - offset : hi - offset], non_blocking=True)
            kept_in, count = self._kept.get(index, (buf, 0))
            self._kept[index] = (buf, (count if kept_in is buf else 0) + hi - lo)

    def forget(self, index: int | None = None) -> None:
        """Forget sub-group ``index``'s kept gradient (None: every one)."""
        if index is None:
            self._kept.clear()
        else:
            self._kept.pop(index, None)

    def slots(self, resident: Mapping[int, DeviceBuffer]) -> list[torch.Tensor]:
        """The device gradient slots written since the last step, of buffers still resident."""
        return [buf.grad for index, (buf, _) in self._kept.items() if resident.get(index) is buf]

    def gradient(self, index: int, resident: Mapping[int, DeviceBuffer]) -> torch.Tensor | None:
        """Sub-group ``index``'s gradient, if this backward kept all of it in the buffer it has now."""
        buf = resident.get(index)
        kept = self._kept.get(index)
        numel = self.sub_groups[index].numel
        if buf is None or kept is None or kept[0] is not buf or kept[1] != numel:
            return None
        return buf.grad[:numel]
