"""The NVMe tier: sub-groups whose optimizer state lives in a swap file between updates.

The host slabs keep their layout (DeepSpeed's flat partitions and optimizer state stay views of them), but the spans
of the *file-backed* sub-groups (the slabs' tail, past what the host budget keeps) hold no memory between updates:
their pages are given back to the kernel (``MADV_DONTNEED``) and the state is in the rank's swap file
(:mod:`lightning_dos.engine.swap_files`). A file-backed sub-group is *loaded* (its record read through a staging
slab and copied into its span) when the update or a reader first needs it, and *stored* (copied into a staging slab,
written back, its pages given back) as soon as the update is done with it. While loaded, the span is the state of
record; otherwise the file is, or the slab that keeps it unwritten (below).

Why spans and not the staging slabs themselves as the state's home: every other part of the engine (host update,
streaming, recovery, checkpoints through DeepSpeed's views) then reads and writes the same places as for a host
sub-group, and a path that forgets to store a sub-group only costs memory until the step's end (:meth:`settle`),
never correctness. The price is a copy between slab and span each way, an order of magnitude faster than the drive.

Reads run ahead in the order the update takes the sub-groups (:meth:`FileTier.begin`), into slabs no request is using
(or, while the update waits for a read anyway, whose write-back, older than another in flight, it waits for) and whose
record the update does not need again; a slab keeps the record it last moved, so a sub-group loaded again before its
slab is reused (the order that alternates between iterations, MLP-Offload's) is copied from it without touching the
drive. The last few records an update takes in the alternating order are not written back at its end at all: the next
update takes them first, updates them in their slabs again and writes them back once (:meth:`FileTier.begin`'s
``keep``), a write saved per record and update; a slab so kept is written back before any other use of it, and a
reader (a checkpoint) copies the record from it. Two writes of one record are never in flight at once, and a record is
never read from the drive while its write-back runs. This module's I/O waits are the host's own (``aio_handle.wait``);
the staging slabs are host memory no device stream touches. On the simulator the race checker watches them
(:mod:`lightning_dos.sim.simdrive`): a slab touched, or a second request issued on it, before its request's wait is a
race.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

import torch

from lightning_dos.engine.hostslab import Registrar
from lightning_dos.engine.swap_files import SwapFile
from lightning_dos.model.plan import SubGroup


class FileTier:
    """The file-backed sub-groups of one engine and their moves between swap file and host slabs.

    Args:
        swap: the rank's swap file, one record per file-backed sub-group, in index order.
        sub_groups: the file-backed sub-groups (a contiguous tail of the engine's), in index order.
        spans: given a sub-group, its span of the slabs: master weights and state tensors.
        give_back: gives the whole pages of slab elements ``[start, start + numel)`` back to the kernel
            (``BufferPool.give_back``).
    """

    def __init__(
        self,
        swap: SwapFile,
        sub_groups: Sequence[SubGroup],
        spans: Callable[[SubGroup], tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
        give_back: Callable[[int, int], object],
        on_request: Callable[[str, int, float, float, int], None] | None = None,
    ) -> None:
        self.swap = swap
        self.sub_groups = {sg.index: sg for sg in sub_groups}
        self._record = {sg.index: k for k, sg in enumerate(sub_groups)}
        self._spans, self._give_back = spans, give_back
        #: Loaded sub-groups, and whether their span was (or may be) written since it was loaded (dirty: stored by
        #: writing it back; clean: its pages are just given back).
        self.loaded: dict[int, bool] = {}
        #: Loaded sub-groups whose home is the staging slab they were read into (a host update runs there in place,
        #: and is written back from there): no copy to the span and back, and no page of the span touched.
        self._in_slab: dict[int, int] = {}
        slots = len(swap.slabs)
        #: The record each slab holds a current copy of (None: nothing usable), and its request in flight.
        self._holds: list[int | None] = [None] * slots
        self._busy: list[str | None] = [None] * slots  # "read", "write", "home" (a loaded one's) or None
        #: Slabs holding a newer copy of their record than the file: its write-back is put off (:meth:`begin`'s
        #: ``keep``) until the slab is needed for another record (:meth:`_take` writes it first) or the record is
        #: updated again, at the next update's start, and written back then, once for two updates.
        self._unwritten = [False] * slots
        self._last_used = [0] * slots
        self._clock = 0
        self._ahead: list[int] = []
        #: The update's last file-backed records whose write-back their slab keeps (:meth:`begin`'s ``keep``).
        self._kept_tail: set[int] = set()
        #: Bytes moved by the drive, copies skipped because a slab still held the record, and write-backs put off for
        #: the next update (for reports and tests).
        self.read_bytes = self.written_bytes = self.reads_skipped = self.writes_kept = 0
        #: Host bytes of file-backed state loaded into spans now (beyond the staging slabs), and the most since
        #: :meth:`reset_span_peak`: the update keeps this at 0 (host and streamed sub-groups use their slab).
        self.span_bytes = self.peak_span_bytes = 0
        self._in_span: dict[int, int] = {}  # sub-groups loaded into their spans, and the bytes each holds there
        #: Host bytes of the staging slabs (page-locked by DeepSpeed's op).
        self.staging_bytes = sum(slab.numel() * slab.element_size() for slab in swap.slabs)
        #: Told of each request once the host has waited for it: ``(lane, sub-group, issued, seen done, bytes)``, times
        #: on ``time.perf_counter``'s clock; the lane names the direction and the slab (``nvme read, slab 0``), so a
        #: lane's requests never overlap. "Seen done" is when the wait returned: aio tells no earlier.
        self.on_request = on_request
        self._issued: list[tuple[str, int, float, int] | None] = [None] * slots
        self._registered: list[tuple[Registrar, int]] = []  # slabs registered with the accelerator (:meth:`register`)

    def _give_back_span(self, sg: SubGroup) -> None:
        """Give back the pages of ``sg``'s span, and the pages it shares with a neighbour that is file-backed and not
        loaded either (sub-groups are not page-sized: without this, the page between two of them stays resident)."""
        start, end = sg.slab_offset, sg.slab_offset + sg.numel
        before, after = self.sub_groups.get(sg.index - 1), self.sub_groups.get(sg.index + 1)
        if before is not None and before.index not in self.loaded:
            start = before.slab_offset
        if after is not None and after.index not in self.loaded:
            end = after.slab_offset + after.numel
        self._give_back(start, end - start)

    def register(self, registrar: Registrar) -> bool:
        """Register every staging slab with the accelerator (``registrar``): a streamed file-backed sub-group is
        uploaded from and downloaded into its slab. Return whether all are registered (on a refusal, none is)."""
        for slab in self.swap.slabs:
            if registrar.register(slab.data_ptr(), slab.numel() * slab.element_size()) != 0:
                self.unregister()
                return False
            self._registered.append((registrar, slab.data_ptr()))
        return True

    def unregister(self) -> None:
        """Undo :meth:`register` (before the slabs are freed)."""
        for registrar, address in self._registered:
            registrar.unregister(address)
        self._registered = []

    def free_slots(self) -> int:
        """Staging slabs that are no loaded sub-group's home: those records can still move through."""
        return sum(busy != "home" for busy in self._busy)

    def __contains__(self, index: object) -> bool:
        return index in self.sub_groups

    @property
    def indices(self) -> list[int]:
        return list(self.sub_groups)

    @property
    def slots(self) -> int:
        """The staging slabs records move through."""
        return len(self._holds)

    @property
    def held(self) -> set[int]:
        """The records the staging slabs hold a current copy of (read, written back, or kept unwritten) now."""
        return {index for index in self._holds if index is not None}

    @property
    def unwritten(self) -> set[int]:
        """The records whose newest copy is in a staging slab, not yet in the file."""
        return {index for slot, index in enumerate(self._holds) if self._unwritten[slot]}

    # -- slabs --------------------------------------------------------------------------------------

    def _slab_of(self, index: int) -> int | None:
        for slot, held in enumerate(self._holds):
            if held == index:
                return slot
        return None

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock

    def _free_slab(self) -> int:
        """A slab to move a record through now: of the slabs not being written from, the one whose record the update
        needs last, if it needs it no more; else the one with the oldest write in flight; else that slab anyway (a
        copy, or a read ahead, of what is needed furthest ahead: Belady's choice); a slab keeping a record unwritten
        last of all (it costs a write first). The caller empties it (:meth:`_take`: its request waited for)."""
        slabs = [s for s in range(len(self._holds)) if self._busy[s] != "home"]
        idle = [s for s in slabs if self._busy[s] != "write" and not self._unwritten[s]]
        best = max(idle, key=self._needed_after, default=None)
        if best is not None and self._needed_after(best) > len(self._ahead):
            return best
        writing = [s for s in slabs if self._busy[s] == "write"]
        if writing:
            best = min(writing, key=self._last_used.__getitem__)
        if best is None:
            best = max((s for s in slabs if self._unwritten[s]), key=self._needed_after, default=None)
        if best is None:
            raise RuntimeError("every staging slab is some loaded sub-group's home")
        return best

    def _needed_after(self, slot: int) -> int:
        """How far ahead in the update's order the record ``slot`` holds is needed (past the end: never, or empty)."""
        held = self._holds[slot]
        return self._ahead.index(held) if held in self._ahead else len(self._ahead) + 1

    def _wait(self, slot: int) -> None:
        if self._busy[slot] in ("read", "write"):
            self.swap.wait(slot)
            self._busy[slot] = None
            issued, self._issued[slot] = self._issued[slot], None
            if issued is not None and self.on_request is not None:
                kind, index, start, nbytes = issued
                self.on_request(f"nvme {kind}, slab {slot}", index, start, time.perf_counter(), nbytes)

    def _issue(self, slot: int, kind: str, index: int) -> None:
        """Start reading (``kind`` "read") or writing back sub-group ``index``'s record through ``slot``."""
        nbytes = self.swap.record_bytes(self.sub_groups[index].numel)
        if kind == "read":
            self.swap.read(slot, self._record[index])
            self.read_bytes += nbytes
        else:
            self.swap.write(slot, self._record[index])
            self.written_bytes += nbytes
            self._unwritten[slot] = False
        self._issued[slot] = (kind, index, time.perf_counter(), nbytes)
        self._busy[slot] = kind
        self._touch(slot)

    def _take(self, slot: int, stale: bool = False) -> None:
        """Empty ``slot`` for a new record (its request, if any, finished). A record kept unwritten there is written
        back first, unless ``stale``: a newer copy of it is about to be written."""
        if self._unwritten[slot] and not stale:
            self._issue(slot, "write", self._holds[slot])
        self._unwritten[slot] = False
        self._wait(slot)
        self._holds[slot] = None

    def _start_read(self, slot: int, index: int) -> None:
        """Start reading sub-group ``index``'s record into ``slot`` (emptied first)."""
        self._take(slot)
        self._holds[slot] = index
        self._issue(slot, "read", index)

    # -- the update's order ---------------------------------------------------------------------------

    def begin(self, order: Iterable[int], keep: Collection[int] = ()) -> None:
        """The update will take these sub-groups in this order: start reading the first ones into idle slabs.

        ``keep``: file-backed sub-groups (fewer than the slabs: the last ones the update takes) whose write-backs are
        put off: their records stay in their slabs, newer than the file, for an update that takes them first (the
        alternating order), which updates them again and writes them back once. Any other use of their slabs writes
        them first; :meth:`settle` ends the update without writing them."""
        self._ahead = [i for i in order if i in self.sub_groups and i not in self.loaded]
        if len(keep) >= len(self._holds):
            raise ValueError(f"{len(keep)} records kept unwritten in {len(self._holds)} staging slabs: keep fewer")
        self._kept_tail = {i for i in keep if i in self.sub_groups}
        self._read_ahead()

    def _write_back(self, slot: int, index: int) -> None:
        """The record ``index``, changed, is in ``slot``: write it back, or keep it there unwritten (:meth:`begin`)."""
        if index in self._kept_tail:
            self._kept_tail.discard(index)
            self._unwritten[slot] = True
            self.writes_kept += 1
            return
        self._issue(slot, "write", index)

    def _read_ahead(self, patient: bool = False) -> None:
        """Start the reads of the next records the update needs into idle slabs; ``patient``: the caller is about to
        wait for a read, so a read ahead may wait for an older write-back to land first (:meth:`_older_write_slab`).
        Otherwise the host does not wait here: it has updates to run (records the slabs still hold, host-slab
        sub-groups) while the drive works through the writes already queued."""
        for index in list(self._ahead):
            if index in self.loaded or self._slab_of(index) is not None:
                continue  # loaded already, or a slab holds it (read in flight, or a copy from the last write)
            # Not a slab keeping a record unwritten: a read ahead never costs a write.
            idle = [s for s in range(len(self._holds)) if self._busy[s] is None and not self._unwritten[s]]
            if not idle and patient:
                idle = self._older_write_slab()
            if not idle:
                return
            # The idle slab whose record is needed last: never one the update still needs. A read ahead is worth less
            # than a read skipped (the drive is the tier's bottleneck): the records the last step left in the slabs
            # stay there while the sub-groups before them (the streamed ones) go through the other slabs.
            slot = max(idle, key=self._needed_after)
            if self._needed_after(slot) <= len(self._ahead):
                return
            self._start_read(slot, index)

    def _older_write_slab(self) -> list[int]:
        """The slab of the oldest write-back in flight, when a newer one is in flight too and the update does not
        need its record again: it was queued on the drive before the read the update is about to wait for, so waiting
        for it first costs the host little (the caller does: :meth:`_start_read` empties the slab first), and a read
        ahead queued now keeps the drive busy instead of waiting for the update's next load to ask for it. The newest
        write keeps running. Empty when there is none."""
        writing = [s for s in range(len(self._busy)) if self._busy[s] == "write"]
        writing.sort(key=self._last_used.__getitem__)
        if len(writing) < 2 or self._needed_after(writing[0]) <= len(self._ahead):
            return []
        return [writing[0]]

    # -- loading and storing ------------------------------------------------------------------------

    def load(self, index: int, dirty: bool = True, in_slab: bool = False) -> None:
        """Make sub-group ``index``'s state available at its home (:meth:`views`; at once if it is already loaded):
        its span, or with ``in_slab`` the staging slab it is read into (a host update, stored right after it: one
        slab stays free to move the others through). ``dirty``: the caller may write it, so it is written back when
        stored."""
        if index not in self.sub_groups:
            return
        if self.swap.closed:
            raise RuntimeError(
                f"lightning-dos: the optimizer state of sub-group {index} was kept on NVMe, and its swap file "
                f"({self.swap.path}) is closed (an interrupted update left the state torn, or the file could not be "
                "kept when training ended, as said then); save checkpoints while fitting (ModelCheckpoint)"
            )
        if index in self.loaded:
            self.loaded[index] = self.loaded[index] or dirty
            return
        slot = self._slab_of(index)
        if slot is None:
            slot = self._free_slab()
            self._start_read(slot, index)
        elif self._busy[slot] != "read":  # not a read ahead: the record's current copy (its write-back may still run)
            self.reads_skipped += 1
        if self._busy[slot] == "read":
            self._read_ahead(patient=True)  # the host waits for the drive now: queue the next reads first
            self._wait(slot)
        self._touch(slot)
        homes = sum(busy == "home" for busy in self._busy)
        if in_slab and len(self._busy) - homes >= 2:
            # No write-back of this record runs: it was written at most once this update, after its update, and the
            # last update's writes all landed at its end (settle).
            self._busy[slot], self._in_slab[index] = "home", slot
        else:
            master, states = self.swap.views(slot, self._record[index])
            param, home_states = self._spans(self.sub_groups[index])
            param.copy_(master)
            for home, state in zip(home_states, states, strict=True):
                home.copy_(state)
            self._in_span[index] = self._state_bytes(param, home_states)
            self.span_bytes += self._in_span[index]
            self.peak_span_bytes = max(self.peak_span_bytes, self.span_bytes)
        self.loaded[index] = dirty
        if index in self._ahead:
            self._ahead.remove(index)
        self._read_ahead()

    def store(self, index: int) -> None:
        """Sub-group ``index`` is not needed in host memory until it is loaded again: write its span back when it
        may have changed, and give its pages back."""
        dirty = self.loaded.pop(index, None)
        if dirty is None:
            return
        sg = self.sub_groups[index]
        slot = self._in_slab.pop(index, None)
        if slot is not None:  # updated in its slab: written back from there, the span never touched
            self._busy[slot] = None
            if dirty:
                self._write_back(slot, index)
            self._read_ahead()
            return
        if dirty:
            previous = self._slab_of(index)
            if previous is not None:  # an older copy: its write must land before this one is issued, then it is stale
                self._take(previous, stale=True)
            slot = self._free_slab()
            self._take(slot)
            master, states = self.swap.views(slot, self._record[index])
            param, home_states = self._spans(sg)
            master.copy_(param)
            for into, home in zip(states, home_states, strict=True):
                into.copy_(home)
            self._holds[slot] = index
            self._write_back(slot, index)
        self.span_bytes -= self._in_span.pop(index, 0)
        self._give_back_span(sg)
        self._read_ahead()

    @staticmethod
    def _state_bytes(param: torch.Tensor, states: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in (param, *states))

    def reset_span_peak(self) -> None:
        """Start a new window for :attr:`peak_span_bytes`."""
        self.peak_span_bytes = self.span_bytes

    def views(self, index: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The master weights and state tensors of loaded sub-group ``index`` where they are now: its staging slab
        (loaded ``in_slab``) or its span."""
        slot = self._in_slab.get(index)
        if slot is None:
            return self._spans(self.sub_groups[index])
        return self.swap.views(slot, self._record[index])

    def mark_written(self, indices: Iterable[int] | None = None) -> None:
        """These loaded sub-groups' spans were written by someone else (a checkpoint load, an accessor): store them
        by writing back. None: every loaded one."""
        for index in list(self.loaded) if indices is None else indices:
            if index in self.loaded:
                self.loaded[index] = True

    def settle(self) -> None:
        """Store every loaded sub-group and wait for every write: the file is then the state of record for all of
        them but those a slab keeps unwritten (:meth:`begin`), which are read from there (the end of each update, and
        before the file is closed), and the next update may update a record the slabs still hold in place."""
        self._ahead = []
        for index in list(self.loaded):
            self.store(index)
        for slot in range(len(self._busy)):
            self._wait(slot)  # a read ahead nobody took leaves a current copy behind, like a write
        self._kept_tail = set()

    def drop_clean(self) -> None:
        """Give back the pages of the loaded sub-groups nobody wrote (copies read for a checkpoint or an accessor)."""
        for index, dirty in list(self.loaded.items()):
            if not dirty:
                self.store(index)

    def write_spans(self, indices: Iterable[int]) -> None:
        """These sub-groups' spans hold their state (start-up): write each to its record and give its pages back
        (:meth:`settle` waits for the writes). All are marked loaded first: a span's pages shared with a neighbour
        are given back only once the neighbour is in its file too."""
        indices = list(indices)
        for index in indices:
            self.loaded[index] = True
        for index in indices:
            self.store(index)

    def store_all(self) -> None:
        """Write every file-backed sub-group's span to its record now, and wait (start-up: the spans hold the state)."""
        self.write_spans(self.sub_groups)
        self.settle()

    def close(self) -> None:
        """Wait for every request and remove the swap file (teardown): the state of the sub-groups not loaded is
        gone with it."""
        for slot in range(len(self._busy)):
            self._wait(slot)
        self.unregister()
        self.swap.close()
