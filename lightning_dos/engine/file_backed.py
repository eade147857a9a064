"""File-backed sub-groups in the update: the NVMe tier's part of the engine.

:class:`~lightning_dos.engine.file_tier.FileTier` moves records between the swap file, its page-locked staging slabs
and the host slabs; this home decides, for each placement, where a file-backed sub-group's state lives while the
update uses it, and when it goes back to its file:

- a **host** sub-group is updated in the staging slab its record is read into and written back from there;
- a **streamed** one is read into a staging slab too, uploaded from it, and downloaded back into it: the slab is its
  home from the read to the write-back, which is issued as soon as its download has landed (seen between host
  updates, or waited for when a slab is needed). Never its span: that would bring every streamed file-backed
  sub-group into host memory at once, beyond the host budget, as pageable memory whose copies are synchronous. The
  slabs are registered with the accelerator with the host slabs (:meth:`register_file_staging`), so both copies are
  DMA from page-locked memory. Two slabs are always left to move the other records through: a streamed sub-group
  that would take one of them waits for the oldest streamed download to land and writes it back first.

The performance model (:func:`~lightning_dos.model.nvme.predict_tiered`) counts the same: a streamed file-backed
sub-group holds its slab from its read until its write, issued when its download lands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_dos.engine.file_tier import FileTier
from lightning_dos.engine.homes import SlabHomes
from lightning_dos.engine.hostslab import Registrar
from lightning_dos.engine.pool import BufferPool
from lightning_dos.engine.speculation import SpareSlabs
from lightning_dos.engine.streams import Streams
from lightning_dos.engine.swap_files import SwapFile
from lightning_dos.model.nvme import ALTERNATE, host_order, kept_unwritten, tiered_plan
from lightning_dos.model.plan import Plan, SubGroup
from lightning_dos.model.update_rules import UpdateRule

#: Staging slabs a streamed file-backed sub-group never takes: one to read the next record into while another is
#: updated in its slab (:meth:`FileTier.load`'s ``in_slab`` needs two free).
FREE_FOR_OTHERS = 2


def files_backwards(files_order: str, step: int) -> bool:
    """Whether step ``step`` (counted from 1) takes the file-backed host sub-groups backwards: every even one, in the
    alternating order."""
    return files_order == ALTERNATE and step % 2 == 0


def open_file_tier(
    pool: BufferPool,
    tail: Sequence[SubGroup],
    rule: UpdateRule,
    span: Callable[[SubGroup], tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
    open_swap: Callable[[list[int], torch.dtype, torch.dtype, int], SwapFile],
    on_request: Callable[[str, int, float, float, int], None] | None = None,
) -> FileTier | None:
    """The tier that keeps sub-groups ``tail`` (the slabs' tail) in the swap file ``open_swap(records, master_dtype,
    state_dtype, states)`` makes; None when ``tail`` is empty. Their spans (``span``) are never pinned: the slabs must
    not be registered yet. ``on_request`` is told of each request the drive served (:attr:`FileTier.on_request`)."""
    if pool.pinned:
        raise RuntimeError("keep_in_files must come before the host slabs are registered")
    if not tail:
        return None
    swap = open_swap([sg.numel for sg in tail], pool.param.dtype, pool.state_dtype, len(rule.states))
    pool.keep_tail_in_files(tail[0].slab_offset)
    return FileTier(swap, tail, span, pool.give_back, on_request)


class FileBackedHomes(SlabHomes):
    """The host slabs with their tail kept in a swap file between updates (the NVMe tier).

    Args:
        pool: the engine's buffers (its host slabs).
        sub_groups: the engine's sub-groups.
        spare: the spare slots speculative updates write into.
        files: the tier that moves the tail's records (or, after fit, a reader of them that outlives it).
        streams: the engine's streams (the host waits for a streamed sub-group's download before it writes it back).
    """

    def __init__(
        self, pool: BufferPool, sub_groups: Sequence[SubGroup], spare: SpareSlabs, files: FileTier, streams: Streams
    ) -> None:
        super().__init__(pool, sub_groups, spare)
        self.files = files
        self.streams = streams
        #: Streamed file-backed sub-groups whose download home was issued, with the event it lands at, oldest first:
        #: each written back from its staging slab once that event is done.
        self._downloads_to_store: list[tuple[int, object]] = []

    @property
    def off_slabs(self) -> bool:
        return True

    def register(self, registrar: Registrar | None) -> bool:
        """Register the staging slabs with the accelerator (``registrar``, as the host slabs are), so that streamed
        file-backed sub-groups are uploaded from and downloaded into page-locked memory it knows: asynchronous DMA,
        not the synchronous copies pageable memory gets. Return whether they are registered (nothing to register, or
        a refusal: False, and their copies stay correct, only synchronous)."""
        return False if registrar is None else self.files.register(registrar)

    def file_backed(self, index: int) -> bool:
        return index in self.files

    def home(self, sg: SubGroup) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A sub-group's master weights and states: its span of the slabs (what DeepSpeed's views see), or for a
        file-backed one, loaded first (the update, or its recovery, is about to use it), wherever it was loaded:
        its span, or the staging slab the update runs in."""
        if sg.index in self.files:
            self.files.load(sg.index)
            return self.files.views(sg.index)
        return self.span(sg)

    def spans_written(self, indices: Sequence[int] | None = None) -> None:
        super().spans_written(indices)
        self.files.mark_written(indices)  # loaded file-backed spans were written: they go back to the file

    def placed(self, plan: Plan) -> Plan:
        """A resident sub-group's state lives on the device between updates; a file-backed one's in its file."""
        return tiered_plan(plan, self.files.indices)

    def host_order(self, plan: Plan, step: int, files_order: str) -> list[int]:
        """The order this step updates host sub-groups in (asked once, before any read is issued): the plan's,
        except that file-backed ones come last (they hold the end of the partition, which the next forward needs
        last), backwards every other step in the alternating ``files_order``, so that the step begins with those
        the staging slabs still hold from the last one (MLP-Offload's cache-friendly order: their reads are skipped);
        and those come before the host-slab ones (:func:`host_order`)."""
        backwards = files_backwards(files_order, step)
        return host_order(plan, self.files.indices, backwards=backwards, held=self.files.held)

    def begin(self, plan: Plan, order: Sequence[int], early: Sequence[int], files_order: str) -> None:
        """Read ahead in the order the update takes them (streamed ones are launched first), putting off the
        write-backs of the file-backed sub-groups the next step takes first: in the alternating order with none of
        them streamed, the last ones this one takes, one fewer than the staging slabs
        (:func:`~lightning_dos.model.nvme.kept_unwritten`, which the model counts with)."""
        done_early = set(early)
        files = self.files
        keep = kept_unwritten(order, files.indices, files.slots, files_order, plan.streamed_indices)
        files.begin(plan.streamed_indices + [i for i in order if i not in done_early], keep=keep)

    def load_streamed(self, index: int) -> None:
        """A streamed file-backed sub-group's staging slab is its home, uploaded from and downloaded into."""
        if index in self.files:
            self._load(index)

    def load_host(self, index: int) -> None:
        """A host file-backed sub-group is updated in the staging slab it is read into, and written back from there;
        before any other host update, streamed ones whose download landed go back to their file."""
        if index in self.files:
            self._load(index)
        else:
            self._store_landed_downloads()

    def _load(self, index: int) -> None:
        """Load file-backed sub-group ``index`` into the staging slab its record is read into (host or streamed):
        streamed ones whose download has landed are written back first, and if that leaves fewer than
        :data:`FREE_FOR_OTHERS` slabs free besides the one this takes, the oldest streamed download is waited for."""
        self._store_landed_downloads()
        while self._downloads_to_store and self.files.free_slots() <= FREE_FOR_OTHERS:
            self._store_landed_downloads(wait_oldest=True)
        self.files.load(index, in_slab=True)

    def done_with(self, index: int) -> None:
        """The update is done with sub-group ``index``'s state: a file-backed one is written back."""
        if index in self.files:
            self.files.store(index)

    def download_issued(self, index: int, landed: object) -> None:
        """Streamed file-backed sub-group ``index``'s state comes home into its staging slab at event ``landed``: it
        is written back from there once that has happened."""
        if index in self.files:
            self._downloads_to_store.append((index, landed))

    def _store_landed_downloads(self, wait_oldest: bool = False, every: bool = False) -> None:
        """Write back each streamed file-backed sub-group whose download has landed (``streams.done``), oldest first;
        ``wait_oldest``: wait for the oldest download first; ``every``: wait for them all (the step's end)."""
        pending = self._downloads_to_store
        while pending:
            index, landed = pending[0]
            if wait_oldest or every:
                self.streams.host_wait(landed)  # the host is about to hand the slab to the drive
                wait_oldest = False
            elif not self.streams.done(landed):
                return
            pending.pop(0)
            self.files.store(index)

    def settle(self) -> None:
        """The update is over: the streamed file-backed sub-groups are written back, and every write has landed (the
        file is the state of record between updates, or the slab that keeps a record unwritten for the next step).
        Their downloads home are waited for first (the step waited for every tail event already on its way here; an
        interrupted one synchronised the device)."""
        self._store_landed_downloads(every=True)
        self.files.settle()

    def materialize(self, indices: Sequence[int] | None = None) -> None:
        """Load these file-backed sub-groups (None: all) into their spans, for a reader of the slabs (a checkpoint,
        an accessor); :meth:`release_copies` gives the pages back, a write marks them to be written back
        (:meth:`spans_written`)."""
        for index in self.files.indices if indices is None else indices:
            self.files.load(index, dirty=False)

    def release_copies(self) -> None:
        """Give back the pages of file-backed sub-groups loaded only to be read (:meth:`materialize`)."""
        self.files.drop_clean()

    def close(self) -> None:
        """Remove the swap file (teardown). Its sub-groups' state is gone with it: the slabs hold zeros there."""
        self.files.close()
