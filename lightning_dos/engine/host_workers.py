"""Host worker threads that each run torch's CPU kernels on one core, with no barrier between kernels.

A tiled host update calls three kernels per tile. Run from the main thread, each kernel is an OpenMP
parallel region, and every region ends in a barrier where the threads wait for the slowest: harmless on an
idle machine, but on a busy one (data loader workers, other ranks, other jobs) a descheduled thread holds the
others at every barrier, and three barriers per tile cost more than the memory traffic they save
(measured: 8x slower than the three-pass path at a load average of 8 on 2 cores, bench/RESULTS.md).

Instead, each worker here takes a contiguous share of the sub-group and runs all its tiles itself, one thread
per kernel, so the only synchronisation is the join at the end. torch (OpenMP backend) keeps the intra-op
thread count per OS thread: a worker set to 1 thread stays at 1 while the caller keeps its own count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_lock = threading.Lock()
#: (process id, thread count, pool): a forked child inherits the object but not the threads, so it makes its own.
_pool: tuple[int, int, ThreadPoolExecutor] | None = None


def _single_threaded_worker(ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch sets a thread's count lazily from the process-wide one: do it now ...
    torch.set_num_threads(1)  # ... then pin this thread to one core's worth of work
    ready.wait()  # every worker must start (and pin itself) before the caller restores its own count


def _openmp_backend() -> bool:
    return "OpenMP" in torch.__config__.parallel_info()


#: Off unless LIGHTNING_DOS_HOST_WORKERS=1: on a quiet machine (ranks bound to cores of their own, as
#: ``host_threads="auto"`` does) the workers measured 0.69-0.81x the caller's tiles (bench/kernels.py, 2 threads,
#: 16M elements, bench/RESULTS.md); they win only on an oversubscribed host, where OpenMP barriers stall.
ENABLED = os.environ.get("LIGHTNING_DOS_HOST_WORKERS", "0") == "1"


def workers() -> ThreadPoolExecutor | None:
    """The pool of ``torch.get_num_threads()`` single-threaded workers, made on first use; None when they are
    not :data:`ENABLED`, the caller has one thread or torch's threading backend is not OpenMP (then the caller
    runs the tiles, each kernel on torch's threads)."""
    global _pool
    count = torch.get_num_threads()
    if not ENABLED or count < 2 or not _openmp_backend():
        return None
    with _lock:
        if _pool is None or _pool[:2] != (os.getpid(), count):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=True)
            pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="lightning-dos-host")
            ready = threading.Barrier(count)
            for future in [pool.submit(_single_threaded_worker, ready) for _ in range(count)]:
                future.result()
            # set_num_threads(1) in the workers also lowered torch's process-wide default; restore it.
            torch.set_num_threads(count)
            _pool = (os.getpid(), count, pool)
        return _pool[2]


def shares(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into at most ``parts`` contiguous, non-empty ranges whose inner boundaries are
    multiples of ``align`` (so each worker's vector loop starts aligned with the others')."""
    step = -(-numel // parts)
    step = -(-step // align) * align
    return [(start, min(numel, start + step)) for start in range(0, numel, step)]


def run_shares(pool: ThreadPoolExecutor, work: Callable[[int, int], None], ranges: Sequence[tuple[int, int]]) -> None:
    """Run ``work(start, end)`` for every range on the workers and wait for all, then re-raise the first error.

    Every share has finished (or failed) when this returns or raises, so no worker is still writing the state
    when the caller looks at it (to recover from the error, say)."""
    futures = [pool.submit(work, start, end) for start, end in ranges]
    wait(futures)
    for future in futures:
        future.result()
