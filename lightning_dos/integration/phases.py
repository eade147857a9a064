"""Forward and backward times of one iteration, on the device's own clock.

The placement that minimises the whole iteration (:func:`~lightning_dos.model.iteration_plan.iteration_plan`) needs
how long forward and backward take. On an accelerator both run asynchronously, so the host's clock says when they
were launched, not how long they ran: each phase boundary records a timing event on the current stream instead,
and the events are read once the phases are over (DeepSpeed synchronises at the end of backward). Without an
accelerator the host's clock is the device's.

A forward that overlaps an update waits for the sub-groups it reads, so its time is not the forward's own: the
framework measures an iteration only when no update is in flight as its forward begins (see
:class:`IterationPhases`). Several micro-batches (gradient accumulation) add up.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class DeviceClock:
    """Marks on the device's own timeline: a CUDA timing event recorded on the current stream (taking one costs no
    synchronisation; it is read once the work before it has run), or the host's clock without an accelerator. The
    one clock of forward and backward: :class:`IterationPhases` (the planner's phases) and ``DOSMonitor`` (the
    logged phase times) both read it.

    Args:
        device: the device the timed work runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A mark at this point of the device's work."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: Any) -> bool:
        """Whether the device has reached ``mark`` (reading it then costs no wait)."""
        return not self._cuda or bool(mark.query())

    def wait(self, mark: Any) -> None:
        """Block until the device has reached ``mark``."""
        if self._cuda:
            mark.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` on the device (waits for ``end`` first, if it is not reached yet)."""
        if not self._cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class IterationPhases:
    """Marks of one iteration's forwards and backwards; :meth:`seconds` sums them.

    Args:
        device: the device forward and backward run on (its :class:`DeviceClock`).
    """

    def __init__(self, device: torch.device) -> None:
        self._clock = DeviceClock(device)
        #: (forward begins, backward begins, backward ends) per micro-batch; a mark is None until reached.
        self._marks: list[list[object]] = []

    def forward_begins(self) -> None:
        self._marks.append([self._clock.mark(), None, None])

    def backward_begins(self) -> None:
        if self._marks and self._marks[-1][1] is None:
            self._marks[-1][1] = self._clock.mark()

    def backward_ends(self) -> None:
        if self._marks and self._marks[-1][1] is not None and self._marks[-1][2] is None:
            self._marks[-1][2] = self._clock.mark()

    def seconds(self) -> tuple[float, float] | None:
        """(forward, backward) seconds summed over the micro-batches; None if a micro-batch missed a mark (a
        forward without backward: manual optimisation that skipped one, or an interruption). At the end of
        backward DeepSpeed has synchronised, so reading the marks waits for nothing."""
        if not self._marks or any(mark is None for marks in self._marks for mark in marks):
            return None
        seconds = self._clock.seconds
        forward = sum(seconds(begin, middle) for begin, middle, _ in self._marks)
        backward = sum(seconds(middle, end) for _, middle, end in self._marks)
        return forward, backward
