"""Which thread does what: the update's thread selects the engine's device before it issues anything.

A new thread's current CUDA device is device 0. The engine's update runs on a thread of its own under overlap, and
leaving ``torch.cuda.stream(s)`` there restores device 0's current stream, which creates a CUDA context on GPU 0 in
every rank whose GPU is another (about 0.5 GB each; an error on a GPU in EXCLUSIVE_PROCESS mode). On the simulated
accelerator a stream operation from a thread that has not bound the engine's device is an error, so CI sees it.
Real Lightning Trainer, real DeepSpeed ZeRO-3, on CPU, for the Trainer runs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model.plan import Place, Plan
from lightning_dos.sim.simstreams import SimStreams, UnboundThreadError
from tests.helpers import TinyLM, loader, trainer
from tests.test_stream_sanitizer import _engine_with

NUMELS, GROUPS, SUB_GROUP = (48, 40, 64), (0, 1, 1), 16  # 10 sub-groups over 3 flats, 2 param groups
HYPERS = (Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True), Hyper(3e-3, 0.8, 0.95, 1e-6, 0.0, True))
#: Host and streamed sub-groups in turn.
PLAN = Plan(tuple(Place.HOST if i % 2 else Place.DEVICE for i in range(10)), 2)
#: The engine with its update thread's binding removed.
UNBOUND = "self.streams.bind_thread()"


def test_a_stream_operation_from_a_thread_that_never_bound_the_device_is_an_error() -> None:
    streams = SimStreams(torch.device("cpu"))
    streams.record(streams.h2d)  # the thread that built the streams is the framework's, bound already
    seen: list[BaseException] = []

    def other() -> None:
        try:
            streams.wait(streams.d2h, streams.record(streams.h2d))
        except UnboundThreadError as error:
            seen.append(error)
        streams.bind_thread()
        streams.host_wait(streams.record(streams.h2d))  # once bound, fine
        with streams.on(streams.d2h):
            streams.empty(4, torch.float32)

    thread = threading.Thread(target=other, name="not-bound")
    thread.start()
    thread.join()
    assert len(seen) == 1 and streams.unbound == [str(seen[0])]
    assert "'not-bound'" in str(seen[0]) and "recording an event on the h2d stream" in str(seen[0])
    assert streams.issuers == {threading.current_thread().name, "not-bound"}


def _engine(engine_class: type) -> tuple[InterleavedUpdate, SimStreams]:
    streams = SimStreams(torch.device("cpu"))
    engine = engine_class(NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.float32, pin=False, streams=streams)
    return engine, streams


def _inputs(step: int) -> StepInputs:
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(n, generator=gen) for n in NUMELS]
    return StepInputs(grads, [torch.zeros(n) for n in NUMELS], HYPERS, [step] * len(NUMELS))


def _overlapped_steps(engine: InterleavedUpdate, early: bool) -> None:
    """Two steps on the engine's background thread: started after backward (``overlap="forward"``), or begun
    during it with each host sub-group's gradient reported final (``"auto"``)."""
    for step in (1, 2):
        inputs = _inputs(step)
        if early:
            engine.begin_early(lambda arrivals, inputs=inputs: engine.step(PLAN, inputs, arrivals))
            for index in PLAN.host_indices:
                engine.grads_final(index)
            engine.end_backward(True)
        else:
            engine.start(lambda inputs=inputs: engine.step(PLAN, inputs))
        engine.wait_all()


@pytest.mark.parametrize("early", [False, True], ids=["after backward", "begun during backward"])
def test_the_update_thread_binds_the_engines_device_before_any_stream_operation(early: bool) -> None:
    engine, streams = _engine(InterleavedUpdate)
    _overlapped_steps(engine, early)
    assert "lightning-dos-update" in streams.issuers, "the update issued its stream operations on its own thread"
    assert streams.unbound == []
    assert engine.last_report.device_elements > 0 and engine.last_report.host_elements > 0
    # The check bites: the same engine without the binding issues from a thread on device 0.
    mutant, streams = _engine(_engine_with(UNBOUND, "pass"))
    with pytest.raises(BaseException):  # noqa: B017 - whatever the update's recovery makes of it
        _overlapped_steps(mutant, early)
    assert streams.unbound and all("'lightning-dos-update'" in line for line in streams.unbound), streams.unbound


@pytest.mark.parametrize("overlap", ["forward", "auto"])
def test_under_a_trainer_no_stream_operation_comes_from_a_thread_that_has_not_bound_the_device(overlap: str) -> None:
    """And host_threads="auto" with overlap on: the calibration carries the contention shares the model charges,
    measured on the threads the update runs on, which on a CPU device (forward and backward on the same threads)
    are every core."""
    before = torch.get_num_threads()
    try:
        strategy = DeepOptimizerStatesStrategy(
            gpu_fraction=0.5, sub_group_size=700, streams_factory=SimStreams, overlap=overlap
        )
        trainer(strategy, steps=3, gradient_clip_val=None).fit(TinyLM(), loader())
        streams = strategy.dos_engine.streams
        assert "lightning-dos-update" in streams.issuers and streams.unbound == []
        placement, rates = strategy.dos_host_placement, strategy.dos_calibration.measured
        cores = len(placement.cores or ())
        assert placement.threads == torch.get_num_threads()
        assert placement.threads == cores and "one core left" not in placement.why
        shares = (rates.overlap_copy_speed, rates.overlap_host_speed, rates.overlap_launch_speed)
        assert all(0 < share <= 1 for share in shares) and shares != (1.0, 1.0, 1.0), shares
    finally:
        torch.set_num_threads(before)
