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

Only the main thread can install handlers, and only there do Python handlers run, so the hold does
nothing in other threads (a checkpoint requested from the main thread while another thread updates waits
on the engine's guard instead). Signals whose handler is ignored or was installed outside Python are left
alone. The cost is eight ``signal.signal`` calls per step, a few microseconds.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

#: The signals held during an update: interruption (Ctrl-C), termination, and SLURM's requeue signals.
HELD_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)


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
        #: The longest a hold has lasted so far, in seconds (how late a signal may be delivered).
        self.longest_s = 0.0

    @property
    def holding(self) -> bool:
        return self._since is not None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append(signum)

    def hold(self) -> None:
        """Start holding (no-op outside the main thread, or when already holding).

        A signal that arrived just before is handled here, by its own handler, before the hold begins.
        """
        if self._since is not None or threading.current_thread() is not threading.main_thread():
            return
        self._since = time.perf_counter()
        try:
            for signum in self.signals:
                current = signal.getsignal(signum)
                if current is None or current == signal.SIG_IGN:
                    continue  # installed outside Python, or ignored: nothing to defer
                self._saved[signum] = current
                signal.signal(signum, self._record)
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
