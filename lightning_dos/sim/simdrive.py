"""A swap file on a simulated NVMe drive: the NVMe tier on a machine with no drive to spare (or no libaio).

:class:`SimSwapFile` is :class:`~lightning_dos.engine.swap_files.SwapFile` with its records in memory and its
requests reported to the stream-race checker (:meth:`~lightning_dos.sim.sanitizer.StreamSanitizer.drive_request`):

- **races on the staging slabs**: each request runs beside everything the host does until the host waits for it,
  and beside every other request. A host read of a slab a read is still filling, an update in place of a slab still
  being written back, or a read landing in a slab still being written back is a race like any other;
- **the replay's drive lane**: every request is logged as one ``nvme_read`` or ``nvme_write`` of the record's bytes
  on the drive's queue, each wait as a host wait (:func:`~lightning_dos.sim.replay.replay` runs them at the
  drive's rates).

Records are laid out back to back with no padding (the real file pads each part to 4096 bytes for O_DIRECT): at the
test sizes the simulator logs, padding would dwarf the state, and the replay scales the logged bytes to the real
ones. The data moves when the request is issued (there is nothing to wait for on a CPU); the checker, not the data,
tells a missing wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy
import torch

from lightning_dos.engine.swap_files import SwapFile
from lightning_dos.sim.sanitizer import StreamSanitizer


class SimSwapFile(SwapFile):
    """The file-backed sub-groups of one engine on the simulated drive.

    Args:
        checker: the race checker the requests are reported to (and logged by).
        first: the index of the first file-backed sub-group (record ``k`` is sub-group ``first + k``).
        records: elements of each file-backed sub-group, in record order.
        master_dtype: dtype of the master weights.
        state_dtype: dtype of the state tensors.
        states: how many state tensors the update rule keeps.
        slots: staging slabs, each the size of the largest record.
    """

    def __init__(
        self,
        checker: StreamSanitizer,
        first: int,
        records: Sequence[int],
        master_dtype: torch.dtype,
        state_dtype: torch.dtype,
        states: int,
        slots: int,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.checker, self.first = checker, first
        self.align, self.threads = 1, 1  # no padding: the replay scales the logged bytes (module docstring)
        self._lay_out(records, master_dtype, state_dtype, states)
        self.path = Path("<simulated drive>")
        self._records = numpy.zeros(self.nbytes, dtype=numpy.uint8)
        slab_bytes = max((self.record_bytes(n) for n in self.numels), default=1)
        self.slabs = [torch.zeros(slab_bytes, dtype=torch.uint8) for _ in range(slots)]
        for slot, slab in enumerate(self.slabs):
            checker.name(slab, f"staging slab {slot}")
        self._pending: list[int | None] = [None] * slots  # each slab's request not waited for: its event
        self.closed = False

    def _part_bytes(self, nbytes: int) -> int:
        return nbytes

    def _issue(self, lane: str, slot: int, record: int) -> None:
        if self.closed:
            raise RuntimeError(f"{self.path} is closed")
        start, nbytes = self.offsets[record], self.record_bytes(self.numels[record])
        buffer = self.slabs[slot][:nbytes]
        # The bytes move now, unseen by the checker (numpy, not aten); the request's access is what it checks.
        if lane == "nvme_read":
            buffer.numpy()[:] = self._records[start : start + nbytes]
        else:
            self._records[start : start + nbytes] = buffer.numpy()
        # A second request on a slab before its wait is not refused here, as the real file refuses it: the checker
        # reports it as the race it is (a read landing in a slab still being written back).
        self._pending[slot] = self.checker.drive_request(lane, buffer, self.first + record)

    def read(self, slot: int, record: int) -> None:
        self._issue("nvme_read", slot, record)

    def write(self, slot: int, record: int) -> None:
        self._issue("nvme_write", slot, record)

    def wait(self, slot: int) -> None:
        event, self._pending[slot] = self._pending[slot], None
        if event is not None:
            self.checker.drive_wait(event)

    def close(self) -> None:
        if not self.closed:
            for slot in range(len(self.slabs)):
                self.wait(slot)
            self.slabs, self.closed = [], True
