"""The update in flight: run on a thread of its own, and handed over sub-group by sub-group.

Under ``overlap`` the step returns while its update goes on: :meth:`UpdateLanding.start` runs it on a background
thread that holds the engine's guard; each sub-group whose 16-bit result is issued is *landed* with the event it
lands at, so that the next forward's all-gathers wait only for the sub-groups they read
(:meth:`~UpdateLanding.wait_sub_groups`), and :meth:`~UpdateLanding.wait_all` waits for the rest and raises, on the
caller's thread, what interrupted it. The next forward begins only once the update has issued its device side and
given its staging back (:meth:`~UpdateLanding.wait_device_side`): that staging and the forward's activations are
never held at once, so the overlap never raises the iteration's device peak above that of an update waited for.
Under ``overlap="auto"`` the step begins during backward, fed by backward's gradient arrivals
(:meth:`~UpdateLanding.feed`).

Every field here is read and written under one condition (``_changed``), by two threads: the training thread (it
starts the update and waits for sub-groups) and the update's thread (it lands them). Nothing else touches them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import UpdateGuard
from lightning_dos.engine.streams import Streams


class UpdateLanding:
    """The hand-off of an update to a background thread, and of each sub-group's 16-bit result to its readers.

    Args:
        streams: the engine's streams (the readers' waits are issued through them; the update's thread binds to them).
        guard: the guard the update holds (readers of the optimizer state wait on it).
        count: how many sub-groups the engine updates.
    """

    def __init__(self, streams: Streams, guard: UpdateGuard, count: int) -> None:
        self.streams = streams
        self.guard = guard
        self.count = count
        self._changed = threading.Condition()
        #: Sub-groups of the update in flight whose 16-bit result has been issued, with the event it lands at (None
        #: on a synchronous device); None when no update is in flight.
        self._landed: dict[int, object] | None = None
        #: The last update's landing events, kept once it is over (a reader waiting after it ends reads them).
        self._last_landed: dict[int, object] = {}
        #: The update in flight has issued its device side and given its staging back (:meth:`device_side_issued`).
        self._staging_given_back = False
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        #: Backward's hand-over to a step begun during backward (:meth:`feed`); None otherwise.
        self.arrivals: GradientArrivals | None = None

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` (an update: the step and what its caller stores with it) on a background thread and return at
        once; :meth:`wait_sub_groups` and :meth:`wait_all` are the points that wait for it.

        The thread holds the guard for the whole of ``work``, so readers on other threads wait for it; the call
        returns only once the thread holds it. An exception ``work`` raises is raised by :meth:`wait_all`.
        """
        self.wait_all()
        with self._changed:
            self._landed = {}
            self._staging_given_back = False
        # Released once the thread holds the guard (a semaphore: a thread's start, not a stream's order).
        holding = threading.Semaphore(0)

        def run() -> None:
            try:
                with self.guard.updating():
                    holding.release()
                    # A new thread's current device is device 0, not the engine's: select it before any stream
                    # operation (leaving a stream context would otherwise make a CUDA context on GPU 0).
                    self.streams.bind_thread()
                    work()
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread by wait_all
                self._background_error = error
            finally:
                self.end()

        self._background = threading.Thread(target=run, name="lightning-dos-update", daemon=True)
        self._background.start()
        holding.acquire()

    def feed(self, arrivals: GradientArrivals) -> None:
        """The update just started was begun during backward: :meth:`grads_final` and :meth:`end_backward` feed it
        through ``arrivals`` (the step updates host sub-groups as their gradients become final, then waits for
        backward's end to run, or skip, the rest)."""
        self.arrivals = arrivals

    def grads_final(self, index: int, event: object = None) -> None:
        """Sub-group ``index``'s gradient is final (``event``: when its copy lands; None once it has)."""
        if self.arrivals is not None:
            self.arrivals.arrive(index, event)

    def end_backward(self, proceed: bool, abandoned: bool = False, inv_grad_scale: float | None = None) -> None:
        """Backward is over: ``proceed`` runs the rest of the step begun during backward, with
        ``inv_grad_scale`` (the real gradient factor, which decides whether a speculative update is committed or
        redone; None: the factor the step began with); False skips it (overflow, or the step's gradient norm is not
        finite); ``abandoned``: backward never finished, so the step is not taken. No-op when no step was begun."""
        arrivals, self.arrivals = self.arrivals, None
        if arrivals is not None:
            ended = GradientArrivals.RUN if proceed else GradientArrivals.SKIP
            arrivals.end(GradientArrivals.ABANDON if abandoned else ended, inv_grad_scale)

    @property
    def in_flight(self) -> bool:
        """An update started by :meth:`start` has not been waited for by :meth:`wait_all` yet."""
        return self._background is not None

    @property
    def running(self) -> bool:
        """The update's thread is still running (its work not over yet)."""
        thread = self._background
        return thread is not None and thread.is_alive()

    def open_for_step(self) -> bool:
        """A step begins: open the landing unless :meth:`start` has (the step then runs inside work that may still
        rewrite 16-bit partitions after it returns, such as its caller taking a step interrupted before any change
        whole on the host: the thread releases the waiters once that work is over). Return whether the step opened
        it, and so must release the waiters itself (:meth:`end`) when it returns."""
        with self._changed:
            if self._landed is not None:
                return False
            self._landed = {}
            return True

    def not_landed(self, indices: Sequence[int]) -> frozenset[int] | None:
        """Those of ``indices`` the update in flight has not landed yet; None when no update is in flight."""
        with self._changed:
            if self._landed is None:
                return None
            return frozenset(i for i in indices if i not in self._landed)

    def wait_sub_groups(self, indices: Sequence[int], stream: object = None) -> None:
        """Block until the 16-bit parameters of sub-groups ``indices`` hold the update in flight's result (at once
        when none is in flight); an update that fails is finished or undone before this returns.

        With ``stream`` (the reader's device stream), the host waits only until each result is issued and that stream
        waits for it to land; otherwise the host waits for it to land."""
        with self._changed:
            self._changed.wait_for(lambda: self._landed is None or all(i in self._landed for i in indices))
            landed = self._landed if self._landed is not None else self._last_landed
            events = [landed.get(i) for i in indices]
        for event in events:
            # Issued on the update's thread; the reader waits for it to land before the 16-bit result is read.
            if stream is not None:
                self.streams.wait(stream, event)
            else:
                self.streams.host_wait(event)

    def wait_device_side(self) -> None:
        """Block until the update in flight has issued its device side and given its staging back to the caching
        allocator (at once when none is in flight, or when the device is the host's own CPU). The framework calls it
        as the next forward begins, before the forward allocates anything: otherwise that staging and the forward's
        activations could be held at once, whenever the update's thread runs late, and the iteration's device peak
        would exceed that of an update waited for (``overlap="off"``), whose staging sees only what backward left.

        The wait is short: the device side is issued first, its work queued on the engine's streams (it runs on while
        the forward does); the host side, the update's long part, still overlaps the forward."""
        if not self.streams.is_async:
            return  # device sub-groups run on the host's CPU there: no device memory to keep apart
        with self._changed:
            self._changed.wait_for(lambda: self._landed is None or self._staging_given_back)

    def device_side_issued(self) -> None:
        """The update's device side is issued and its staging given back: the next forward may allocate."""
        with self._changed:
            self._staging_given_back = True
            self._changed.notify_all()

    def wait_all(self) -> None:
        """Block until the update in flight (and what its caller stores with it) is over; raise what interrupted it,
        here, on the caller's thread."""
        # A step begun during backward that backward never ended (it failed): nothing more is updated.
        self.end_backward(False, abandoned=True)
        thread, self._background = self._background, None
        if thread is None:
            return
        thread.join()
        error, self._background_error = self._background_error, None
        if error is not None:
            raise error

    def land(self, index: int, event: object) -> None:
        """Sub-group ``index``'s 16-bit result is issued and lands at ``event``: readers of it may go on."""
        with self._changed:
            if self._landed is not None:
                self._landed[index] = event
                self.streams.landed(index)
                self._changed.notify_all()

    def end(self) -> None:
        """The update is over (finished, or settled after an interruption): every sub-group is readable.

        Sub-groups not landed by then (an interruption finished or undid them on the host) are released here, after
        the last write to their 16-bit partitions: nothing waiting for them may go on before."""
        with self._changed:
            if self._landed is not None:
                for index in range(self.count):
                    if index not in self._landed:
                        self.streams.landed(index)
                self._last_landed = self._landed
            self._landed = None
            self._changed.notify_all()
