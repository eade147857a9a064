"""Spare host slabs for speculative updates: a sub-group updated during backward, before the step's gradient
scale is known, writes its result into a spare slot and leaves its current state untouched until backward's end
says whether the guess was right.

With gradient clipping (or fp16 loss scaling) a sub-group's update needs the global gradient norm, which only
the end of backward knows. DeepSpeed's clip coefficient is clamped at 1 (``stage3.py`` ``unscale_and_clip_grads``),
so on every step whose norm is under the threshold the gradient is multiplied by exactly ``1 / loss_scale``, and
an update computed with that factor before the norm was known is bit-identical to the one computed after. The
engine therefore updates host sub-groups during backward with that guess (*speculates*), out of place: the
update reads the sub-group's current master weights and state and writes the new ones elsewhere, in one pass
(dearer than in place all the same: the CPU reads each line it writes first). A sub-group's state lives in one
of two places, its span of the engine's slabs (*home*, where DeepSpeed's views see it) or a spare slot (*held*),
and a speculative update always writes into the other one: a free slot for a sub-group at home, its home span
for a held one. When backward ends:

- the real factor equals the guess: the speculative update *is* the step's update; it is committed by swapping
  which of the two places is current (no copy), and its 16-bit result, kept in the slot, is written to the
  parameters;
- it does not (the step is clipped, or the loss scale moved): the current state was never touched; the
  speculative result is dropped, and the sub-group is updated again with the real factor after backward;
- the step is skipped (overflow, a non-finite norm) or backward failed: every speculative result is dropped.

Held state is like state resident on the device: before anything reads or writes the slabs through DeepSpeed's
views (a checkpoint, an accessor), :meth:`SpareSlabs.bring_home` copies it back (the adapter's readers call it
through ``flush_resident``), and a load into the slabs forgets it (:meth:`SpareSlabs.forget`). Nothing
speculative is visible meanwhile: the 16-bit parameters are written only at a commit, and the framework refuses
readers of the optimizer state between backward and the step (a reader that must go on, an exception handler or
teardown, abandons the step, which drops every speculative result first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Where a speculative result is written for a held sub-group: its home span of the slabs.
HOME = -1


class SpareSlabs:
    """A fixed number of slots, each able to hold one sub-group's master weights and state tensors and a 16-bit
    result.

    Args:
        slots: how many slots (0: speculation is off).
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
        # Allocated once, up front, and written (zeros): host memory the run takes at start-up, never in the middle of
        # a step. torch.empty's pages would become resident only when a speculation first writes them, which may be
        # many steps in (how many sub-groups backward leaves time for varies), so a node short of memory would fail
        # then rather than here, and the pre-flight figure would not be what the run holds.
        self._slots = [tuple(torch.zeros(capacity, dtype=dtype) for dtype in dtypes) for _ in range(slots)]
        self._free = list(range(slots))
        #: Sub-groups whose current state is in a slot (a committed speculation), and that slot.
        self.held: dict[int, int] = {}
        #: Sub-groups speculated in the step under way, and the slot their result went to (:data:`HOME` for a
        #: held sub-group, whose result went to its home span; its 16-bit result is in its own slot).
        self.pending: dict[int, int] = {}
        #: Pending sub-groups whose 16-bit result went straight into a slot of the engine's staging ring instead of
        #: their spare slot (that ring slot, and its view), so that the commit uploads it without a copy.
        self.staged: dict[int, tuple[int, torch.Tensor]] = {}

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

    def current(
        self, index: int, param: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Sub-group ``index``'s current master weights and states: its slot's when held, else ``param`` and
        ``states`` (its home span of the slabs)."""
        slot = self.held.get(index)
        if slot is None:
            return param, tuple(states)
        master, *saved, _ = self._slots[slot]
        n = param.numel()
        return master[:n], tuple(copy[:n] for copy in saved)

    def begin(
        self, index: int, param: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor] | None:
        """Where sub-group ``index``'s speculative update writes (master weights, states, 16-bit result), given its
        home span ``param`` and ``states``: its home span when it is held, else a free slot; None when no slot is
        free (the sub-group is not speculated)."""
        n = param.numel()
        if index in self.held:
            self.pending[index] = HOME
            return param, tuple(states), self._slots[self.held[index]][-1][:n]
        if not self._free or n > self.capacity:
            return None
        slot = self._free.pop()
        self.pending[index] = slot
        master, *saved, lp = self._slots[slot]
        return master[:n], tuple(copy[:n] for copy in saved), lp[:n]

    def speculative_lp(self, index: int, numel: int) -> torch.Tensor:
        """Sub-group ``index``'s speculative 16-bit result."""
        slot = self.pending[index]
        return self._slots[self.held[index] if slot == HOME else slot][-1][:numel]

    def commit(self, index: int) -> None:
        """Sub-group ``index``'s speculative result becomes its current state (its 16-bit result is read first)."""
        slot = self.pending.pop(index)
        if slot == HOME:
            self._free.append(self.held.pop(index))
        else:
            self.held[index] = slot

    def discard(self, index: int) -> None:
        """Drop sub-group ``index``'s speculative result; its current state is as it was."""
        slot = self.pending.pop(index)
        if slot != HOME:
            self._free.append(slot)

    def bring_home(self, index: int, param: torch.Tensor, states: Sequence[torch.Tensor]) -> None:
        """Copy held sub-group ``index``'s state to its home span ``param`` and ``states`` and free its slot."""
        master, saved = self.current(index, param, states)
        param.copy_(master)
        for state, copy in zip(states, saved, strict=True):
            state.copy_(copy)
        self._free.append(self.held.pop(index))

    def forget(self, index: int) -> None:
        """Free held sub-group ``index``'s slot without a copy: its home span was just written (a load)."""
        self._free.append(self.held.pop(index))
