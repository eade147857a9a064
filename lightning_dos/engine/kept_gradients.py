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


class GradientHandoff:
    """Backward's hand-over of gradients to the engine (a part of :class:`~lightning_dos.engine.loop.InterleavedUpdate`,
    which holds ``kept``, ``resident``, ``sub_groups`` and ``_backward_ends``)."""

    kept: KeptGradients
    resident: dict[int, DeviceBuffer]
    sub_groups: list[SubGroup]
    _backward_ends: list[object]

    def keep_gradient(self, flat: int, offset: int, grad: torch.Tensor) -> None:
        """Backward made ``grad`` final: the gradient of elements ``[offset, offset + grad.numel())`` of flat
        partition ``flat``, on the device (DeepSpeed's reduced partition at the accumulation boundary). Copy the
        part each resident sub-group holds into that sub-group's device gradient slot, on the caller's current
        stream, so that the step reads it there and does not upload the host copy (which DeepSpeed still makes:
        a sub-group the step moves home, or finishes on the host after a failure, reads that one).

        A sub-group uses its kept gradient only if this backward wrote every one of its elements into the buffer
        it still has at the step (padding or a parameter without a gradient leave it to the host copy); the
        end-of-backward event on that stream (:meth:`backward_ended`) orders these copies before the update reads
        them."""
        self.kept.keep(flat, offset, grad, self.resident)

    def backward_ended(self, event: object) -> None:
        """Backward has issued its last gradient copy (into the host buffers, or a kept gradient into a resident
        sub-group's device slot, :meth:`keep_gradient`), and ``event`` was recorded after it on the stream it was
        issued on (DeepSpeed's reduce stream): the next step waits for ``event`` before it reads any gradient, and
        for nothing else queued on the device. None: the copies are complete already (a synchronous device). Called
        after every backward; the step waits for every event handed over since the last step."""
        if event is not None:
            self._backward_ends.append(event)

    def discard_kept_gradients(self) -> None:
        """Forget the gradients kept so far (a new backward begins, or a step was skipped)."""
        self.kept.forget()

    @property
    def kept_gradient_slots(self) -> list[torch.Tensor]:
        """The device gradient slots :meth:`keep_gradient` wrote since the last step (a race checker models those
        writes on the framework's stream)."""
        return self.kept.slots(self.resident)

    def sub_groups_of(self, flat: int, offset: int, numel: int) -> list[int]:
        """Indices of the sub-groups overlapping elements ``[offset, offset + numel)`` of flat partition ``flat``."""
        return sub_groups_of(self.sub_groups, flat, offset, numel)
