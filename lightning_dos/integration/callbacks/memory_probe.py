"""Memory counters the monitor reads at phase boundaries: the CUDA caching allocator's on a GPU, host RSS on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class MemSample:
    """Memory at one boundary, with the highest values seen since the previous boundary (bytes)."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


class CudaMemory:
    """The caching allocator's counters; the peak counters are reset at every boundary so that each
    phase gets its own peak (this shares state with anything else that reads ``max_memory_*``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> MemSample:
        d = self.device
        sample = MemSample(
            torch.cuda.memory_allocated(d),
            torch.cuda.memory_reserved(d),
            torch.cuda.max_memory_allocated(d),
            torch.cuda.max_memory_reserved(d),
        )
        torch.cuda.reset_peak_memory_stats(d)
        return sample


def _proc_status() -> dict[str, int] | None:
    """``RssAnon``, ``VmRSS`` and ``VmHWM`` of this process in bytes, from ``/proc`` (Linux only)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values if len(values) == 3 else None


class HostMemory:
    """Host memory on CPU: *allocated* is anonymous RSS (tensors live there), *reserved* is total RSS.

    Peaks inside a phase are not observable without sampling, except one: when the kernel's peak RSS
    (VmHWM) rose during a phase, that new peak happened in it. Otherwise the boundary values bound it.
    """

    def __init__(self) -> None:
        status = _proc_status()
        self._hwm = status["VmHWM"] if status else 0

    def read(self) -> MemSample:
        status = _proc_status()
        if status is None:  # no /proc (macOS): psutil's RSS for both
            import psutil

            rss = int(psutil.Process().memory_info().rss)
            return MemSample(rss, rss, rss, rss)
        anon, rss, hwm = status["RssAnon"], status["VmRSS"], status["VmHWM"]
        peak = hwm if hwm > self._hwm else rss
        self._hwm = hwm
        return MemSample(anon, rss, anon, peak)


def memory_probe(device: torch.device) -> CudaMemory | HostMemory | None:
    """The probe for ``device``'s memory: the caching allocator's counters on CUDA, else host RSS (None where
    neither /proc nor psutil can tell)."""
    if device.type == "cuda":
        return CudaMemory(device)
    if _proc_status() is not None:
        return HostMemory()
    try:
        import psutil  # noqa: F401
    except ImportError:
        return None
    return HostMemory()
