"""Gradients becoming final during backward, handed to an update that starts before backward ends.

Under ``overlap="auto"`` the step begins during backward: the update thread takes each host sub-group as soon as
its gradient is final (backward has reduced every parameter in it, at the last micro-batch of an accumulation)
and updates it while backward goes on. This is exact only when a sub-group's update depends on nothing but its
own gradient: no gradient clipping and no fp16 loss scaling, and a finite global gradient norm, which only the end
of backward can tell (DeepSpeed skips a step whose norm is not finite). With clipping or loss scaling the update is
speculative (:mod:`lightning_dos.engine.speculation`). The end of backward therefore says whether the rest of the
step proceeds, with which gradient factor, or the step is skipped.

Backward's side (the framework, on its own thread) calls :meth:`GradientArrivals.arrive` and then
:meth:`GradientArrivals.end`; the update thread calls :meth:`GradientArrivals.next` until it returns None.
"""

from __future__ import annotations

import threading
from collections import deque


class GradientArrivals:
    """A queue of sub-groups whose gradients are final, closed when backward ends."""

    #: How backward ended: the rest of the step runs; the step is skipped (its gradient norm is not finite);
    #: backward never finished (it raised), so the step was not taken.
    RUN, SKIP, ABANDON = "run", "skip", "abandon"

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._final: deque[tuple[int, object]] = deque()
        #: None while backward goes on; then :attr:`RUN`, :attr:`SKIP` or :attr:`ABANDON`.
        self.proceed: str | None = None
        #: With :attr:`RUN`: the step's real gradient factor, now that the global norm is known (None: the one the
        #: step began with stands).
        self.inv_grad_scale: float | None = None

    def arrive(self, index: int, event: object = None) -> None:
        """Sub-group ``index``'s gradient is final; ``event`` is when its copy lands (None: it has landed)."""
        with self._changed:
            if self.proceed is None:
                self._final.append((index, event))
                self._changed.notify_all()

    def end(self, proceed: str, inv_grad_scale: float | None = None) -> None:
        """Backward is over, or abandoned: ``proceed`` (:attr:`RUN`, :attr:`SKIP` or :attr:`ABANDON`) says what
        follows, and ``inv_grad_scale`` the step's real gradient factor (see :attr:`inv_grad_scale`)."""
        with self._changed:
            if self.proceed is None:
                self.proceed = proceed
                self.inv_grad_scale = inv_grad_scale
            self._changed.notify_all()

    def next(self) -> tuple[int, object] | None:
        """The next final gradient, blocking while backward goes on; None once backward has ended (arrivals not
        yet taken then are left to the rest of the step, or dropped when it is skipped)."""
        with self._changed:
            self._changed.wait_for(lambda: self._final or self.proceed is not None)
            if self.proceed is None:
                return self._final.popleft()
            return None
