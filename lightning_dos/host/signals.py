"""Holding SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 while the optimizer update is in flight.

Python runs a signal handler in the main thread at the next bytecode boundary, which may be in the
middle of the update loop. Lightning's SLURM auto-requeue handler saves a checkpoint there; so do
``OnExceptionCheckpoint`` after Ctrl-C and any user handler that saves. A checkpoint taken then would
hold some sub-groups post-step and the rest pre-step.

:class:`SignalHold` defers such handlers: while it holds, the Python-level handlers of those signals are
replaced by one that only records the signal, and on release the original handlers are put back and
every recorded signal is raised again (in arrival order, once per signal, as the kernel coalesces a
blocked signal), so each runs exactly as it would have, only later. Masking the signals with
``signal.pthread_sigmask`` is not enough: it masks the calling thread only, and the kernel then hands a
process-directed signal to another thread (torch's and gloo's worker threads), whose C-level handler
still schedules the Python handler in the main thread, mid-update.

A second SIGINT or SIGTERM ends the process at once. The first is held like the others (a checkpoint
its handler saves then holds a whole step) and a console line says so; but an update stuck in a device
synchronisation never returns to Python, so a held signal would never act and only SIGKILL would end the
process. Hence while holding, SIGINT and SIGTERM are installed one-shot (``SA_RESETHAND``, on Linux): the
kernel puts their default disposition back as it delivers the first, and the second terminates the
process without any Python code having to run. A Python handler itself runs only when the main thread runs
Python, so the line, and the default disposition for the other of the two (a SIGTERM after a Ctrl-C acts at
once as well), come from a thread of the hold's own, woken by CPython's wakeup fd, which its C-level handler
writes from whichever thread the signal lands on; it runs while the main thread waits in native code that
releases the GIL (as torch's synchronisations do), and otherwise the recording handler does the same.

Only the main thread can install handlers, and only there do Python handlers run, so the hold does
nothing in other threads (a checkpoint requested from the main thread while another thread updates waits
on the engine's guard instead). Signals whose handler is ignored or was installed outside Python are left
alone. The cost is eight ``signal.signal``, four ``sigaction`` and two ``set_wakeup_fd`` calls per step, well
under a millisecond (0.1 to 0.2 ms measured on a loaded 2-core machine, as before those calls were added).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType

#: The signals held during an update: interruption (Ctrl-C), termination, and SLURM's requeue signals.
HELD_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)


#: The held signals whose second arrival ends the process at once (the ones people send to stop a run).
STOPPING_SIGNALS: frozenset[int] = frozenset(int(s) for s in HELD_SIGNALS if s.name in ("SIGINT", "SIGTERM"))

#: Linux's ``SA_RESETHAND``: the kernel restores the default disposition as it delivers the signal.
_SA_RESETHAND = 0x80000000
#: Linux's ``SA_ONSTACK``, which CPython sets on every handler it installs (how the layout below is checked).
_SA_ONSTACK = 0x08000000


class _SigAction(ctypes.Structure):
    """``struct sigaction`` as glibc and musl lay it out on Linux (handler, 1024-bit mask, flags, restorer)."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
        ("flags", ctypes.c_uint),
        ("restorer", ctypes.c_void_p),
    ]


def _libc_sigaction() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]
    function.restype = ctypes.c_int
    return function


_SIGACTION = _libc_sigaction()


def _one_shot(signum: int) -> bool:
    """Make the handler Python installed for ``signum`` one-shot at the kernel level; False where it cannot.

    The handler stays CPython's own C handler (it only records the signal for the main thread); the kernel
    resets the disposition to the default as it delivers the signal, so a second one acts without Python.
    """
    if _SIGACTION is None:
        return False
    action = _SigAction()
    if _SIGACTION(signum, None, ctypes.byref(action)) != 0 or not action.flags & _SA_ONSTACK:
        return False  # not the layout expected, or not CPython's handler: leave it as it is
    action.flags |= _SA_RESETHAND
    return _SIGACTION(signum, ctypes.byref(action), None) == 0


def _default_disposition(signum: int) -> None:
    """Give ``signum`` its default disposition, from any thread (Python's ``signal.signal`` is main-thread only).

    Python's own record of the handler is left as it is; :meth:`SignalHold.release` reinstalls the original.
    """
    if _SIGACTION is not None:
        _SIGACTION(signum, ctypes.byref(_SigAction()), None)  # all zero: SIG_DFL, no flags, nothing masked
    elif threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)


class _Watcher:
    """Reads the signal numbers CPython's C-level handler writes to the wakeup fd, in a thread of its own.

    A signal's Python handler runs only when the main thread runs Python, never while it is stuck in native
    code such as a hung device synchronisation; this thread runs then too (torch's waits release the GIL), so
    the first stopping signal is announced, and the other one made to act at once, even in that case.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd requires it: a C handler must never block
        self.hold: SignalHold | None = None
        threading.Thread(target=self._run, name="lightning-dos-signals", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            hold = self.hold
            if hold is not None:
                for signum in data:
                    hold._stop_signal_seen(signum)


_watcher: _Watcher | None = None


class SignalHold:
    """Defers the Python handlers of ``signals`` between :meth:`hold` and :meth:`release`.

    Args:
        signals: the signals to hold (default: SIGINT, SIGTERM, SIGUSR1, SIGUSR2 where the platform has them).
    """

    def __init__(self, signals: tuple[int, ...] = HELD_SIGNALS) -> None:
        self.signals = signals
        self._saved: dict[int, object] = {}
        self._pending: list[int] = []
        self._since: float | None = None
        self._announced = False
        self._announcing = threading.Lock()
        self._wakeup_before = -1
        #: The longest a hold has lasted so far, in seconds (how late a signal may be delivered).
        self.longest_s = 0.0

    @property
    def holding(self) -> bool:
        return self._since is not None

    @property
    def pending(self) -> bool:
        """A signal arrived while holding and waits for :meth:`release`."""
        return bool(self._pending)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append(signum)
        self._stop_signal_seen(signum)

    def _stop_signal_seen(self, signum: int) -> None:
        """The first SIGINT or SIGTERM of a hold: the other acts at once too, and a line says so (once)."""
        if signum not in STOPPING_SIGNALS or self._since is None:
            return
        with self._announcing:
            if self._announced:
                return
            self._announced = True
        # The kernel has already reset this signal (one-shot); the other stopping signal acts at once too.
        for other in STOPPING_SIGNALS & set(self._saved) - {signum}:
            _default_disposition(other)
        name = signal.Signals(signum).name
        again = "Press Ctrl-C again" if signum == signal.SIGINT else f"Send {name} again"
        line = (
            f"lightning-dos: {name} held until the optimizer update is complete, so that a checkpoint holds the "
            f"whole step. {again} to end the process at once (nothing is saved then).\n"
        )
        # Straight to the file descriptor: the main thread may be inside a print.
        with contextlib.suppress(OSError):
            os.write(2, line.encode())

    def hold(self) -> None:
        """Start holding (no-op outside the main thread, or when already holding).

        A signal that arrived just before is handled here, by its own handler, before the hold begins.
        """
        if self._since is not None or threading.current_thread() is not threading.main_thread():
            return
        self._since = time.perf_counter()
        self._announced = False
        try:
            for signum in self.signals:
                current = signal.getsignal(signum)
                if current is None or current == signal.SIG_IGN:
                    continue  # installed outside Python, or ignored: nothing to defer
                self._saved[signum] = current
                signal.signal(signum, self._record)
                if signum in STOPPING_SIGNALS:
                    _one_shot(signum)
            self._watch()
        except BaseException:
            # A pending signal's handler raised (Ctrl-C just before the update): put everything back.
            self.release()
            raise

    def release(self) -> None:
        """Put the original handlers back, then deliver every signal that arrived while holding.

        A handler that raises (Ctrl-C's KeyboardInterrupt) raises from here, after all handlers are back.
        """
        if self._since is None:
            return
        self.longest_s = max(self.longest_s, time.perf_counter() - self._since)
        self._since = None
        self._unwatch()
        saved, self._saved = self._saved, {}
        errors: list[BaseException] = []
        for signum, handler in saved.items():
            # Installing a handler first runs any pending one; retry so that every original comes back.
            for _ in range(3):
                try:
                    signal.signal(signum, handler)  # type: ignore[arg-type]
                    break
                except BaseException as error:  # noqa: BLE001 - re-raised after every handler is back
                    errors.append(error)
        pending, self._pending = list(dict.fromkeys(self._pending)), []
        for signum in pending:
            try:
                signal.raise_signal(signum)
            except BaseException as error:  # noqa: BLE001 - re-raised once every signal is delivered
                errors.append(error)
        if errors:
            raise errors[0]

    def _watch(self) -> None:
        global _watcher
        if _watcher is None:
            _watcher = _Watcher()
        # Whoever had the wakeup fd (an asyncio loop) gets it back on release, before the held signals are
        # raised again, so it sees each of them then, once.
        self._wakeup_before = signal.set_wakeup_fd(_watcher.write_fd, warn_on_full_buffer=False)
        _watcher.hold = self  # only now: release gives the wakeup fd back only if this hold took it

    def _unwatch(self) -> None:
        if _watcher is None or _watcher.hold is not self:
            return
        _watcher.hold = None
        signal.set_wakeup_fd(self._wakeup_before)
        self._wakeup_before = -1
