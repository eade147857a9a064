"""Host slabs: page-aligned mappings the engine owns, pinned exactly their size, released at teardown.

Each slab is an anonymous private ``mmap`` of its own, not ``malloc`` memory, for three reasons:

- it is marked ``MADV_DONTFORK`` before it is registered, so a forked child (DataLoader workers) neither maps
  nor copies it. Linux >= 5.9 copies DMA-pinned anonymous pages into the child at fork (the rank's whole state,
  at every worker start); older kernels leave the child sharing pages the GPU still writes to. Only a mapping of
  its own can be marked without marking the allocator's neighbouring memory.
- registering it (``cudaHostRegister`` on CUDA) pins exactly its bytes, where torch's pinned allocator rounds a
  block up to a power of two and keeps it cached after it is freed.
- :meth:`HostSlab.close` unregisters it at once (teardown calls it, not the garbage collector); the mapping is
  unmapped when no tensor views it any more. Python's ``mmap`` refuses to unmap memory a tensor still exports,
  so a view that outlives the slab (DeepSpeed's, after ``fit``) stays valid pageable memory, never a dangling
  pointer.

A refused registration (some container runtimes refuse ``cudaHostRegister``) is not fatal: the slab stays in
pageable memory, which works, only slower (see :data:`PAGEABLE_COST`).
A process-wide registry counts the bytes of live and of registered slabs (:func:`live_bytes`,
:func:`registered_bytes`), so tests and logs can check that repeated fits do not accumulate pinned memory.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

PAGE = mmap.PAGESIZE
#: What pageable slabs cost, for the one warning that says a registration was refused.
PAGEABLE_COST = (
    "the optimizer state stays in pageable memory: its host-device copies become synchronous, staged copies "
    "(about half the PCIe bandwidth) that no longer overlap the host update, so the update phase gets slower"
)


class Registrar(Protocol):
    """Pins host memory for an accelerator's DMA engines (``cudaHostRegister`` on CUDA)."""

    name: str

    def register(self, address: int, nbytes: int) -> int:
        """Pin ``nbytes`` at ``address``; return 0 on success, else the runtime's error code."""

    def unregister(self, address: int) -> None:
        """Unpin what :meth:`register` pinned at ``address``."""


class CudaRegistrar:
    """``cudaHostRegister`` with ``cudaHostRegisterPortable`` (pinned for every CUDA context, as torch's own
    pin-memory utilities register), and ``cudaHostUnregister``."""

    name = "cudaHostRegister"

    def register(self, address: int, nbytes: int) -> int:
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))
        if code != 0:
            _clear_cuda_error()
        return code

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration, which is handled: torch checks
    ``cudaGetLastError`` after its kernel launches and would otherwise blame the next kernel for it."""
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if clear is not None:
        clear()
        return
    import ctypes
    import os

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:  # the runtime torch already loaded, never another copy
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


_override: list[Registrar | None] = []


def default_registrar() -> Registrar | None:
    """The registrar slabs are pinned with: CUDA's where CUDA is available, else none (nothing to pin for).

    :func:`use_registrar` replaces it for a block of code (tests and tools: a refusing registrar reaches the
    pageable fallback through the real Trainer path on a machine without CUDA).
    """
    if _override:
        return _override[-1]
    return CudaRegistrar() if torch.cuda.is_available() else None


def registrar_overridden() -> bool:
    """Whether a :func:`use_registrar` block chooses the registrar now."""
    return bool(_override)


class FaultingRegistrar:
    """The simulated accelerator's registrar: pins nothing, but faults in every page it is given, for writing,
    as ``cudaHostRegister`` does (the driver pins pages, so they must be resident). On CPU the resident set
    then rises where it would on a GPU node, so a start-up that registers while other copies still exist shows
    that peak (issue 32, point 5). The pages keep their contents."""

    name = "cudaHostRegister (simulated: pages faulted in, nothing pinned)"

    def register(self, address: int, nbytes: int) -> int:
        import ctypes

        pages = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)[::PAGE]
        pages.add_(0)  # a write to each page, of the value it holds: a write fault, the contents unchanged
        return 0

    def unregister(self, address: int) -> None:
        pass


@contextmanager
def use_registrar(registrar: Registrar | None) -> Iterator[None]:
    """Pin the slabs created inside the block with ``registrar`` (None: pin nothing)."""
    _override.append(registrar)
    try:
        yield
    finally:
        _override.pop()


_live: weakref.WeakSet[HostSlab] = weakref.WeakSet()
_lock = threading.Lock()


def live_bytes() -> int:
    """Bytes of all slabs in this process still mapped (a closed slab counts until its last view is gone)."""
    with _lock:
        return sum(slab.nbytes for slab in _live if slab.mapped)


def registered_bytes() -> int:
    """Bytes of all slabs in this process registered (pinned) now."""
    with _lock:
        return sum(slab.pinned_bytes for slab in _live if slab.registered)


def page_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a slab of ``nbytes`` really maps)."""
    return -(-nbytes // PAGE) * PAGE


class HostSlab:
    """One page-aligned host tensor of ``numel`` elements of ``dtype``, zero-filled, excluded from forks.

    Args:
        numel: elements.
        dtype: element type.
    """

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * itemsize
        self.registered = False
        #: Bytes registered, from the slab's start (the whole slab, or the part no file-backed sub-group uses).
        self.pinned_bytes = 0
        self.closed = False
        self._unregister: weakref.finalize | None = None  # set while registered
        self._mapping: mmap.mmap | None = None
        self._mapped: weakref.ref[mmap.mmap] | None = None  # the mapping, without keeping it alive
        if self.nbytes == 0:
            self.tensor = torch.empty(0, dtype=dtype)
        else:
            # Private and anonymous: zero pages until written, so untouched moments cost nothing yet.
            self._mapping = mmap.mmap(-1, page_rounded(self.nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._mapping.madvise(mmap.MADV_DONTFORK)
            self._mapped = weakref.ref(self._mapping)
            # Through a memoryview: the tensor's storage holds that export, so the mapping lives as long as any
            # view of it and ``mmap.close`` refuses to unmap it meanwhile (``frombuffer`` on the mmap itself
            # would keep the object but not the export, and close() would unmap memory still viewed).
            self.tensor = torch.frombuffer(memoryview(self._mapping), dtype=dtype, count=numel)
        with _lock:
            _live.add(self)

    @property
    def mapped(self) -> bool:
        """Whether the slab's memory is still mapped (by the slab, or after :meth:`close` by a view of it)."""
        mapping = self._mapped() if self._mapped is not None else None
        return mapping is not None and not mapping.closed

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def pin(self, registrar: Registrar, nbytes: int | None = None) -> int:
        """Register the slab's first ``nbytes`` (None: all of it) with ``registrar``; return 0, or the registrar's
        error code (nothing pinned)."""
        nbytes = self.nbytes if nbytes is None else min(nbytes, self.nbytes)
        if self.registered or nbytes == 0:
            return 0
        code = registrar.register(self.address, nbytes)
        if code == 0:
            self.registered = True
            self.pinned_bytes = nbytes
            # Unregistered by unpin() (teardown); the finalizer is also the safety net for a slab collected
            # without one (an engine used outside the strategy), so no registration outlives its slab.
            self._unregister = weakref.finalize(self, registrar.unregister, self.address)
        return code

    def unpin(self) -> None:
        """Unregister the slab (its memory stays, pageable)."""
        if self._unregister is not None:
            self._unregister()  # a finalizer runs at most once
        self.registered, self._unregister, self.pinned_bytes = False, None, 0

    def give_back(self, start: int, end: int) -> int:
        """Give the kernel back the whole pages inside bytes ``[start, end)`` (``MADV_DONTNEED``: they read as
        zeros until written again); return the bytes given back. The pages at either edge, shared with the
        neighbouring bytes, are kept. Never a registered page: the device may still copy to or from it."""
        first, last = page_rounded(start), end // PAGE * PAGE
        if self._mapping is None or last <= first:
            return 0
        if self.registered and first < page_rounded(self.pinned_bytes):
            raise RuntimeError(f"bytes {start}..{end} of a slab are registered (pinned): they cannot be given back")
        self._mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        return last - first

    def close(self) -> bool:
        """Unpin now and drop the slab's own tensor; unmap when nothing else views the memory.

        Returns whether the mapping was unmapped now (False: some tensor still views it; the memory is then
        freed with the last such view, and is pageable meanwhile).
        """
        self.unpin()
        self.closed = True
        self.tensor = torch.empty(0, dtype=self.tensor.dtype)
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return True
        try:
            mapping.close()
        except BufferError:  # a view still exports it; the mapping goes with the last view
            return False
        return True

    def __del__(self) -> None:
        # Only reached when close() was never called (an engine built outside a strategy): never leave a
        # registration behind on memory the mapping is about to give back.
        try:
            self.unpin()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime may be gone already
            pass
