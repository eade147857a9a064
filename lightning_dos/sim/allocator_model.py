"""The caching allocator, as the race checker models it: a device block's history starts at its allocation (a
write on the allocating stream, as torch's CUDA sanitizer models ``torch.empty``), and a block may be freed only
once every access to it is ordered before what the allocator may hand it to next."""

from __future__ import annotations

import weakref

import torch

from lightning_dos.sim.findings import (
    HOST,
    Access,
    Race,
    _byte_range,
    _Region,
)
from lightning_dos.sim.simstreams import (
    SimStream,
)


class CachingAllocatorModel:
    """Device allocations and frees, and the kernels' own temporaries (a part of
    :class:`~lightning_dos.sim.sanitizer.StreamSanitizer`, which holds the state it reads)."""

    def on_alloc(self, tensor: torch.Tensor, stream: SimStream) -> None:
        extent = _byte_range(tensor)
        if extent is None:
            return
        # A new allocation starts a fresh history with a write on its stream, as torch's CUDA sanitizer models
        # `torch.empty`: the caching allocator may hand out a block whose last user's work is still queued on that
        # stream (it was freed there), so another stream's first access must be ordered after the allocation.
        self.seq += 1
        self.syncs.update_seq_num(stream.id, self.seq)
        key = tensor.untyped_storage().data_ptr()
        self._accesses[key] = [Access(*extent, True, stream.id, self.seq, "allocation", "the caching allocator")]
        self.regions = [r for r in self.regions if r.end <= extent[0] or r.start >= extent[1]]
        self.regions.append(_Region(*extent, f"device block of {tensor.numel()} x {tensor.dtype}", True))

    def _track_temporary(self, tensor: torch.Tensor) -> None:
        """A tensor a device kernel allocated (an optimizer formula's intermediate): device memory of the kernel's
        stream until it is freed. On the simulated accelerator it is host memory that the host's own temporaries
        may reuse next; on a GPU it never is, so its history goes with it."""
        extent = _byte_range(tensor)
        if extent is None or self._region(extent[0]) is not None:
            return
        region = _Region(*extent, f"device temporary of {tensor.numel()} x {tensor.dtype}", True)
        self.regions.append(region)
        weakref.finalize(tensor, self._forget_temporary, region)

    def _forget_temporary(self, region: _Region) -> None:
        self._accesses.pop(region.start, None)
        self.regions = [r for r in self.regions if r is not region]

    def on_free(self, start: int, end: int, stream: SimStream, recorded: tuple[SimStream, ...] = ()) -> None:
        """A device block goes back to the caching allocator, which hands it next to work on ``stream`` (the one it
        was allocated on) at once, or, for the streams in ``recorded`` (``record_stream``), only once the work they
        hold now has run: every access to it must be ordered before one of those, or before the host's free."""
        memory = self._label(start)
        waiters = (stream.id, HOST, *(s.id for s in recorded))
        for previous in self._accesses.pop(start, []):
            if previous.stream == stream.id:
                continue
            if not any(self.syncs.is_ordered_after(w, previous.seq, previous.stream) for w in waiters):
                self._report(Race(memory, None, previous))
        self.regions = [r for r in self.regions if not (r.start == start and r.end == end)]
