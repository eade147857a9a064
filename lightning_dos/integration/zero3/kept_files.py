"""The NVMe tier's state after ``fit``: the swap file kept readable until the strategy lets go of it.

Stock DeepSpeed NVMe offload can save a checkpoint after ``fit`` (``trainer.save_checkpoint`` on the script's last
line): Lightning's teardown does not destroy the DeepSpeed engine, and DeepSpeed never removes its swap folder, so the
checkpoint copies the trained state from there. The tier must allow the same, without holding what it held while
training: at teardown the records the staging slabs kept unwritten are written back (the file is then the state of
record for every file-backed sub-group), the file is opened once more, read-only, and the tier is closed as before:
its staging slabs and I/O handles freed, its name removed. The open descriptor keeps the file's blocks, so nothing is
left behind by name even if the process is killed, and nothing but those blocks is held until the next read. A
reader (a checkpoint, DeepSpeed's accessors) reads the records it needs straight into their spans of the host slabs
with plain ``pread`` (no staging slab, no O_DIRECT), and their pages are given back once it is done, as while fitting.

The descriptor is closed, and the blocks freed, when the strategy fits again (its next adapter takes over), when this
object is garbage collected with the strategy, or when the process exits.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable

import torch

from lightning_dos.engine.file_tier import FileTier


class KeptFiles:
    """The file-backed sub-groups of a finished fit, read from its swap file kept open (see the module's docstring).

    It stands in the engine's ``files`` after teardown, for the engine's readers of the slabs only (no update runs
    after fit): ``materialize_files``, ``release_file_copies``, ``drop_resident`` and ``close_files`` call
    :meth:`load`, :meth:`drop_clean`, :meth:`mark_written` and :meth:`close` as on a :class:`FileTier`; its
    statistics and layout (``read_bytes``, ``writes_kept``, ``indices``, ``sub_groups``...) are the finished tier's.

    Args:
        files: the engine's tier, settled (no request in flight), not yet closed.
        give_back: gives the whole pages of slab elements ``[start, start + numel)`` back to the kernel
            (``BufferPool.give_back``).
    """

    def __init__(self, files: FileTier, give_back: Callable[[int, int], object]) -> None:
        self._files, self._give_back = files, give_back
        swap = files.swap
        base = swap.slabs[0].data_ptr()
        #: Each sub-group's master weights and state tensors: where they lie in the file (the swap file's own layout,
        #: read off its slab views) and how many bytes each holds.
        self._parts: dict[int, list[tuple[int, int]]] = {}
        for record, index in enumerate(files.indices):
            master, states = swap.views(0, record)
            self._parts[index] = [
                (swap.offsets[record] + t.data_ptr() - base, t.numel() * t.element_size()) for t in (master, *states)
            ]
        #: Sub-groups read into their spans, and whether someone wrote them since (kept in host memory then: the file
        #: is no longer their state of record).
        self.loaded: dict[int, bool] = {}
        self.path = swap.path
        self._fd: int | None = os.open(swap.path, os.O_RDONLY | os.O_CLOEXEC)
        self._closing = weakref.finalize(self, os.close, self._fd)

    def __getattr__(self, name: str) -> object:
        # The finished tier's statistics and layout (read_bytes, writes_kept, slots, sub_groups...), for reports.
        files = self.__dict__.get("_files")
        if files is None:  # not made yet (copy, pickle)
            raise AttributeError(name)
        return getattr(files, name)

    def __contains__(self, index: object) -> bool:
        return index in self._parts

    def load(self, index: int, dirty: bool = True, in_slab: bool = False) -> None:
        """Read sub-group ``index``'s record into its span (at once if it is there already); ``dirty``: the caller
        may write it, and it then stays in host memory. (``in_slab`` is the update's; there is none after fit.)"""
        if index not in self._parts:
            return
        if index in self.loaded:
            self.loaded[index] = self.loaded[index] or dirty
            return
        if self._fd is None:
            raise RuntimeError(
                f"lightning-dos: the optimizer state of sub-group {index} was kept on NVMe, and its swap file "
                f"({self.path}) was released when this strategy fitted again; save the checkpoint before the next fit"
            )
        master, states = self.views(index)
        for tensor, (offset, nbytes) in zip((master, *states), self._parts[index], strict=True):
            _read_into(self._fd, tensor, offset, nbytes)
        self.loaded[index] = dirty

    def views(self, index: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Sub-group ``index``'s master weights and state tensors: its span of the host slabs."""
        return self._files.views(index)

    def drop_clean(self) -> None:
        """Give back the pages of the sub-groups read and not written (a checkpoint's copies)."""
        clean = [index for index, dirty in self.loaded.items() if not dirty]
        for index in clean:
            del self.loaded[index]
        self._give_back_free(clean)

    def mark_written(self, indices: Iterable[int] | None = None) -> None:
        """These loaded sub-groups' spans were written (a checkpoint load, an accessor): they stay in host memory."""
        for index in list(self.loaded) if indices is None else indices:
            if index in self.loaded:
                self.loaded[index] = True

    def close(self) -> None:
        """Close the file (its blocks are freed): only the sub-groups written after fit stay readable, in host
        memory."""
        self.drop_clean()
        self._closing()
        self._fd = None

    def _give_back_free(self, indices: list[int]) -> None:
        """Give back the pages of each run of consecutive sub-groups around ``indices`` that none is loaded in: a
        page shared with a loaded neighbour (or a host-resident one, before the tail) is not whole in the run."""
        subs, covered = self._files.sub_groups, set()
        for index in indices:
            if index in covered:
                continue
            first = last = index
            while first - 1 in subs and first - 1 not in self.loaded:
                first -= 1
            while last + 1 in subs and last + 1 not in self.loaded:
                last += 1
            covered.update(range(first, last + 1))
            start, end = subs[first].slab_offset, subs[last].slab_offset + subs[last].numel
            self._give_back(start, end - start)


def _read_into(fd: int, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
    """Read ``nbytes`` of the file at ``offset`` into the contiguous ``tensor``."""
    view = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:nbytes]], offset + done)
        if got <= 0:
            raise OSError(f"lightning-dos: the kept swap file ended at byte {offset + done} of {offset + nbytes}")
        done += got


def keep_files(files: FileTier | None, give_back: Callable[[int, int], object]) -> KeptFiles | None:
    """Make ``files`` (the engine's tier, its update over) the state of record for every file-backed sub-group and
    return the reader that keeps it open past teardown (None without a tier). The caller then closes ``files`` (its
    staging slabs and the file's name go) and puts the reader in its place."""
    if files is None:
        return None
    for index in sorted(files.unwritten):  # the newest copy is in its slab: copied to its span, written back
        files.load(index)
        files.store(index)
    files.settle()
    return KeptFiles(files, give_back)
