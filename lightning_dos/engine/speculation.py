"""Spare host slabs for speculative updates: a sub-group updated during backward before the step's gradient
scale is known keeps its untouched state here until backward's end says whether the guess was right.

With gradient clipping (or fp16 loss scaling) a sub-group's update needs the global gradient norm, which only
the end of backward knows. DeepSpeed's clip coefficient is clamped at 1 (``stage3.py`` ``unscale_and_clip_grads``),
so on every step whose norm is under the threshold the gradient is multiplied by exactly ``1 / loss_scale``, and
an update computed with that factor before the norm was known is bit-identical to the one computed after. The
engine therefore updates host sub-groups during backward with that guess (*speculates*), after copying their
master weights and optimizer state here. When backward ends:

- the real factor equals the guess: the speculative update *is* the step's update; it is committed (the 16-bit
  result kept here is written to the parameters) and the copies are simply dropped;
- it does not (the step is clipped, or the loss scale moved): each speculated sub-group is restored from its
  copy, bit for bit, and updated again with the real factor in the normal schedule after backward;
- the step is skipped (overflow, a non-finite norm) or backward failed: every speculated sub-group is restored.

Nothing speculative is visible meanwhile: the 16-bit parameters are written only at a commit, and the framework
refuses readers of the optimizer state between backward and the step (a reader that must go on, an exception
handler or teardown, abandons the step, which restores the copies first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SpareSlabs:
    """A fixed number of slots, each able to hold one sub-group's untouched master weights and state tensors and
    its speculative 16-bit result.

    Args:
        slots: how many sub-groups may be speculated at once (0: speculation is off).
        capacity: elements per slot (the largest sub-group).
        master_dtype: dtype of the master weights.
        state_dtypes: dtype of each of the rule's state tensors, in the pool's order.
        lp_dtype: dtype of the 16-bit parameters.
    """

    def __init__(
        self,
        slots: int,
        capacity: int,
        master_dtype: torch.dtype,
        state_dtypes: Sequence[torch.dtype],
        lp_dtype: torch.dtype,
    ) -> None:
        if slots < 0:
            raise ValueError(f"slots={slots} must be non-negative")
        self.capacity = capacity
        dtypes = (master_dtype, *state_dtypes, lp_dtype)
        # Allocated once, up front: host memory the run takes at start-up, never in the middle of a step.
        self._slots = [tuple(torch.empty(capacity, dtype=dtype) for dtype in dtypes) for _ in range(slots)]
        self._free = list(range(slots))
        #: Speculated sub-groups and the slot holding their untouched state, in the order they were speculated.
        self.held: dict[int, int] = {}

    @staticmethod
    def slot_bytes(
        capacity: int, master_dtype: torch.dtype, state_dtypes: Sequence[torch.dtype], lp_dtype: torch.dtype
    ) -> int:
        """Host bytes one slot of ``capacity`` elements holds."""
        dtypes = (master_dtype, *state_dtypes, lp_dtype)
        return capacity * sum(torch.empty((), dtype=dtype).element_size() for dtype in dtypes)

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self._slots for t in slot)

    def save(self, index: int, param: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Copy sub-group ``index``'s untouched master weights and states into a free slot and return the slot's
        16-bit buffer for its speculative result; None when every slot is taken (the sub-group is not speculated)."""
        if not self._free or param.numel() > self.capacity:
            return None
        slot = self._free.pop()
        master, *saved, lp = self._slots[slot]
        n = param.numel()
        master[:n].copy_(param)
        for copy, state in zip(saved, states, strict=True):
            copy[:n].copy_(state)
        self.held[index] = slot
        return lp[:n]

    def restore(self, index: int, param: torch.Tensor, states: Sequence[torch.Tensor]) -> None:
        """Put sub-group ``index``'s untouched master weights and states back, bit for bit, and free its slot."""
        slot = self.held.pop(index)
        master, *saved, _ = self._slots[slot]
        n = param.numel()
        param.copy_(master[:n])
        for copy, state in zip(saved, states, strict=True):
            state.copy_(copy[:n])
        self._free.append(slot)

    def speculative_lp(self, index: int, numel: int) -> torch.Tensor:
        """Sub-group ``index``'s speculative 16-bit result."""
        return self._slots[self.held[index]][-1][:numel]

    def drop(self, index: int) -> None:
        """The speculation of sub-group ``index`` was committed: its untouched copy is no longer needed."""
        self._free.append(self.held.pop(index))
