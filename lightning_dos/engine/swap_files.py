"""One rank's swap file: the optimizer state of the sub-groups kept on NVMe, moved through a few page-locked slabs.

The file holds one *record* per file-backed sub-group, back to back: its master weights, then each state tensor
of the update rule, each part padded to the drive's block (:data:`ALIGNMENT` bytes at least: O_DIRECT moves whole
aligned blocks). A slab is laid out like the largest record, so a record moves between file and slab in one request
at the record's offset. Requests go through DeepSpeed's async I/O op, one ``aio_handle`` per slab: its ``wait`` then
completes exactly that slab's request, so a slab can be read into while another is written back.

The op splits each request evenly over its ``intra_op_parallelism`` threads, each thread's share at
``offset + share * k``, and never looks at a request's result (it counts completions only). A share that is not a
whole number of blocks is refused by O_DIRECT (EINVAL) on a drive with 4096-byte logical blocks, and the op would
leave the slab or the file as it was without a word: silent corruption. So each record is padded to a whole number
of blocks *per thread*, and each read leaves a canary at the end of every request the op will submit: one still there
when the read completes is a request that failed, raised as an :class:`OSError`. Writes have no such check (the op
gives nothing back); their layout is the same, aligned by construction, and the file's blocks are allocated up front,
so neither EINVAL nor a full drive can fail one.

The file is named by the rank (``lightning-dos-rank{R}.swap``), locked (``flock``) while open, so a second process
on the same directory is refused by name, and sized once to its records (``ftruncate``): it never grows, and a
file a killed run left behind is cut to the same size by the next. :meth:`SwapFile.close` removes it.

This module does the I/O and keeps the layout; when a slab may be reused, and by whom, is its caller's to order
(:mod:`lightning_dos.engine.file_tier`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_dos.errors import DOSConfigError

#: O_DIRECT moves whole blocks at aligned offsets: a page, or the drive's logical block where that is larger.
ALIGNMENT = 4096
#: Left at the end of each request's bytes in a slab before a read: NaN as fp32, bf16 and fp16 alike, with a payload
#: no arithmetic produces (a NaN computed by torch is 0x7FC00000 / 0x7FC0), so trained state never holds it.
CANARY = 0x7FC17FC1_7FC17FC1


def _padded(nbytes: int, align: int = ALIGNMENT) -> int:
    return -(-nbytes // align) * align


def padding_bound(states: int, threads: int, align: int = ALIGNMENT) -> int:
    """The most bytes padding adds to a record's elements (:meth:`SwapFile.record_bytes`): less than a block for each
    of its ``1 + states`` parts, and less than a block per I/O thread for the whole (the pre-flight's figure)."""
    return align * (1 + states + threads)


def logical_block_size(path: str | os.PathLike) -> int:
    """The logical block size of the drive holding ``path`` (sysfs), at least :data:`ALIGNMENT`: O_DIRECT's unit of
    offsets and lengths there. A filesystem with no block device behind it (tmpfs, overlay) answers ALIGNMENT."""
    device = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for queue in (node / "queue", node / ".." / "queue"):  # a whole disk, or a partition of one
        try:
            return max(ALIGNMENT, int((queue / "logical_block_size").read_text()))
        except (OSError, ValueError):
            continue
    return ALIGNMENT


class SwapFile:
    """The file-backed sub-groups of one rank, and ``slots`` slabs to move them through.

    Args:
        directory: ``nvme_path`` (checked beforehand: ``lightning_dos.host.disk.check_nvme_path``).
        rank: the process's global rank; it names the file.
        records: elements of each file-backed sub-group, in record order.
        master_dtype: dtype of the master weights.
        state_dtype: dtype of the state tensors.
        states: how many state tensors the update rule keeps (Adam 2, Lion and Adagrad 1).
        slots: page-locked slabs, each the size of the largest record.
        aio: DeepSpeed's async I/O op (``lightning_dos.host.disk.load_aio()``).
        block_size: bytes per I/O request the op submits.
        queue_depth: requests in flight per handle.
        threads: threads each handle splits a request over (DeepSpeed's ``intra_op_parallelism``); every record is
            padded so that each thread's share is whole blocks of the drive.
        align: the drive's block, the unit of every offset and length (None: :func:`logical_block_size` of
            ``directory``).
        verify: write the largest record through the op once it is made and read it back past it (a refused write
            leaves the file as it was, unreported): a layout this drive refuses is an error before any state goes
            there. False only for tests that need such a layout.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        records: Sequence[int],
        master_dtype: torch.dtype,
        state_dtype: torch.dtype,
        states: int,
        slots: int,
        aio: Any,  # noqa: ANN401 - DeepSpeed's extension module
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 1,
        align: int | None = None,
        verify: bool = True,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.align = logical_block_size(directory) if align is None else align
        if block_size < 1 or block_size % self.align:
            raise DOSConfigError(
                f"aio.block_size={block_size} is not valid for {str(directory)!r}: use a multiple of its drive's "
                f"{self.align}-byte blocks"
            )
        self.block_size, self.threads = block_size, threads
        self._lay_out(records, master_dtype, state_dtype, states)
        self.path = Path(directory) / f"lightning-dos-rank{rank}.swap"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DOSConfigError(
                f"nvme_path={str(directory)!r}: {self.path.name} is in use by another process; give each run its own "
                "nvme_path"
            ) from None
        self._handles: list[Any] = []
        self.slabs: list[torch.Tensor] = []
        self._pending = [0] * slots  # requests issued on each slab's handle and not waited for
        # The record each slab is being read into, with its canaries' positions (in 8-byte words); None otherwise.
        self._reading: list[tuple[int, torch.Tensor] | None] = [None] * slots
        #: The canaries' places (int64 indices) in a request of each size: made once, not at every read.
        self._canaries: dict[int, torch.Tensor] = {}
        self.closed = False
        try:
            os.ftruncate(self._fd, self.nbytes)  # exactly the records: a file left behind is cut to size, never grown
            # Blocks allocated now, not at the first write: a drive filling up later cannot fail a write-back (the
            # op would not say so). A filesystem that cannot allocate ahead keeps the sparse file.
            with contextlib.suppress(OSError):
                if self.nbytes:
                    os.posix_fallocate(self._fd, 0, self.nbytes)
            slab_bytes = max((self.record_bytes(n) for n in self.numels), default=ALIGNMENT)
            for _ in range(slots):
                self._handles.append(aio.aio_handle(block_size, queue_depth, False, True, threads))
                self.slabs.append(
                    self._handles[-1].new_cpu_locked_tensor(slab_bytes, torch.empty(0, dtype=torch.uint8))
                )
            if verify and self.numels:
                self._verify(directory)
        except BaseException:
            self.close()  # no file, lock or page-locked memory left behind by a half-made swap file
            raise

    def _lay_out(
        self, records: Sequence[int], master_dtype: torch.dtype, state_dtype: torch.dtype, states: int
    ) -> None:
        """Place the records back to back: ``numels``, ``offsets`` and the file's ``nbytes``."""
        self.master_dtype, self.state_dtype, self.states = master_dtype, state_dtype, states
        self.numels = list(records)
        self.offsets: list[int] = []
        offset = 0
        for numel in self.numels:
            self.offsets.append(offset)
            offset += self.record_bytes(numel)
        self.nbytes = offset

    def _verify(self, directory: str | os.PathLike) -> None:
        """Write the largest record (random bytes) at its offset through slab 0 and read the file there without
        O_DIRECT: the bytes must be those written. Then read it back through the op (its canaries check the read)."""
        record = max(range(len(self.numels)), key=lambda k: self.numels[k])
        buffer, _, offset = self._request(0, record)
        written = torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8)
        buffer.copy_(written)
        self.write(0, record)
        self.wait(0)
        with open(self.path, "rb", buffering=0) as plain:
            landed = plain.read(buffer.numel()) if plain.seek(offset) == offset else b""
        if landed != written.numpy().tobytes():
            raise DOSConfigError(
                f"nvme_path={str(directory)!r}: its drive refused the swap file's writes ({self.threads} I/O threads "
                f"of {buffer.numel() // self.threads} bytes each at {self.align}-byte alignment, block size "
                f"{self.block_size}), and DeepSpeed's async I/O op does not report it: lower aio.intra_op_parallelism "
                "or name a directory on another drive"
            )
        self.read(0, record)
        self.wait(0)

    def _part_bytes(self, nbytes: int) -> int:
        """Bytes one part of a record (master weights, or one state tensor) of ``nbytes`` takes, padding included."""
        return _padded(nbytes, self.align)

    def record_bytes(self, numel: int) -> int:
        """Bytes of a record of ``numel`` elements, padding included: whole blocks for each I/O thread."""
        master = self._part_bytes(numel * self.master_dtype.itemsize)
        parts = master + self.states * self._part_bytes(numel * self.state_dtype.itemsize)
        return _padded(parts, self.align * self.threads)

    def _request_ends(self, nbytes: int) -> list[int]:
        """Byte offsets, in a request of ``nbytes``, of the last 8 bytes of each I/O request the op submits for it:
        each thread's share (``nbytes / threads``, from its start) cut into ``block_size`` requests."""
        share = nbytes // self.threads
        ends = []
        for thread in range(self.threads):
            for start in range(0, share, self.block_size):
                ends.append(thread * share + min(start + self.block_size, share) - 8)
        return ends

    def views(self, slot: int, record: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The master weights and state tensors of ``record`` as they lie in slab ``slot``."""
        numel, slab = self.numels[record], self.slabs[slot]
        master_end = self._part_bytes(numel * self.master_dtype.itemsize)
        master = slab[: numel * self.master_dtype.itemsize].view(self.master_dtype)
        step = self._part_bytes(numel * self.state_dtype.itemsize)
        states = tuple(
            slab[master_end + k * step : master_end + k * step + numel * self.state_dtype.itemsize].view(
                self.state_dtype
            )
            for k in range(self.states)
        )
        return master, states

    def _request(self, slot: int, record: int) -> tuple[torch.Tensor, str, int]:
        if self.closed:
            raise RuntimeError(f"{self.path} is closed")
        if self._pending[slot]:
            raise RuntimeError(f"slab {slot} has a request in flight: wait for it before the next")
        return self.slabs[slot][: self.record_bytes(self.numels[record])], str(self.path), self.offsets[record]

    def read(self, slot: int, record: int) -> None:
        """Start reading ``record`` into slab ``slot``; :meth:`wait` before using the slab."""
        buffer, path, offset = self._request(slot, record)
        canaries = self._canaries.get(buffer.numel())
        if canaries is None:
            canaries = self._canaries[buffer.numel()] = torch.tensor(self._request_ends(buffer.numel())) // 8
        buffer.view(torch.int64)[canaries] = CANARY  # each overwritten by the drive's bytes when its request succeeds
        if self._handles[slot].async_pread(buffer, path, offset) != 0:
            raise OSError(f"could not start reading record {record} of {path}")
        self._pending[slot] = 1
        self._reading[slot] = (record, canaries)

    def write(self, slot: int, record: int) -> None:
        """Start writing slab ``slot`` back as ``record``; :meth:`wait` before the slab is written again."""
        buffer, path, offset = self._request(slot, record)
        if self._handles[slot].async_pwrite(buffer, path, offset) != 0:
            raise OSError(f"could not start writing record {record} of {path}")
        self._pending[slot] = 1

    def wait(self, slot: int) -> None:
        """Block until slab ``slot``'s request is done (at once when none is in flight)."""
        if self._pending[slot]:
            self._pending[slot] = 0
            self._handles[slot].wait()
            reading, self._reading[slot] = self._reading[slot], None
            if reading is not None:
                record, canaries = reading
                if (self.slabs[slot].view(torch.int64)[canaries] == CANARY).any():
                    raise OSError(
                        f"reading record {record} of {self.path} failed: the drive did not fill every request "
                        "(DeepSpeed's async I/O op does not report a failed request; an O_DIRECT request the drive "
                        "refuses, or an I/O error, leaves the slab unread)"
                    )

    def store(self, record: int, master: torch.Tensor, states: Sequence[torch.Tensor], slot: int = 0) -> None:
        """Write ``record`` from these tensors now, through slab ``slot`` (start-up and checkpoint loads)."""
        self.wait(slot)
        into_master, into_states = self.views(slot, record)
        into_master.copy_(master)
        for into, state in zip(into_states, states, strict=True):
            into.copy_(state)
        self.write(slot, record)
        self.wait(slot)

    def load(self, record: int, slot: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``record`` read now, as copies (checkpoints), through slab ``slot``."""
        self.wait(slot)
        self.read(slot, record)
        self.wait(slot)
        master, states = self.views(slot, record)
        return master.clone(), tuple(state.clone() for state in states)

    def close(self) -> None:
        """Wait for every request, free the slabs, unlock and remove the file (teardown; again: nothing)."""
        if self.closed:
            return
        for slot in range(len(self.slabs)):
            self.wait(slot)
        # A handle whose slab could not be allocated (a half-made file) has nothing to free.
        for handle, slab in zip(self._handles, self.slabs):
            handle.free_cpu_locked_tensor(slab)
        self.slabs, self._handles, self.closed = [], [], True
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
