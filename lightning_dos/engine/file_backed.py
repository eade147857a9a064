"""File-backed sub-groups in the update: the NVMe tier's part of the engine.

:class:`~lightning_dos.engine.file_tier.FileTier` moves records between the swap file, its page-locked staging slabs
and the host slabs; this mixin decides, for each placement, where a file-backed sub-group's state lives while the
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
from lightning_dos.engine.hostslab import Registrar
from lightning_dos.engine.swap_files import SwapFile
from lightning_dos.model.nvme import ALTERNATE, host_order, kept_unwritten, nvme_sub_groups
from lightning_dos.model.plan import Plan, SubGroup

#: Staging slabs a streamed file-backed sub-group never takes: one to read the next record into while another is
#: updated in its slab (:meth:`FileTier.load`'s ``in_slab`` needs two free).
FREE_FOR_OTHERS = 2


class FileBackedSubGroups:
    """The NVMe tier in the update (a part of :class:`~lightning_dos.engine.loop.InterleavedUpdate`, which holds
    ``files``, ``files_order``, ``sub_groups``, ``pool``, ``streams`` and ``steps_taken``)."""

    files: FileTier | None
    files_order: str
    sub_groups: list[SubGroup]
    #: Streamed file-backed sub-groups whose download home was issued, with the event it lands at, oldest first:
    #: each written back from its staging slab once that event is done.
    _downloads_to_store: list[tuple[int, object]]

    def keep_in_files(
        self, first: int, directory: str, rank: int, aio: object, slots: int = 4, *, write: bool = True, **io: int
    ) -> FileTier | None:
        """Keep sub-groups ``first`` onwards (the slabs' tail) in a swap file under ``directory`` between updates:
        their spans' current contents are written to it and their pages given back (the NVMe tier, see
        :mod:`lightning_dos.engine.file_tier`). Call before the slabs are registered (:meth:`BufferPool.register_host`):
        those spans are never pinned. ``aio`` is DeepSpeed's async I/O op; ``slots`` staging slabs move the records;
        ``io`` is passed to :class:`~lightning_dos.engine.swap_files.SwapFile` (``block_size``, ``queue_depth``,
        ``threads``).
        ``write=False``: the spans do not hold the state yet; the caller writes each one as it fills it
        (:meth:`FileTier.write_spans`, then :meth:`FileTier.settle`), so that start-up never holds all of it at once.
        Return the tier (None when ``first`` leaves nothing to keep in files)."""

        def open_swap(records: list[int], master: torch.dtype, state: torch.dtype, states: int) -> SwapFile:
            return SwapFile(directory, rank, records, master, state, states, slots, aio, **io)

        return self.keep_records_in(first, open_swap, write=write)

    def keep_records_in(
        self,
        first: int,
        open_swap: Callable[[list[int], torch.dtype, torch.dtype, int], SwapFile],
        *,
        write: bool = True,
    ) -> FileTier | None:
        """:meth:`keep_in_files` with the swap file made by ``open_swap(records, master_dtype, state_dtype,
        states)`` (the simulated drive's, :class:`~lightning_dos.sim.simdrive.SimSwapFile`, on the simulator)."""
        if self.files is not None:
            raise RuntimeError("the engine keeps sub-groups in files already")
        if self.pool.pinned:
            raise RuntimeError("keep_in_files must come before the host slabs are registered")
        tail = self.sub_groups[first:]
        if not tail:
            return None
        swap = open_swap([sg.numel for sg in tail], self.pool.param.dtype, self.pool.state_dtype, len(self.rule.states))
        self.pool.file_backed_from = tail[0].slab_offset
        self.files = FileTier(swap, tail, self._span, self.pool.give_back)
        self.files.on_request = self.streams.host_span  # the drive's requests in the step's timeline
        if write:
            self.files.store_all()
        return self.files

    def register_file_staging(self, registrar: Registrar | None) -> bool:
        """Register the staging slabs with the accelerator (``registrar``, as the host slabs are), so that streamed
        file-backed sub-groups are uploaded from and downloaded into page-locked memory it knows: asynchronous DMA,
        not the synchronous copies pageable memory gets. Return whether they are registered (no tier, nothing to
        register, or a refusal: False, and their copies stay correct, only synchronous)."""
        if self.files is None or registrar is None:
            return False
        return self.files.register(registrar)

    def first_file_backed(self, host_budget: int) -> int:
        """The first sub-group past what ``host_budget`` bytes of master weights and state hold (counted from the
        first; every one when they all fit): where the NVMe tier begins, as the performance model counts it
        (:func:`~lightning_dos.model.nvme.nvme_sub_groups`)."""
        in_files = nvme_sub_groups(self.sizes, host_budget, self.footprint)
        return in_files[0] if in_files else len(self.sub_groups)

    def close_files(self) -> None:
        """Remove the swap file (teardown). Its sub-groups' state is gone with it: the slabs hold zeros there."""
        if self.files is not None:
            self.files.close()

    def materialize_files(self, indices: Sequence[int] | None = None) -> None:
        """Load these file-backed sub-groups (None: all) into their spans, for a reader of the slabs (a checkpoint,
        an accessor); :meth:`release_file_copies` gives the pages back, a write marks them to be written back
        (:meth:`drop_resident`)."""
        if self.files is not None:
            for index in self.files.indices if indices is None else indices:
                self.files.load(index, dirty=False)

    def release_file_copies(self) -> None:
        """Give back the pages of file-backed sub-groups loaded only to be read (:meth:`materialize_files`)."""
        if self.files is not None:
            self.files.drop_clean()

    def _file_backed(self, index: int) -> bool:
        return self.files is not None and index in self.files

    def _done_with(self, index: int) -> None:
        """The update is done with sub-group ``index``'s state: a file-backed one is written back."""
        if self._file_backed(index):
            self.files.store(index)

    def files_backwards(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) takes the file-backed host sub-groups backwards: every even one, in
        the alternating :attr:`files_order`."""
        return self.files_order == ALTERNATE and step % 2 == 0

    def _host_order(self, plan: Plan) -> list[int]:
        """The order this step updates host sub-groups in (asked once, before any read is issued): the plan's,
        except that file-backed ones come last (they hold the end of the partition, which the next forward needs
        last), backwards every other step in the alternating :attr:`files_order`, so that the step begins with those
        the staging slabs still hold from the last one (MLP-Offload's cache-friendly order: their reads are skipped);
        and those come before the host-slab ones (:func:`host_order`)."""
        if self.files is None:
            return plan.host_indices
        backwards = self.files_backwards(self.steps_taken)  # this step's number
        return host_order(plan, self.files.indices, backwards=backwards, held=self.files.held)

    def _kept_unwritten(self, plan: Plan, order: Sequence[int]) -> list[int]:
        """The file-backed sub-groups whose write-backs this step puts off (:meth:`FileTier.begin`): in the
        alternating order with none of them streamed, the last ones it takes, one fewer than the staging slabs, since
        the next step takes them first and writes them back then (:func:`~lightning_dos.model.nvme.kept_unwritten`,
        which the model counts with)."""
        files = self.files
        return kept_unwritten(order, files.indices, files.slots, self.files_order, plan.streamed_indices)

    # -- where a file-backed sub-group's state is while the update uses it ---------------------------

    def _load_file_backed(self, index: int) -> None:
        """Load file-backed sub-group ``index`` into the staging slab its record is read into (host or streamed):
        streamed ones whose download has landed are written back first, and if that leaves fewer than
        :data:`FREE_FOR_OTHERS` slabs free besides the one this takes, the oldest streamed download is waited for."""
        self._store_landed_downloads()
        while self._downloads_to_store and self.files.free_slots() <= FREE_FOR_OTHERS:
            self._store_landed_downloads(wait_oldest=True)
        self.files.load(index, in_slab=True)

    def _download_issued(self, index: int, landed: object) -> None:
        """Streamed file-backed sub-group ``index``'s state comes home into its staging slab at event ``landed``: it
        is written back from there once that has happened."""
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

    def _settle_files(self) -> None:
        """The update is over: the streamed file-backed sub-groups are written back, and every write has landed (the
        file is the state of record between updates, or the slab that keeps a record unwritten for the next step).
        Their downloads home are waited for first (the step waited for every tail event already on its way here; an
        interrupted one synchronised the device)."""
        if self.files is None:
            return
        self._store_landed_downloads(every=True)
        self.files.settle()

    def _home(self, sg: SubGroup) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A sub-group's master weights and states: its span of the slabs (what DeepSpeed's views see), or for a
        file-backed one, loaded first (the update, or its recovery, is about to use it), wherever it was loaded:
        its span, or the staging slab the update runs in."""
        if self._file_backed(sg.index):
            self.files.load(sg.index)
            return self.files.views(sg.index)
        return self._span(sg)

    def _span(self, sg: SubGroup) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
        return self.pool.param[span], tuple(state[span] for state in self.pool.states)
