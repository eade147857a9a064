"""A rank's exit: the process group destroyed and gloo's worker threads idle before the interpreter is torn down.

Gloo runs each collective on a worker thread of its process group (``pt_gloo_runloop``). When a collective ends, the
caller's ``wait()`` returns first and the worker drops its reference to the collective's tensors a moment later. A
tensor whose Python object the caller has already let go (ZeRO-3's all-gathers, a user's ``GatheredParameters``
at the end of a script) is then freed from the worker, which takes the GIL to free the Python object. If the main
thread has begun finalising the interpreter by then, CPython ends any thread that asks for the GIL with
``pthread_exit``, whose unwinding crosses gloo's ``noexcept`` loop: ``std::terminate``, "terminate called without
an active exception", and the rank dies by SIGABRT after a finished run (pytorch/pytorch#190489; a core dump of
rank 1 of the torchrun test showed exactly this stack: ``~AsyncAllgatherWork`` -> ``decref_pyobject`` ->
``take_gil`` -> ``pthread_exit`` -> ``std::terminate``).

A collective may also still be in flight at exit (ZeRO-3 prefetches all-gathers whose handles nobody waits for
once training ends): destroying the process group waits for those (measured: a rank whose peer joined 5 s late
waited 5 s in it), but returns as soon as they complete, with the worker still to free their tensors. So at exit,
while the interpreter is whole, each rank destroys the default group (DeepSpeed creates it and neither it nor
Lightning destroys it; Lightning does so only for NCCL groups it created itself), then sleeps with the GIL released
until every gloo worker thread is asleep and has spent no CPU time for a few polls: a worker finishing a collective
then gets the GIL and frees its tensors before finalisation. Destroying does not end the workers: they end only when
the last reference to their group goes, and DeepSpeed keeps references (on every ZeRO-3 parameter, in its groups)
until finalisation.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time

#: Name the worker threads of torch's gloo process groups carry (``/proc/self/task/*/comm``).
GLOO_WORKER = "pt_gloo_runloop"
#: Polls in a row a worker must look asleep and idle for, and the interval between polls (seconds).
QUIET_POLLS = 3
POLL_S = 0.01
#: The longest the exit waits for busy workers (seconds): freeing a collective's tensors takes microseconds once the
#: worker has the GIL; a worker still busy past this is left, and the exit goes on as it would without the wait.
EXIT_WAIT_S = 2.0

_registered = False


def settle_collectives_at_exit() -> None:
    """At exit, destroy the default process group and let gloo's workers go idle, while the interpreter is whole.

    Call it once the process group exists (more calls do nothing). A group the user destroyed already is left alone;
    its workers are still waited for. See the module's docstring for why both steps are needed.
    """
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    _destroy_default_process_group()
    wait_for_idle_gloo_workers()


def _destroy_default_process_group() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    on_main = threading.current_thread() is threading.main_thread()
    # A Ctrl-C here would leave the group half destroyed: ignored for the moment it takes (as Lightning does).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main else None
    try:
        dist.destroy_process_group()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def busy_gloo_workers(previous: dict[int, int] | None = None) -> tuple[list[int], dict[int, int]]:
    """The gloo worker threads of this process that are running, or spent CPU time since ``previous``.

    Returns their thread ids and every worker's CPU time (clock ticks) now, to pass as ``previous`` next time. A
    worker is idle when the kernel has it asleep (state S) and its CPU time has not moved. Empty where there is no
    ``/proc`` (not Linux) or no gloo group.
    """
    busy: list[int] = []
    ticks: dict[int, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return busy, ticks
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        # The fields after the command name (in parentheses, which may hold spaces): state, ..., utime (the 12th
        # after it), stime (the 13th).
        fields = stat[stat.rindex(")") + 2 :].split()
        state, spent = fields[0], int(fields[11]) + int(fields[12])
        ticks[int(tid)] = spent
        if state != "S" or (previous is not None and previous.get(int(tid), spent) != spent):
            busy.append(int(tid))
    return busy, ticks


def wait_for_idle_gloo_workers(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Sleep (the GIL released) until every gloo worker looked idle for :data:`QUIET_POLLS` polls in a row.

    Returns whether they did within ``timeout_s``; True at once where there are none.
    """
    deadline = time.monotonic() + timeout_s
    busy, ticks = busy_gloo_workers()
    if not ticks:
        return True
    quiet = 0 if busy else 1
    while quiet < QUIET_POLLS:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
        busy, ticks = busy_gloo_workers(ticks)
        quiet = 0 if busy else quiet + 1
    return True
