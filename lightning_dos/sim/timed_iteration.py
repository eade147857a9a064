"""The whole iteration on the virtual node: backward, the engine's update and the next forward, logged together.

:class:`TimedIteration` is the stream-race checker with DeepSpeed's side of an iteration given its work, so that
the replay (:func:`~lightning_dos.sim.replay.replay`) times the whole iteration on the virtual node's streams,
not the update alone:

- **backward**, on the training thread: each sub-group's layers on the compute stream (its share of
  ``backward_s``, the last sub-groups first), then DeepSpeed's copy of its reduced gradient to the host buffers
  (``lp_bytes`` per element, on DeepSpeed's reduce stream, behind those layers), then the end of backward
  (DeepSpeed's wait for its reduce stream), which the step's thread waits for;
- **the update**, on its own thread, as the engine issues it: after backward (``off``, ``forward``), or from the
  start of backward (``auto``), taking each host sub-group as its gradient's copy lands for as long as, on the
  virtual node's clock, it is free before backward ends (:class:`TimedBackward`: the engine's own arrivals loop,
  asked at each step whether backward has ended yet by replaying what has been logged so far);
- **the next forward**, on the training thread: each sub-group's layers on the compute stream (its share of
  ``forward_s``, the first sub-groups first), after the engine's wait for its landing (``forward``, ``auto``) or
  after the step returned (``off``).

Forward and backward run on the default stream, the engine's device kernels on its own compute stream (beside
them: their contention for the GPU is not modelled; on the default stream every forward kernel would queue behind
the update's waits for its uploads); the gradient copies share the download copy engine with the engine's
downloads. Not timed: DeepSpeed's all-gathers and reduce-scatters (NVLink), the host-side conversion of the
gradients into the fp32 buffers, and the resident sub-groups' gradient copies on the device.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning_dos.sim.deepspeed_model import ModelledBackward
from lightning_dos.sim.findings import DS_ALLGATHER, DS_REDUCE, HOST, NAMES, TRAINING, LoggedOp
from lightning_dos.sim.replay import ReplayResult
from lightning_dos.sim.sanitizer import StreamSanitizer
from lightning_dos.sim.simstreams import COMPUTE, SimEvent, SimStream

#: Marks between the host threads: backward has ended (the training thread's), the step has returned (the update's).
BACKWARD_END, UPDATE_RETURNED = -3_000_000, -3_000_001


class TimedIteration(StreamSanitizer):
    """The checker, with backward and the next forward given their work on the training thread.

    Args:
        sizes: the real sub-group sizes (elements), one per sub-group of the logged engine.
        scale: the replay's scale from the logged engine's sizes to ``sizes``.
        forward_s: seconds of one forward.
        backward_s: seconds of one backward.
        lp_bytes: bytes per element of the gradients DeepSpeed copies to the host (the model's dtype).
        host_sub_groups: the plan's host sub-groups: the only arrivals whose taking depends on the clock.
        replay: replays a log as the caller will (its copies rescaled, its rates), for :class:`TimedBackward`.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        scale: float,
        forward_s: float,
        backward_s: float,
        lp_bytes: int,
        host_sub_groups: set[int],
        replay: Callable[[list[LoggedOp]], ReplayResult],
    ) -> None:
        super().__init__()
        self.sizes, self.scale, self.lp_bytes, self.replay = list(sizes), scale, lp_bytes, replay
        self.host_sub_groups = host_sub_groups
        total = sum(sizes)
        self.forward_share = [forward_s * n / total for n in sizes]
        self.backward_share = [backward_s * n / total for n in sizes]
        #: Steps watched so far: from the second on (the steady state; the first brings resident state up) backward
        #: and the next forward get their work.
        self.steps = 0
        self._events = itertools.count(-4_000_000, -1)

    def _append(self, kind: str, stream: int = HOST, *, host: int = TRAINING, **fields: Any) -> None:
        self.log.append(LoggedOp(kind, stream, host=host, **fields))

    def log_backward(self, engine: Any, inputs: Any, handed: bool) -> list[tuple[int, SimEvent]]:
        """Log backward on the training thread; with ``handed`` (a step begun during backward) also model each
        gradient copy for the race check and return the sub-groups in the order their gradients become final,
        each with its copy's event."""
        reduce_stream = SimStream(DS_REDUCE, NAMES[DS_REDUCE])
        final = []
        for sg in reversed(engine.sub_groups_as_needed()):  # the forward's last first
            i = sg.index
            self._append("op", COMPUTE, lane="backward", sub_group=i, seconds=self.backward_share[i])
            layers = next(self._events)
            self._append("record", COMPUTE, event=layers)
            self._append("wait", DS_REDUCE, event=layers)
            nbytes = round(self.lp_bytes * self.sizes[i] / self.scale)
            self._append("op", DS_REDUCE, lane="grad_download", nbytes=nbytes, sub_group=i)
            copied = next(self._events)
            if handed:  # as ModelledBackward models it, without logging it on the update's thread
                grad = inputs.grads[sg.ds_group][sg.ds_offset : sg.ds_offset + sg.numel]
                self.model_access(DS_REDUCE, "deepspeed.partition_grads (one sub-group)", writes=[grad])
                self.syncs.create_event(copied)
                self.syncs.record_state(copied, DS_REDUCE)
                final.append((i, SimEvent(copied, reduce_stream)))
            self._append("record", DS_REDUCE, event=copied)
        # DeepSpeed's end of backward waits for its reduce stream; then the training thread ends backward.
        self._append("stream_sync", DS_REDUCE)
        self._append("host_record", event=BACKWARD_END)
        return final

    @property
    def timed(self) -> bool:
        """This step's backward and next forward are given their work (the steady state)."""
        return self.steps >= 2

    def backward_has_ended(self) -> bool:
        """On the virtual node's clock, has backward ended by the time the update's thread is where the log stops?"""
        result = self.replay(self.log)
        return result.host_clock_s.get(HOST, 0.0) >= result.marks_s[BACKWARD_END]

    def wait_for_backward_end(self) -> None:
        """The update's thread goes on once the training thread has ended backward."""
        self._append("host_wait", event=BACKWARD_END, host=HOST)

    # -- the seams of StreamSanitizer.watch ----------------------------------------------------------

    def backward(self, engine: Any, inputs: Any, backward_sync: bool) -> None:
        self.steps += 1
        if self.timed:
            self.log_backward(engine, inputs, handed=False)
            self.wait_for_backward_end()  # the step starts once backward is over
        super().backward(engine, inputs, backward_sync)

    def modelled_backward(self, engine: Any, inputs: Any, backward_sync: bool) -> ModelledBackward:
        self.steps += 1
        if self.timed:
            return TimedBackward(self, engine, inputs, backward_sync)
        return super().modelled_backward(engine, inputs, backward_sync)

    def next_forward(self, engine: Any, inputs: Any) -> None:
        if self.timed:  # overlap off: the forward runs once the step has returned
            self._append("host_record", event=UPDATE_RETURNED, host=HOST)
            self._append("host_wait", event=UPDATE_RETURNED)
            for sg in engine.sub_groups_as_needed():
                self._forward_layers(sg.index)
        super().next_forward(engine, inputs)

    def forward_layers(self, sub_group: Any) -> None:
        if self.timed:  # after the all-gather, which waited for the sub-group's landing
            gathered = next(self._events)
            self._append("record", DS_ALLGATHER, event=gathered)
            self._append("wait", COMPUTE, event=gathered)
            self._forward_layers(sub_group.index)

    def _forward_layers(self, index: int) -> None:
        self._append("op", COMPUTE, lane="forward", sub_group=index, seconds=self.forward_share[index])


class TimedBackward(ModelledBackward):
    """Backward as ``overlap="auto"`` meets it, on the virtual node's clock: the whole of backward is logged on the
    training thread when the engine first asks; after that the engine is handed the next final gradient while,
    replayed so far, its thread is free before backward ends, and backward's end once it is not (the rest of the
    step then waits for that end, as :meth:`GradientArrivals.end` makes it)."""

    def __init__(self, checker: TimedIteration, engine: Any, inputs: Any, backward_sync: bool) -> None:
        super().__init__(checker, engine, inputs, backward_sync)
        self.checker: TimedIteration = checker
        self.engine = engine
        self.pending: deque[tuple[int, SimEvent]] | None = None

    def next(self) -> tuple[int, object] | None:
        checker = self.checker
        if self.pending is None:
            self.pending = deque(checker.log_backward(self.engine, self.inputs, handed=True))
        if self.pending:
            index = self.pending[0][0]
            # Only a host sub-group's taking depends on the clock; the engine passes over the others.
            if index not in checker.host_sub_groups or not checker.backward_has_ended():
                return self.pending.popleft()
        checker.wait_for_backward_end()
        self.order = []  # the base class ends backward: DeepSpeed's synchronisation, then the step proceeds
        return super().next()
