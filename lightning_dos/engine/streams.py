"""Transfer streams and events: the interface the engine issues its asynchronous work through.

On CUDA the engine uses four side streams: ``h2d`` uploads device sub-groups' fp32 state,
``lp_h2d`` uploads host-cast 16-bit parameters, ``d2h`` downloads updated state, and ``compute`` runs
the device update's kernels. Host-side 16-bit uploads get a stream of their own so that they never
queue behind a device upload that is waiting for a free staging buffer (a FIFO stream would hold them,
and the PCIe link, idle). The kernels get one for the same reason: each waits for its sub-group's
upload, and on the default stream the next forward's kernels (issued by the training thread while the
update runs, with ``overlap`` on) would queue behind every one of those waits.

Three implementations share one interface:

- :class:`CudaStreams`: real CUDA streams and events.
- :class:`SyncStreams`: a CPU "device", where every operation is synchronous, so streams and events
  are no-ops and the engine skips the staging that only an accelerator needs.
- a simulated accelerator (``lightning_dos.sim``, chosen explicitly by tests and tools): synchronous
  too, but every stream and event has an identity, so a checker can verify the engine's waits.

The engine issues every operation as ``with streams.lane(lane, sub_group, nbytes, stream): ...``: that one
call switches streams, records the operation's span for the monitor's timeline, and tells a simulation
which operation is being issued, so the engine's loop reads as the algorithm alone.

A thread that issues work (the engine's update runs on a thread of its own under overlap) first calls
:meth:`Streams.bind_thread`: a new thread's current CUDA device is device 0, and leaving ``torch.cuda.stream(s)``
restores device 0's current stream, which creates a CUDA context on GPU 0 in a process whose GPU is another (about
0.5 GB on GPU 0 per rank; an error on a GPU in EXCLUSIVE_PROCESS mode).

Whether the engine stages its 16-bit uploads in pinned host memory is :attr:`Streams.is_async`, a
property of the streams object, not of the device type, so a simulated accelerator takes the same
path as CUDA.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_dos.engine.hostslab import Registrar, default_registrar
from lightning_dos.model.step_report import Span


class Streams:
    """The engine's side streams on ``device``; this base class is the synchronous CPU stand-in.

    Attributes:
        device: where the engine's device-side tensors live.
        is_async: True when work issued on a stream may still be running after the call returns (CUDA,
            or a simulation of it); the engine then stages host-cast 16-bit parameters for an upload.
        timing: record events with timing enabled (the monitor turns this on).
        h2d: host-to-device stream for device sub-groups' fp32 state (None when synchronous).
        lp_h2d: host-to-device stream for host-cast 16-bit parameters (None when synchronous).
        d2h: device-to-host stream for updated state (None when synchronous).
        compute: the stream the device update's kernels run on (None when synchronous).
    """

    is_async = False

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.device = device
        self.timing = timing
        self.h2d: Any = None
        self.lp_h2d: Any = None
        self.d2h: Any = None
        self._timeline = Timeline(self, enabled=False)

    def host_registrar(self) -> Registrar | None:
        """What registers the engine's host slabs for this device's copies: ``cudaHostRegister`` where CUDA is
        available, nothing on a CPU (:func:`~lightning_dos.engine.hostslab.default_registrar`)."""
        return default_registrar()

    # -- issuing work: one operation of one lane at a time ------------------------------------------

    def bind_thread(self) -> None:
        """Select ``device`` as the calling thread's current device, before the thread issues any stream operation
        (nothing to select when synchronous)."""

    def start_timeline(self, enabled: bool) -> None:
        """Start this step's timeline; with ``enabled`` False nothing is recorded (no extra events)."""
        self.timing = enabled
        self._timeline = Timeline(self, enabled)

    @contextlib.contextmanager
    def lane(self, lane: str, sub_group: int, nbytes: int, stream: Any = None) -> Iterator[None]:
        """Issue the enclosed work on ``stream`` (None: the host thread) as one operation of ``lane`` on
        ``sub_group``, moving ``nbytes``: the timeline records its span, a simulation knows its lane."""
        timeline = self._timeline
        with self.on(stream):
            start = timeline.mark(stream)
            yield
            timeline.add(lane, sub_group, start, timeline.mark(stream), nbytes)

    def host_span(self, lane: str, sub_group: int, start: float, end: float, nbytes: int) -> None:
        """Record a span of ``lane`` the host timed itself, ``start`` and ``end`` on ``time.perf_counter``'s clock
        (the NVMe tier's requests, from issue to the host's wait): kept only while this step is timed."""
        self._timeline.add(lane, sub_group, start, end, nbytes)

    def spans(self) -> list[Span]:
        """The spans of the step's timeline; call after the step's final wait, so no event is pending."""
        return self._timeline.resolve()

    # -- streams and events -------------------------------------------------------------------------

    @property
    def compute(self) -> Any:
        """The stream the engine's device kernels run on (None when synchronous)."""
        return None

    @property
    def current(self) -> Any:
        """The calling thread's current stream (DeepSpeed's, inside its hooks); None when synchronous."""
        return None

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Issue the enclosed work on ``stream`` (nothing to switch when synchronous)."""
        yield

    def record(self, stream: Any) -> Any:
        """Record an event at the current tail of ``stream``; None when synchronous (work is already done)."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, not the host) for ``event``."""

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed, without blocking; True orders what follows after it, as
        :meth:`host_wait` does (CUDA's ``Event.query``). Synchronous work is always done."""
        return True

    def device_synchronize(self) -> None:
        """Wait for all work on the device, DeepSpeed's side streams included."""

    @contextlib.contextmanager
    def host_sync(self, reason: str) -> Iterator[None]:
        """The enclosed work synchronises the host with the device on purpose (reads a device value, waits for
        an event or the device), for ``reason``. Inside a lane issued on a device stream such a synchronisation
        stalls the launch loop behind everything queued so far, so the simulated accelerator's checker reports
        every one it finds there that is not declared here (docs/stream-sanitizer.md); nothing on a device."""
        if not reason:
            raise ValueError("a host synchronisation in the update's device lanes needs a reason")
        yield

    def landed(self, sub_group: int) -> None:
        """The host thread running the update has issued ``sub_group``'s 16-bit result and lets other threads
        read it (after waiting for its event); nothing to do on a real device, a race checker notes the moment."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate ``numel`` elements of device memory (staging and resident blocks come from here)."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s block was used on ``stream``: once it is freed, the allocator may hand it out again only after
        the work queued on ``stream`` by then has run (CUDA's ``Tensor.record_stream``). Nothing when synchronous."""

    # -- device memory ------------------------------------------------------------------------------

    def device_memory(self) -> tuple[int, int] | None:
        """(bytes free for new tensors now, bytes tensors may hold in all) on the device; None: no limit known (a
        CPU device). Memory the caching allocator holds but no tensor uses counts as free."""
        return None

    def reset_peak(self) -> None:
        """Start a new window for :meth:`peak_allocated`."""

    def peak_allocated(self) -> int | None:
        """The most bytes tensors held on the device at once since :meth:`reset_peak`; None when unknown."""
        return None


class Timeline:
    """Collects spans: host spans from the wall clock, device spans from stream events (timing only)."""

    def __init__(self, streams: Streams, enabled: bool) -> None:
        self.enabled = enabled
        self.streams = streams
        self.t0 = time.perf_counter()
        self.origin = streams.record(streams.compute) if enabled else None
        self._pending: list[tuple[str, int, object, object, int]] = []

    def mark(self, stream: Any) -> object:
        """A point on ``stream``: an event on an accelerator, the wall clock on the host (or on a CPU device,
        where work is done when issued). Nothing at all when timing is off."""
        if not self.enabled:
            return None
        return self.streams.record(stream) if stream is not None else time.perf_counter()

    def add(self, lane: str, sub_group: int, start: object, end: object, nbytes: int) -> None:
        if self.enabled:
            self._pending.append((lane, sub_group, start, end, nbytes))

    def resolve(self) -> list[Span]:
        """Turn marks into seconds since the timeline started."""
        spans = [Span(lane, sg, self._seconds(a), self._seconds(b), nbytes) for lane, sg, a, b, nbytes in self._pending]
        return sorted(spans, key=lambda s: (s.lane, s.start_s))

    def _seconds(self, mark: object) -> float:
        if isinstance(mark, float):
            return mark - self.t0
        return self.origin.elapsed_time(mark) / 1000.0  # type: ignore[union-attr]


class SyncStreams(Streams):
    """A CPU "device": every operation is synchronous, so there is nothing to order."""


class CudaStreams(Streams):
    """Real CUDA side streams on ``device``."""

    is_async = True

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        super().__init__(device, timing)
        self.h2d = torch.cuda.Stream(device)
        self.lp_h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.update = torch.cuda.Stream(device)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    @property
    def compute(self) -> torch.cuda.Stream:
        return self.update

    @property
    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def host_wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    def device_synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            tensor.record_stream(stream)

    def device_memory(self) -> tuple[int, int]:
        free, _ = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        # What the caching allocator holds but no tensor uses (the activations backward just freed) is free too.
        return free + reserved - torch.cuda.memory_allocated(self.device), free + reserved

    def reset_peak(self) -> None:
        # The peak counters are shared (DOSMonitor resets them at its own boundaries, never inside a window of ours
        # that it would cut short: it reads and resets at the batch's start and before backward, and the engine
        # reads them before and after backward).
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def make_streams(device: torch.device) -> Streams:
    """The streams a real ``device`` needs: CUDA streams on a GPU, the synchronous stand-in otherwise."""
    return CudaStreams(device) if device.type == "cuda" else SyncStreams(device)
