"""What keeps an update atomic: a guard for readers of the optimizer state, and per-sub-group progress.

An update changes, sub-group by sub-group, the fp32 master weights, both Adam moments, the 16-bit
parameters and (on the host) the gradient, which is unscaled in place. Anything that reads that state
halfway (a checkpoint from another thread, or a hook) would see some sub-groups post-step and the rest
pre-step. :class:`UpdateGuard` makes such readers wait for the update to end. :class:`UpdateProgress`
records how far each sub-group got, so that when an exception interrupts the update the engine can
finish the remaining sub-groups on the host without applying any sub-group's step (or unscaling its
gradient) twice.

Framework-free, like the rest of the engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

PRE_STEP = "pre-step"
POST_STEP = "post-step"


class UpdateInFlightError(RuntimeError):
    """The optimizer state was requested from inside the update that is changing it."""


class UpdateInterrupted(RuntimeError):
    """An exception interrupted an update; :attr:`state` says where the optimizer state was left.

    Attributes:
        state: ``"pre-step"`` (nothing was changed: the step was not taken) or ``"post-step"`` (every
            sub-group was updated exactly once: the step was taken).
        error: the exception that interrupted the update.
        report: post-step, the report of the step as it was finished (None: pre-step).
    """

    def __init__(self, message: str, state: str, error: BaseException, report: object = None) -> None:
        super().__init__(message)
        self.state = state
        self.error = error
        self.report = report


class TornStateError(RuntimeError):
    """An interrupted update could be neither finished nor undone: the in-memory state mixes two steps."""


class UpdateGuard:
    """Lets an update and readers of the state it changes exclude each other.

    The update holds the guard for its whole duration (the engine's step and whatever its caller stores
    with it, nested on the same thread). A reader from another thread waits for the update to end; a
    reader on the updating thread itself (a hook called from inside the update) cannot wait for it
    without deadlocking, so it is refused with :class:`UpdateInFlightError`.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._updating_thread: int | None = None
        self._depth = 0

    @property
    def in_update(self) -> bool:
        """True while an update holds the guard (on any thread)."""
        return self._updating_thread is not None

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold the guard for an update (re-entrant on the same thread)."""
        with self._lock:
            self._depth += 1
            self._updating_thread = threading.get_ident()
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._updating_thread = None

    @contextlib.contextmanager
    def reading(self, what: str) -> Iterator[None]:
        """Read the state consistently: wait for an update on another thread; refuse one on this thread."""
        if self._updating_thread == threading.get_ident():
            raise UpdateInFlightError(
                f"lightning-dos: {what} was requested from inside the optimizer update (a hook or signal handler "
                "running in the middle of it), where the state is half-updated; request it after the step "
                "(for example in on_train_batch_end)"
            )
        with self._lock:
            yield


@dataclass
class UpdateProgress:
    """How far each sub-group of the update in flight has got.

    Attributes:
        places: where each sub-group is updated this step (the plan after fitting), once decided.
        touched: some state (slab, moment, 16-bit parameter or host gradient) has been changed.
        unscaled: host sub-groups whose gradient has been unscaled in place (must not be unscaled again).
        updated: sub-groups whose optimizer state (on the host, or on the device for resident ones) is post-step.
        downloading: streamed sub-groups whose download home has begun, with the device views it copies from.
        done: sub-groups fully post-step: state home (or resident) and 16-bit parameter written.
    """

    places: tuple | None = None
    touched: bool = False
    unscaled: set[int] = field(default_factory=set)
    updated: set[int] = field(default_factory=set)
    downloading: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def reached(self, point: str, index: int, device_views: tuple[torch.Tensor, ...] | None = None) -> None:
        """Record that sub-group ``index`` reached ``point`` (one of the lanes' progress points)."""
        if point == "unscaled":
            self.unscaled.add(index)
        elif point == "updated":
            self.updated.add(index)
        elif point == "downloading":
            assert device_views is not None
            self.downloading[index] = device_views
        elif point == "done":
            self.downloading.pop(index, None)
            self.done.add(index)
        # Every point but a flush of resident state (which copies values unchanged) follows a change.
        if point != "flush":
            self.touched = True
