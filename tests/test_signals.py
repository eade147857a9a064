"""SignalHold on its own: signals arriving while it holds run their own handlers on release, once each."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest

from lightning_dos.host.signals import SignalHold


@pytest.mark.usefixtures("restore_signal_handlers")
def test_signals_wait_for_release_and_keep_their_order_and_handlers() -> None:
    ran: list[int] = []
    handler = lambda signum, frame: ran.append(signum)  # noqa: E731
    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGUSR2, handler)
    # Another thread that does not block the signals, like torch's and gloo's: masking the main thread
    # alone (pthread_sigmask) would let the kernel hand the signal to it and the handler would still run.
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    hold = SignalHold()
    hold.hold()
    assert hold.holding
    # A process-directed signal, as SLURM sends it: the kernel may hand it to any thread.
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR2)
    sum(range(1000))  # bytecode boundaries, where Python would run handlers
    assert ran == []
    hold.release()
    stop.set()
    other.join()
    assert ran == [signal.SIGUSR2, signal.SIGUSR1]  # arrival order, coalesced like a blocked signal
    assert signal.getsignal(signal.SIGUSR1) is handler and signal.getsignal(signal.SIGUSR2) is handler
    assert hold.longest_s > 0 and not hold.holding


@pytest.mark.usefixtures("restore_signal_handlers")
def test_ctrl_c_raises_on_release_after_every_handler_is_back() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hold = SignalHold()
    hold.hold()
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))
    with pytest.raises(KeyboardInterrupt):
        hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("restore_signal_handlers")
def test_hold_does_nothing_outside_the_main_thread_or_for_ignored_signals() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    hold = SignalHold()
    worker = threading.Thread(target=hold.hold)
    worker.start()
    worker.join()
    assert not hold.holding
    hold.hold()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN  # left alone
    hold.release()
    hold.release()  # releasing twice is harmless


@pytest.mark.usefixtures("restore_signal_handlers")
def test_an_event_loops_wakeup_fd_is_given_back_and_sees_each_held_signal_once() -> None:
    """The hold borrows CPython's wakeup fd (asyncio's self-pipe, where a loop runs) and gives it back."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    before = signal.set_wakeup_fd(write)
    try:
        hold = SignalHold()
        hold.hold()
        os.kill(os.getpid(), signal.SIGUSR1)
        sum(range(1000))
        hold.release()
        assert signal.set_wakeup_fd(write) == write
        assert os.read(read, 64) == bytes([signal.SIGUSR1])  # raised again on release, once
    finally:
        signal.set_wakeup_fd(before)
        os.close(read)
        os.close(write)


# -- a second SIGINT or SIGTERM during a held update ends the process at once ---------------------------------

ROOT = Path(__file__).resolve().parents[1]

# A child process that installs a handler for ``STOP`` that exits cleanly (as Lightning's and user handlers
# do), holds, and then either blocks in C++ for good, as an update hung in a device synchronisation does
# (a torch future nobody completes: its wait never returns to Python, so no Python handler can ever run), or
# keeps running Python until it has recorded ``EXPECT`` signals, then releases.
CHILD = """
import os, signal, sys, threading, time, torch
from lightning_dos.host.signals import SignalHold

stop, mode, expect = signal.Signals[sys.argv[1]], sys.argv[2], int(sys.argv[3])
def clean_exit(signum, frame):
    print("handled", signal.Signals(signum).name, flush=True)
    sys.exit(3)
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, clean_exit)
hold = SignalHold()
hold.hold()
if mode == "hung":
    # Said from another thread once the main thread is surely blocked in native code.
    threading.Thread(target=lambda: (time.sleep(1), print("holding", flush=True))).start()
    torch.futures.Future().wait()
print("holding", flush=True)
while len(hold._pending) < expect:
    sum(range(100))  # bytecode boundaries: the recording handler runs here
print("released", flush=True)
hold.release()
print("not reached", flush=True)
"""


def _line(stream: IO[str] | None, timeout: float = 60) -> str:
    """The next line the child writes on ``stream``, or "" when none comes in time (a test never hangs)."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def _child(stop: str, mode: str, expect: int = 1) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, stop, mode, str(expect)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert _line(child.stdout) == "holding\n"
    return child


@pytest.mark.parametrize(("first", "second"), [("SIGINT", "SIGINT"), ("SIGTERM", "SIGTERM"), ("SIGINT", "SIGTERM")])
def test_a_second_signal_ends_an_update_hung_in_native_code_while_the_first_alone_is_held(
    first: str, second: str
) -> None:
    child = _child(first, "hung")
    try:
        child.send_signal(signal.Signals[first])
        line = _line(child.stderr)  # said although the main thread never returns to Python
        assert line.startswith(f"lightning-dos: {first} held until the optimizer update is complete"), line
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)  # the first is held: neither the default action nor the clean exit
        child.send_signal(signal.Signals[second])
        assert child.wait(timeout=30) == -signal.Signals[second]  # the default action, at once
    finally:
        child.kill()
    out, _ = child.communicate()
    assert "handled" not in out


@pytest.mark.parametrize(("first", "second"), [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGTERM"), ("SIGTERM", "SIGINT")])
def test_the_first_signal_says_a_second_ends_the_process_and_the_second_does(first: str, second: str) -> None:
    child = _child(first, "running", expect=3)  # never releases on its own: it waits for a third signal
    try:
        child.send_signal(signal.Signals[first])
        line = _line(child.stderr)
        again = "Press Ctrl-C again" if first == "SIGINT" else f"Send {first} again"
        assert line.startswith(f"lightning-dos: {first} held until the optimizer update is complete"), line
        assert f"{again} to end the process at once" in line, line
        child.send_signal(signal.Signals[second])
        assert child.wait(timeout=30) == -signal.Signals[second]
    finally:
        child.kill()
    out, _ = child.communicate()
    assert "handled" not in out and "released" not in out


def test_one_signal_alone_is_held_then_runs_its_own_handler_on_release() -> None:
    child = _child("SIGTERM", "running", expect=1)
    try:
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 3  # the process's own handler, after the hold
    finally:
        child.kill()
    out, err = child.communicate()
    assert out.splitlines() == ["released", "handled SIGTERM"]
    assert err.count("lightning-dos:") == 1
