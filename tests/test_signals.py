"""SignalHold on its own: signals arriving while it holds run their own handlers on release, once each."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from lightning_dos.signals import SignalHold


@pytest.fixture
def usr_handlers():  # noqa: ANN201
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.usefixtures("usr_handlers")
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


@pytest.mark.usefixtures("usr_handlers")
def test_ctrl_c_raises_on_release_after_every_handler_is_back() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hold = SignalHold()
    hold.hold()
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))
    with pytest.raises(KeyboardInterrupt):
        hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("usr_handlers")
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
