"""DeepSpeed's side around the engine's calls, as the race checker models it from DeepSpeed's source: gradient
copies into the host buffers on its reduce stream during backward (and the host's wait for that stream at the
end of backward, unless the accelerator resolves data dependencies itself), and the next forward's all-gathers
reading the 16-bit partitions on a stream of their own, waiting only for what the engine makes them wait for."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.observer import EngineObserver
from lightning_dos.sim.findings import (
    DS_ALLGATHER,
    DS_REDUCE,
    HOST,
    NAMES,
    TRAINING,
    LoggedOp,
)
from lightning_dos.sim.simstreams import (
    COMPUTE,
    SimEvent,
    SimStream,
)


class ModelledFramework(EngineObserver):
    """The engine's observer (:mod:`lightning_dos.engine.observer`) that models DeepSpeed around it: each hook given
    by name (``step``, ``flush``, ``drop``, ``start``, ``wait_all``) is called with the engine's own implementation
    to run first, then that call's arguments; the others pass straight through."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        self._hooks = hooks

    def _around(self, name: str, run: Callable[..., Any], *args: Any) -> Any:
        hook = self._hooks.get(name)
        return hook(run, *args) if hook is not None else run(*args)

    def step(self, run: Callable[..., Any], plan: Any, inputs: Any, arrivals: Any) -> Any:
        return self._around("step", run, plan, inputs, arrivals)

    def flush(self, run: Callable[[], None]) -> None:
        self._around("flush", run)

    def drop(self, run: Callable[[], None]) -> None:
        self._around("drop", run)

    def start(self, run: Callable[..., None], work: Callable[[], None]) -> None:
        self._around("start", run, work)

    def wait_all(self, run: Callable[[], None]) -> None:
        self._around("wait_all", run)


class DeepSpeedModel:
    """DeepSpeed's backward and the next forward around the engine (a part of
    :class:`~lightning_dos.sim.sanitizer.StreamSanitizer`, which holds the state it reads)."""

    def watch(
        self,
        engine: Any,
        backward_sync: bool = True,
        overlap: bool = False,
        early: bool = False,
        threaded: bool = False,
        clipped: bool | None = None,
    ) -> None:
        """Run ``engine``'s step, flush and drop under the checker, with DeepSpeed's accesses modelled.

        Args:
            engine: an :class:`~lightning_dos.engine.loop.InterleavedUpdate` built on :meth:`streams`.
            backward_sync: DeepSpeed's ``reduce_and_partition_stream.synchronize()`` at the end of backward,
                which it skips on accelerators that resolve data dependencies themselves.
            overlap: model the next forward of ``overlap="forward"`` (each all-gather after the engine's wait for
                its sub-groups, while the update may still run) instead of ``"off"``'s (after the step returned).
            early: begin each step during backward, as ``overlap="auto"`` does: the step is handed the modelled
                backward (:class:`ModelledBackward`), which copies one sub-group's gradient at a time on
                DeepSpeed's reduce stream and reports it final with that copy's event.
            threaded: the step runs inside work given to ``engine.start`` (as the adapter's overlapped update runs:
                the step, then what its caller does after it, such as taking a step interrupted before any change
                whole on the host), all of it checked on the update thread; the next forward is modelled once the
                training thread has joined it (``engine.wait_all``), each sub-group's reads ordered only by the
                engine's release of that sub-group (its wait returning), so that a write to a 16-bit partition
                after its release is a race, wherever in the work it comes. Implies ``overlap``.
            clipped: with ``early``, the steps' updates during backward are speculative (``inputs.speculative``)
                and backward ends with the real gradient factor: the one they began with (False: committed), or
                half of it (True: the step is clipped, so they are restored and redone). None: not speculative.
        """
        pool = engine.pool
        slabs = [pool.param, *pool.states]
        for slab, label in zip(slabs, ("param", *engine.rule.states), strict=True):
            self.name(slab, f"{label} slab")
        if pool.lp_staging is not None:
            self.name(pool.lp_staging.storage, "16-bit staging ring")
        #: The inputs of the threaded update whose next forward is still to model.
        joined: list[Any] = []

        def watched_step(step: Any, plan: Any, inputs: Any, arrivals: Any = None) -> Any:
            # The training thread starts the update (on a thread of its own under overlap) after waiting for the
            # previous one (its backward does), so both threads are in step here.
            states = self.syncs.current_sync_states
            self.syncs._state_wait_for_other(states[HOST], states[TRAINING])
            self.syncs._state_wait_for_other(states[TRAINING], states[HOST])
            for i, (grad, lp) in enumerate(zip(inputs.grads, inputs.lp_targets, strict=True)):
                self.name(grad, f"gradient buffer {i}")
                # In device memory, unless DeepSpeed offloads parameters (then the engine downloads 16-bit results).
                self.name(lp, f"16-bit partition {i}", device=not engine.lp_downloads)
            # Forward and backward use the gathered parameters on the default stream once it has waited for
            # the all-gather (partitioned_param_coordinator: current_stream().wait_stream(allgather_stream)).
            self.stream_wait_stream(COMPUTE, DS_ALLGATHER)
            # Backward: the reduce stream waits for the default stream (stage3: wait_stream(current_stream()))
            # and copies each gradient partition into the host buffers.
            self.stream_wait_stream(DS_REDUCE, COMPUTE)
            # On it too, the adapter's copies of those gradients into resident sub-groups' device slots
            # (keep_gradient), which the step reads instead of uploading.
            kept = engine.kept_gradient_slots
            if kept:
                self.model_access(DS_REDUCE, "lightning_dos.keep_gradient", writes=kept)
            if early and arrivals is None:
                arrivals = self.modelled_backward(engine, inputs, backward_sync)
                if clipped is not None:
                    arrivals.real_inv_grad_scale = inputs.inv_grad_scale * (0.5 if clipped else 1.0)
            elif arrivals is None:
                self.backward(engine, inputs, backward_sync)
            self._landings.clear()
            if threaded:
                joined[:] = [inputs]
            with self.active():
                report = step(plan, inputs, arrivals)
            if threaded:
                return report  # the forward comes once the whole work is joined (watched_wait_all)
            if overlap:
                self._overlapped_forward(engine, inputs)
                # The training thread's backward, checkpoints and evaluation come after it joined the update.
                states = self.syncs.current_sync_states
                self.syncs._state_wait_for_other(states[TRAINING], states[HOST])
            else:
                self.next_forward(engine, inputs)
            return report

        def watched_flush(flush: Any) -> None:
            with self.active():
                flush()
            # The checkpoint then reads the host slabs.
            self.model_access(HOST, "checkpoint.save", reads=slabs)

        def watched_drop(drop: Any) -> None:
            # A checkpoint load has just written the host slabs.
            self.model_access(HOST, "checkpoint.load", writes=slabs)
            with self.active():
                drop()

        def watched_start(start: Any, work: Any) -> None:
            def checked() -> None:
                with self.active():  # dispatch modes are per thread: check the update thread's work
                    work()

            start(checked)

        def watched_wait_all(wait_all: Any) -> None:
            try:
                wait_all()
            finally:
                if joined:
                    self._overlapped_forward(engine, joined.pop())
                    states = self.syncs.current_sync_states
                    self.syncs._state_wait_for_other(states[TRAINING], states[HOST])

        hooks = {"step": watched_step, "flush": watched_flush, "drop": watched_drop}
        if threaded:
            hooks.update(start=watched_start, wait_all=watched_wait_all)
        engine.watch(ModelledFramework(**hooks))

    def backward(self, engine: Any, inputs: Any, backward_sync: bool) -> None:
        """Backward before a step that starts after it: DeepSpeed's reduce stream writes every gradient into the
        host buffers, and the host waits for that stream at its end (when ``backward_sync``)."""
        self.model_access(DS_REDUCE, "deepspeed.partition_grads", writes=inputs.grads)
        if backward_sync:
            self.stream_synchronize(DS_REDUCE)
        self.end_of_backward(engine)

    def end_of_backward(self, engine: Any) -> None:
        """The adapter's event at the end of backward (after DeepSpeed's epilogue) on DeepSpeed's reduce stream,
        handed to the engine: the step's only wait for backward's gradient copies (no device-wide wait)."""
        event = SimEvent(next(self._backward_events), SimStream(DS_REDUCE, NAMES[DS_REDUCE]))
        self.on_record(event)
        engine.backward_ended(event)

    def modelled_backward(self, engine: Any, inputs: Any, backward_sync: bool) -> ModelledBackward:
        """Backward handed to a step begun during it (``overlap="auto"``)."""
        return ModelledBackward(self, engine, inputs, backward_sync)

    def next_forward(self, engine: Any, inputs: Any) -> None:
        """The next forward after a step that returned with everything landed: DeepSpeed all-gathers each whole
        16-bit partition on its own stream, waiting for nothing of ours."""
        self.model_access(DS_ALLGATHER, "deepspeed.allgather", reads=inputs.lp_targets)

    def forward_layers(self, sub_group: Any) -> None:
        """The overlapped forward has gathered ``sub_group``'s parameters: its layers run (no access of ours)."""

    def _overlapped_forward(self, engine: Any, inputs: Any) -> None:
        """The next forward under ``overlap="forward"``: on the training thread, while the update may still run,
        each all-gather first waits for its sub-groups (``engine.wait_sub_groups``, its stream waiting as on a GPU)
        and then reads their 16-bit partitions on the all-gather stream; a host read (``GatheredParameters``) after
        the host waited follows. Modelled one sub-group at a time, in order, as the forward reaches
        them; only what the engine's wait orders is ordered, not the update's own final waits."""
        self.host = TRAINING
        gather_stream = SimStream(DS_ALLGATHER, NAMES[DS_ALLGATHER])
        try:
            for sg in engine.sub_groups_as_needed():  # as the forward reaches them
                landing = self._landings.get(sg.index)
                # The condition variable the engine's wait blocks on. A sub-group the update never released
                # (it would wait for ever) is read unordered, so that whatever wrote it is reported.
                if landing is not None:
                    self.syncs.stream_wait_for_event(TRAINING, landing)
                    self._log(LoggedOp("host_wait", event=landing))
                partition = inputs.lp_targets[sg.ds_group][sg.ds_offset : sg.ds_offset + sg.numel]
                # The coordinator's all-gather, as on a GPU: its stream waits for the sub-group's landing event.
                engine.wait_sub_groups([sg.index], gather_stream)
                self.model_access(DS_ALLGATHER, "deepspeed.allgather (overlapped forward)", reads=[partition])
                # deepspeed.zero.GatheredParameters (a callback's read): the host waits, then reads.
                engine.wait_sub_groups([sg.index])
                self.model_access(TRAINING, "GatheredParameters (overlapped forward)", reads=[partition])
                self.forward_layers(sg)
        finally:
            self.host = HOST


class ModelledBackward(GradientArrivals):
    """Backward as ``overlap="auto"`` meets it, in the update's own thread of control: each time the engine asks for
    the next final gradient, DeepSpeed's reduce stream copies one sub-group's gradient into the host buffers (the
    last sub-groups first, as backward visits the last layers first) and the sub-group is reported final with that
    copy's event; after the last one, backward ends (with DeepSpeed's end-of-backward synchronisation when
    ``backward_sync``) and the step proceeds."""

    def __init__(self, checker: Any, engine: Any, inputs: Any, backward_sync: bool) -> None:  # a StreamSanitizer
        super().__init__()
        self.checker, self.inputs, self.backward_sync, self.engine = checker, inputs, backward_sync, engine
        self.order = list(reversed(engine.sub_groups_as_needed()))  # the forward's last first
        self.reduce = SimStream(DS_REDUCE, NAMES[DS_REDUCE])
        self.events = itertools.count(-1_000_000, -1)
        #: The gradient factor backward's end hands the step (None: the one it began with).
        self.real_inv_grad_scale: float | None = None
        #: What backward's end says follows: the step runs, or it is skipped (fp16 overflow, a non-finite norm).
        self.outcome: str = GradientArrivals.RUN

    def next(self) -> tuple[int, object] | None:
        checker = self.checker
        if not self.order:
            if self.backward_sync:
                checker.stream_synchronize(DS_REDUCE)
            checker.end_of_backward(self.engine)
            self.end(self.outcome, self.real_inv_grad_scale)
            return None
        sg = self.order.pop(0)
        grad = self.inputs.grads[sg.ds_group][sg.ds_offset : sg.ds_offset + sg.numel]
        checker.model_access(DS_REDUCE, "deepspeed.partition_grads (one sub-group)", writes=[grad])
        event = SimEvent(next(self.events), self.reduce)
        checker.on_record(event)
        return sg.index, event
