"""Where each sub-group's master weights and optimizer state live between and during updates.

Every sub-group has a *home span* in the engine's host slabs (what DeepSpeed's views see). A committed speculative
update leaves its state in a spare slot instead (:mod:`~lightning_dos.engine.speculation`) until it is brought home.
With the NVMe tier, the slabs' tail lives in a swap file (:class:`~lightning_dos.engine.file_backed.FileBackedHomes`).
:class:`SlabHomes` is the first case; the file-backed one extends it, and the rest of the engine asks one of them
where a sub-group's state is: the tier plugs in here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.pool import BufferPool
from lightning_dos.engine.speculation import SpareSlabs
from lightning_dos.model.plan import Plan, SubGroup


class SlabHomes:
    """Sub-groups' state in the host slabs, or in spare slots (the state of committed speculative updates).

    Args:
        pool: the engine's buffers (its host slabs).
        sub_groups: the engine's sub-groups.
        spare: the spare slots speculative updates write into.
    """

    #: The NVMe tier (None: every sub-group's state is in host memory).
    files = None

    def __init__(self, pool: BufferPool, sub_groups: Sequence[SubGroup], spare: SpareSlabs) -> None:
        self.pool = pool
        self.sub_groups = sub_groups
        self.spare = spare

    def reserve_spare(self, slots: int, lp_dtype: torch.dtype) -> SpareSlabs:
        """Replace the spare slots by ``slots`` new ones (each the largest sub-group's state and 16-bit result); held
        state comes home first. Return them."""
        self.bring_home(list(self.spare.held))
        states = tuple(state.dtype for state in self.pool.states)
        capacity = max((sg.numel for sg in self.sub_groups), default=0)
        self.spare = SpareSlabs(slots, capacity, self.pool.param.dtype, states, lp_dtype)
        return self.spare

    def span(self, sg: SubGroup) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Sub-group ``sg``'s span of the host slabs: master weights and states."""
        span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
        return self.pool.param[span], tuple(state[span] for state in self.pool.states)

    def home(self, sg: SubGroup) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Where sub-group ``sg``'s state is when no spare slot holds it: its span."""
        return self.span(sg)

    def slices(
        self, sg: SubGroup, inputs: StepInputs
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """A sub-group's current master weights and states (a spare slot's when it is held there), gradient and 16-bit
        target."""
        local = slice(sg.ds_offset, sg.ds_offset + sg.numel)
        param, states = self.spare.current(sg.index, *self.home(sg))
        return param, states, inputs.grads[sg.ds_group][local], inputs.lp_targets[sg.ds_group][local]

    @property
    def off_slabs(self) -> bool:
        """Some sub-group's current state may not be in its span (held in a spare slot, or in a file)."""
        return bool(self.spare.held)

    def bring_home(self, indices: Sequence[int]) -> None:
        """Copy the state of these sub-groups held in spare slots (committed speculative updates) back to their spans
        (no update may be in flight: the copy is the host's, after every step's end)."""
        for index in indices:
            if index in self.spare.held:
                self.spare.bring_home(index, *self.home(self.sub_groups[index]))

    def spans_written(self, indices: Sequence[int] | None = None) -> None:
        """These sub-groups' spans (None: all) were just overwritten (a checkpoint load, an accessor's write): state
        held in spare slots is forgotten, the spans' is current."""
        for index in list(self.spare.held) if indices is None else [i for i in indices if i in self.spare.held]:
            self.spare.forget(index)

    # -- the file tier's points, which host slabs do not need --------------------------------------------------

    def file_backed(self, index: int) -> bool:
        """Whether sub-group ``index``'s state lives in a file between updates."""
        return False

    def placed(self, plan: Plan) -> Plan:
        """``plan`` as this home allows it (the tier's sub-groups are never resident)."""
        return plan

    def host_order(self, plan: Plan, step: int, files_order: str) -> list[int]:
        """The order step ``step`` (counted from 1) updates ``plan``'s host sub-groups in: the plan's."""
        return plan.host_indices

    def begin(self, plan: Plan, order: Sequence[int], early: Sequence[int], files_order: str) -> None:
        """A step's update begins, streamed sub-groups first, then host ones in ``order``, less ``early`` (updated
        during backward)."""

    def load_streamed(self, index: int) -> None:
        """Streamed sub-group ``index`` is about to be uploaded from its home."""

    def load_host(self, index: int) -> None:
        """Host sub-group ``index`` is about to be updated in its home."""

    def done_with(self, index: int) -> None:
        """The update is done with sub-group ``index``'s state."""

    def download_issued(self, index: int, landed: object) -> None:
        """Streamed sub-group ``index``'s state comes home at event ``landed``."""

    def settle(self) -> None:
        """The update is over: its state is home."""

    def materialize(self, indices: Sequence[int] | None = None) -> None:
        """Make these sub-groups' (None: all) spans hold their state, for a reader of the slabs."""

    def release_copies(self) -> None:
        """Give back what :meth:`materialize` loaded only to be read."""

    def close(self) -> None:
        """Release what the home holds beyond the slabs (teardown)."""
