"""Forward and backward as the adapter sees them: gradients becoming final, backward's end, phases.

Under ``overlap="auto"`` the step begins during backward, speculatively (committed once backward's end shows the
step is taken with the factor it began with): the adapter watches DeepSpeed's boundary copies of each gradient
partition, hands each engine sub-group whose gradient is final to the update, and marks
the end of backward with an event on the stream its copies ran on. It also times forward and backward for
the planner and measures their peak device memory for the engine's budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from lightning_dos.integration.phases import IterationPhases
from lightning_dos.model.overlap import AUTO, OFF

#: A planner that wants forward and backward times gets them from the 2nd iteration and every this many after
#: it: those iterations begin with no update in flight (their forward waits for nothing), which costs one
#: unoverlapped update each time.
MEASURE_PHASES_EVERY = 50


class BackwardHooks:
    """Forward and backward hooks: gradient arrivals, the end of backward, phases and their peak memory (a part of
    :class:`~lightning_dos.integration.zero3.adapter.ZeRO3Adapter`, which holds the state it reads)."""

    def _watch_gradients(self, z: object) -> None:
        """At each of DeepSpeed's copies of a reduced gradient partition into the host gradient buffers at the
        accumulation boundary: keep the device copy of resident sub-groups' part (no upload at the step), and under
        ``overlap="auto"`` learn when every element of an engine sub-group is final and hand it to the engine."""
        engine = self.engine
        #: Elements of each sub-group that backward has yet to make final this step (parameters without a gradient
        #: hold none; padding is never written).
        self._expected = [0] * len(engine.sub_groups)
        for flat, offset, numel in z.grad_position.values():
            for index, count in self._overlaps(flat, offset, numel):
                self._expected[index] += count
        self._missing: list[int] = []
        offload = z._offload_grad_partition_at_boundary

        def offload_at_boundary(param: object, grad_buffer: torch.Tensor, *args: object) -> None:
            offload(param, grad_buffer, *args)
            flat, offset, _ = z.grad_position[z.get_param_id(param)]
            if engine.resident:
                # On DeepSpeed's current stream too, so the event below covers it.
                engine.keep_gradient(flat, offset, grad_buffer)
            self._need_gradient_copied(self._overlaps(flat, offset, grad_buffer.numel()))
            if self.overlap != AUTO:
                return
            # The copy was issued on DeepSpeed's current (reduce) stream: its event is when the gradient lands.
            if self._early is None:
                if not self._begins_early():
                    return
                self._begin_early()
            landed = engine.streams.record(engine.streams.current)
            for index, count in self._overlaps(flat, offset, grad_buffer.numel()):
                self._missing[index] -= count
                if self._missing[index] == 0:
                    engine.grads_final(index, landed)

        z._offload_grad_partition_at_boundary = offload_at_boundary

    def _mark_backward_ends(self, z: object) -> None:
        """After DeepSpeed's end-of-backward epilogue, record an event on its reduce stream and hand it to the engine
        (:meth:`~lightning_dos.engine.loop.InterleavedUpdate.backward_ended`): every gradient copy into the host buffers
        and every kept gradient (``offload_at_boundary`` copies both on that stream) is queued before it, so the step
        waits for that work alone instead of the whole device. Unmanaged accumulation's boundary copy
        (``finalize_gradient_accumulation_boundary``) is issued on the caller's stream: marked there."""
        engine = self.engine

        def marked(method: Callable, stream: Callable[[], object]) -> Callable:
            def mark_after(*args: object, **kwargs: object) -> object:
                result = method(*args, **kwargs)
                engine.backward_ended(engine.streams.record(stream()))
                return result

            return mark_after

        def reduce_stream() -> object:  # the caller's stream where DeepSpeed has no reduce stream of its own
            has_own = hasattr(z, "reduce_and_partition_stream")
            return z.reduce_and_partition_stream if has_own else engine.streams.current

        z.independent_gradient_partition_epilogue = marked(z.independent_gradient_partition_epilogue, reduce_stream)
        if hasattr(z, "finalize_gradient_accumulation_boundary"):
            z.finalize_gradient_accumulation_boundary = marked(
                z.finalize_gradient_accumulation_boundary, lambda: engine.streams.current
            )

    def _overlaps(self, flat: int, offset: int, numel: int) -> Iterator[tuple[int, int]]:
        """(sub-group, elements) of flat partition ``flat``'s elements ``[offset, offset + numel)`` in each."""
        engine = self.engine
        for index in engine.sub_groups_of(flat, offset, numel):
            sg = engine.sub_groups[index]
            yield index, min(offset + numel, sg.ds_offset + sg.numel) - max(offset, sg.ds_offset)

    def _begin_early(self) -> None:
        """The first gradient of the step is final: take the plan made before backward, read the inputs, start the
        engine's step."""
        self._missing = list(self._expected)
        self._measure_peak()
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None or upcoming[0] != self.engine.steps_taken + 1:
            # Planning here would run the planner's collectives inside backward, in an order no rank agrees on.
            raise RuntimeError(
                "lightning-dos: a step began during backward with no plan made before it; the framework must call "
                "ZeRO3Adapter.before_backward before each backward"
            )
        _, plan, predicted = upcoming
        # The factor of a step that is not clipped (a norm of 0): a guess that backward's end confirms or refutes
        # (the step may be clipped, or skipped for a norm that is not finite).
        steps, inputs = self._inputs(predicted, 0.0)
        inputs.speculative = self.speculative
        self._early = (plan, inputs, steps)
        self.signals.hold()  # the update has begun (a no-op off the main thread: see before_backward)
        self.engine.begin_early(lambda arrivals: self._apply(plan, inputs, steps, arrivals))

    def _begins_early(self) -> bool:
        """Whether this step begins during backward: while the commit rate of its speculative updates says it pays
        (always where no spare slot was reserved: an engine driven without speculation)."""
        if not self.speculative:
            return True
        last = self.engine.last_report
        if last is not None:
            # A skipped step redoes nothing (its updates are dropped with it): only clipped steps count against.
            self.commit_policy.observe(last.step, None if last.skipped else last.committed)
        return self.commit_policy.speculates(self.engine.steps_taken + 1)

    def _measure_peak(self, begins: bool = False) -> None:
        """Under overlap, the most device memory held at once over this iteration's forwards and backwards (an
        accumulation's micro-batches together), handed to the engine as it is read (``forward_backward_peak``): the
        window opens at the first forward after a step (``begins``) and is read before and after each backward and
        at the step. On a GPU, ``torch.cuda.max_memory_allocated`` since a reset there (DOSMonitor resets it only at
        the batch's start and before backward, so each read still covers what came since the last)."""
        if self.overlap == OFF:
            return
        streams = self.engine.streams
        if begins:
            if not self._peak_window:
                streams.reset_peak()
                self._peak_window, self._peak = True, 0
            return
        if self._peak_window:
            peak = streams.peak_allocated()
            if peak is not None:
                self._peak = max(self._peak, peak)
                self.engine.record_forward_backward_peak(self._peak)

    def forward_begins(self) -> None:
        """Called on the main thread as each training forward begins. In an iteration measured for the planner
        (see :data:`MEASURE_PHASES_EVERY`), the update in flight is waited for first, so that the forward's time
        is its own.

        First, the update in flight's device side must be issued and its staging given back: that staging never
        meets the forward's activations, whichever thread runs first (the peak window opens after it, too)."""
        if self.overlap != OFF:
            self.engine.wait_device_side()
        self._need_forward_begins()
        self._measure_peak(begins=True)
        if not getattr(self.planner, "wants_phases", False) or self._steps_called % MEASURE_PHASES_EVERY != 1:
            return
        if self._phases is None:
            self.settle()
            self._phases = IterationPhases(self.engine.device)
        self._phases.forward_begins()

    def before_backward(self) -> None:
        """Called on the main thread before each backward: the step may begin during it, so signals are held from
        here (on an accelerator backward's hooks run on other threads, and the main thread runs Python handlers
        only once backward returns, inside DeepSpeed's backward, where they would cut the begun step short).

        Under overlap="auto" the step's plan is made here, once per step (the first micro-batch's backward),
        on the training thread (the previous update is over): the planner's collectives must not run inside
        backward, where each rank reaches a gradient hook when its own buckets fill, and its re-plan holds the GIL.
        It plans in the device memory free at the update (sampled at the previous step), not what backward's
        activations leave free here."""
        self._measure_peak()
        self._need_backward_begins()  # before planning: the plan takes the order the forward needs
        if self.overlap == AUTO:
            step = self.engine.steps_taken + 1
            if self._upcoming is None or self._upcoming[0] != step:
                self._upcoming = (step, *self._plan_now())
        if self._phases is not None:
            self._phases.backward_begins()
        # Gradients kept by an earlier backward belong to a step that was read or dropped already.
        self.engine.discard_kept_gradients()
        if self.overlap == AUTO:
            self.signals.hold()

    def after_backward(self) -> None:
        """Called after each backward that returned: with no step begun (not an accumulation boundary), the
        signals held since :meth:`before_backward` are delivered now."""
        self._measure_peak()
        self._need_backward_ended()
        if self._phases is not None:
            self._phases.backward_ends()
        if self.overlap == AUTO and not self.engine.in_flight:
            self.deliver()

    def _hand_over_phases(self) -> None:
        """At the step of a measured iteration, give the planner its forward and backward times (zeros when a
        micro-batch missed a mark: every rank hands over at the same step, for the ranks plan together)."""
        phases, self._phases = self._phases, None
        if phases is not None:
            self.planner.observe_phases(*(phases.seconds() or (0.0, 0.0)))
