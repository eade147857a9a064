"""Forward and backward times of one iteration, on the device's own clock.

The placement that minimises the whole iteration (:func:`~lightning_dos.model.iteration.iteration_plan`) needs
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

import torch


class IterationPhases:
    """Marks of one iteration's forwards and backwards; :meth:`seconds` sums them.

    Args:
        device: the device forward and backward run on (a ``cuda`` device records CUDA timing events on its
            current stream; any other reads the host's clock).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        #: (forward begins, backward begins, backward ends) per micro-batch; a mark is None until reached.
        self._marks: list[list[object]] = []

    def _mark(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_begins(self) -> None:
        self._marks.append([self._mark(), None, None])

    def backward_begins(self) -> None:
        if self._marks and self._marks[-1][1] is None:
            self._marks[-1][1] = self._mark()

    def backward_ends(self) -> None:
        if self._marks and self._marks[-1][1] is not None and self._marks[-1][2] is None:
            self._marks[-1][2] = self._mark()

    def _elapsed(self, start: object, end: object) -> float:
        if not self._cuda:
            return end - start
        end.synchronize()  # at the end of backward, DeepSpeed has synchronised: this returns at once
        return start.elapsed_time(end) / 1000.0

    def seconds(self) -> tuple[float, float] | None:
        """(forward, backward) seconds summed over the micro-batches; None if a micro-batch missed a mark (a
        forward without backward: manual optimisation that skipped one, or an interruption)."""
        if not self._marks or any(mark is None for marks in self._marks for mark in marks):
            return None
        forward = sum(self._elapsed(begin, middle) for begin, middle, _ in self._marks)
        backward = sum(self._elapsed(middle, end) for _, middle, end in self._marks)
        return forward, backward
