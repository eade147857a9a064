"""Simulated CUDA streams on a CPU device: every stream and event has an identity, work stays synchronous.

With :class:`SimStreams` the engine takes its accelerator path on a CPU (device staging, pinned-style
16-bit staging and the ``lp_h2d`` upload for host sub-groups), and every record, wait, host wait,
device synchronisation, device allocation and free is reported to an optional :class:`StreamListener`
(the race checker). Nothing runs asynchronously: the simulation gives CI the *order* the engine
states, and the checker decides whether that order would be enough on a real GPU.

Its :class:`DeviceMemoryAccount` counts the device bytes the engine holds over the whole iteration, phase
by phase (forward, backward, update, between steps, named by
:class:`~lightning_dos.sim.phase_memory.IterationMemory` under a Trainer): the update window alone cannot
show memory held into the next forward.

Threads. On a GPU a stream or an event belongs to a device, and a CUDA call made from a thread that never
selected that device runs against device 0 (a new thread's current device): on a machine whose every rank shares
its GPUs that creates a context on GPU 0 in every rank. So the simulation keeps, per thread, whether it has bound
the engine's device (:meth:`SimStreams.bind_thread`, which on CUDA is ``torch.cuda.set_device``), and a stream
operation (switching streams, recording, waiting for an event, synchronising the device, allocating device memory)
from a thread that has not is an error (:class:`UnboundThreadError`, also listed in :attr:`SimStreams.unbound`).
The thread that builds the streams is taken as bound: the framework selected the device there before building the
engine (Lightning's accelerator ``setup_device``).

Never chosen automatically: a test or tool passes it to the engine (``streams=``) or to the strategy
(``streams_factory=``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dos.engine import hostslab
from lightning_dos.engine.streams import Streams

#: Stream ids. 0 is CUDA's default stream (the forward's and backward's, DeepSpeed's caller's); UPDATE is the
#: engine's own compute stream, which its device kernels run on.
COMPUTE, H2D, LP_H2D, D2H, UPDATE = 0, 1, 2, 3, 4
STREAM_NAMES = {COMPUTE: "compute", H2D: "h2d", LP_H2D: "lp_h2d", D2H: "d2h", UPDATE: "update"}


@dataclass(frozen=True)
class SimStream:
    """One simulated stream: an id and a name."""

    id: int
    name: str


@dataclass(eq=False)
class SimEvent:
    """One recorded event: the stream it was recorded on and the wall clock then (for the timeline)."""

    id: int
    stream: SimStream
    wall_s: float = field(default_factory=time.perf_counter)

    def elapsed_time(self, later: SimEvent) -> float:
        """Milliseconds from this event to ``later``, like ``torch.cuda.Event.elapsed_time``."""
        return (later.wall_s - self.wall_s) * 1000.0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Work is synchronous: nothing to wait for."""


@dataclass
class PhaseMemory:
    """Device bytes the engine held during one phase of the iteration.

    Attributes:
        name: the phase (``forward``, ``backward``, ``update``, ``between steps``, or ``setup`` before any).
        start_bytes: held by the engine when the phase began.
        peak_bytes: the most the engine held at any moment of it.
        end_bytes: held by the engine when it ended (None while it runs).
        peak_total_bytes: the most held at any moment of it by the engine and the model together (the model's
            bytes are recorded only under :class:`~lightning_dos.sim.phase_memory.ModelMemory`).
    """

    name: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int | None = None
    peak_total_bytes: int = 0


class DeviceMemoryAccount:
    """Bytes of simulated device memory allocated and not yet freed, with the peak of every phase: the engine's
    (its staging, resident state and its kernels' temporaries) and, when recorded, the model's own (activations
    and gathered parameters, :class:`~lightning_dos.sim.phase_memory.ModelMemory`).

    Args:
        capacity: bytes the device holds in all (None: no limit); the engine sizes its update from it as from
            ``torch.cuda.mem_get_info`` on a GPU.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        #: Bytes the engine holds now.
        self.held_bytes = 0
        #: Bytes the model holds now (recorded by ModelMemory).
        self.model_bytes = 0
        #: The most held by both since :meth:`reset_peak` (what ``torch.cuda.max_memory_allocated`` reads).
        self.peak_since_reset = 0
        #: Every phase so far, in order; the last one is running.
        self.phases: list[PhaseMemory] = [PhaseMemory("setup", 0, 0)]
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        """Bytes held on the device now, by the engine and the model."""
        return self.held_bytes + self.model_bytes

    def enter(self, name: str) -> None:
        """End the running phase and start ``name``."""
        with self._lock:
            self.phases[-1].end_bytes = self.held_bytes
            self.phases.append(PhaseMemory(name, self.held_bytes, self.held_bytes, None, self.total_bytes))

    def _peaks(self) -> None:
        current = self.phases[-1]
        current.peak_bytes = max(current.peak_bytes, self.held_bytes)
        current.peak_total_bytes = max(current.peak_total_bytes, self.total_bytes)
        self.peak_since_reset = max(self.peak_since_reset, self.total_bytes)

    def _count(self, engine: int, model: int) -> None:
        """Add ``engine`` and ``model`` bytes (negative: freed); only a growth can reach a new peak."""
        with self._lock:
            self.held_bytes += engine
            self.model_bytes += model
            if engine > 0 or model > 0:
                self._peaks()

    def allocated(self, nbytes: int) -> None:
        self._count(nbytes, 0)

    def freed(self, nbytes: int) -> None:
        self._count(-nbytes, 0)

    def model_allocated(self, nbytes: int) -> None:
        self._count(0, nbytes)

    def model_freed(self, nbytes: int) -> None:
        self._count(0, -nbytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_since_reset = self.total_bytes


class _DeviceTemporaries(TorchDispatchMode):
    """Counts every tensor an op allocates (a result that aliases no input) on ``account`` until it is dropped: the
    temporaries of a kernel on the simulated device (this thread's ops only: dispatch modes are per thread)."""

    def __init__(self, account: DeviceMemoryAccount) -> None:
        super().__init__()
        self.account = account

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for result, value in zip(returns, (out,) if len(returns) == 1 else (out or ()), strict=False):
            if result.alias_info is None and isinstance(value, torch.Tensor):
                nbytes = value.untyped_storage().nbytes()
                self.account.allocated(nbytes)
                weakref.finalize(value, self.account.freed, nbytes)
        return out


class UnboundThreadError(RuntimeError):
    """A stream operation from a thread that has not bound the engine's device (:meth:`SimStreams.bind_thread`)."""


class StreamListener(Protocol):
    """What a checker hears from :class:`SimStreams` (every method is called synchronously)."""

    def on_record(self, event: SimEvent) -> None: ...
    def on_wait(self, stream: SimStream, event: SimEvent) -> None: ...
    def on_host_wait(self, event: SimEvent) -> None: ...
    def on_device_synchronize(self) -> None: ...
    def on_alloc(self, tensor: torch.Tensor, stream: SimStream) -> None: ...
    def on_free(self, start: int, end: int, stream: SimStream, recorded: tuple[SimStream, ...] = ()) -> None: ...


class SimStreams(Streams):
    """The engine's streams on a simulated accelerator whose memory is CPU memory.

    Args:
        device: must be a CPU device (the tensors are ordinary CPU tensors).
        listener: told about every synchronisation and device allocation; None for none.
        memory_limit: bytes of "device" memory; an allocation beyond it raises ``torch.OutOfMemoryError``
            as the CUDA caching allocator would (None: no limit).
        capacity: bytes of the device for the whole iteration, the model's own bytes included (recorded under a
            Trainer by :class:`~lightning_dos.sim.phase_memory.ModelMemory`): the engine reads what is free from it
            (:meth:`device_memory`) as from ``torch.cuda.mem_get_info``, and an allocation beyond it raises
            ``torch.OutOfMemoryError``. None: no limit, and the engine sees none (as on a CPU device).
    """

    is_async = True

    def __init__(
        self,
        device: torch.device,
        listener: StreamListener | None = None,
        memory_limit: int | None = None,
        capacity: int | None = None,
    ) -> None:
        if device.type != "cpu":
            raise ValueError(f"SimStreams simulates an accelerator on a CPU device; got device={device}")
        super().__init__(device)
        self.listener = listener
        self.memory_limit = memory_limit
        #: What a query of an event answers (:meth:`done`): True, as for work done once issued.
        self.events_done = True
        self.default = SimStream(COMPUTE, STREAM_NAMES[COMPUTE])
        self.h2d = SimStream(H2D, STREAM_NAMES[H2D])
        self.lp_h2d = SimStream(LP_H2D, STREAM_NAMES[LP_H2D])
        self.d2h = SimStream(D2H, STREAM_NAMES[D2H])
        self.update = SimStream(UPDATE, STREAM_NAMES[UPDATE])
        self._current: list[SimStream] = [self.default]
        #: The engine's (lane, sub-group) of the operations being issued, innermost last.
        self.operations: list[tuple[str, int]] = []
        #: Per host thread: its operations' (lane, sub-group, stream) and why it synchronises with the device on
        #: purpose (``host_sync``), innermost last. Another thread (the training thread's wait for sub-groups, under
        #: overlap) may wait while the update's thread is inside a lane: that wait is not the lane's.
        self._thread = threading.local()
        self._event_ids = itertools.count(1)
        #: Bytes of simulated device memory allocated and not yet freed.
        self.allocated_bytes = 0
        #: The same, phase by phase of the iteration (with the model's own bytes when they are recorded).
        self.memory = DeviceMemoryAccount(capacity)
        #: Streams each live block was used on (:meth:`record_stream`), by the block's first byte.
        self._stream_uses: dict[int, set[SimStream]] = {}
        self._threads = threading.local()
        #: Every stream operation issued from a thread that had not bound the device: what, and from which thread.
        self.unbound: list[str] = []
        #: The names of the threads that issued stream operations (bound or not).
        self.issuers: set[str] = set()
        self.bind_thread()  # the framework's thread, which selected the device before building the engine

    def bind_thread(self) -> None:
        """The calling thread selects the engine's device (``torch.cuda.set_device`` on CUDA)."""
        self._threads.bound = True

    def _require_bound(self, what: str) -> None:
        """Refuse a stream operation from a thread that never bound the device, as CUDA would misplace it."""
        thread = threading.current_thread().name
        self.issuers.add(thread)
        if getattr(self._threads, "bound", False):
            return
        message = (
            f"simulated accelerator: {what} from thread {thread!r}, which never bound the engine's device "
            f"({self.device}); on CUDA it would run against device 0 (bind it first: Streams.bind_thread)"
        )
        self.unbound.append(message)
        raise UnboundThreadError(message)

    def host_registrar(self) -> hostslab.Registrar | None:
        """Faults in every page it registers, as ``cudaHostRegister`` does, so host memory on the simulated
        accelerator peaks where a GPU node's does; a :func:`~lightning_dos.engine.hostslab.use_registrar`
        block's registrar instead, where one is in force."""
        if hostslab.registrar_overridden():
            return hostslab.default_registrar()
        return hostslab.FaultingRegistrar()

    @contextlib.contextmanager
    def lane(self, lane: str, sub_group: int, nbytes: int, stream: SimStream | None = None) -> Iterator[None]:
        """As the base class; the operation's lane and sub-group are known to the checker meanwhile. Work issued on
        the engine's compute stream allocates device memory: what its kernels allocate (an update formula's
        temporaries) is counted on the device account until it is freed."""
        self.operations.append((lane, sub_group))
        lanes = self._thread_lanes()
        lanes.append((lane, sub_group, stream))
        in_lane = getattr(self.listener, "in_lane", None)
        try:
            # A listener may watch the work of the lane while it is issued (``in_lane(stream)``, optional); work on
            # the compute stream counts its kernels' temporaries on the device account.
            with (
                super().lane(lane, sub_group, nbytes, stream),
                in_lane(stream) if in_lane else contextlib.nullcontext(),
                _DeviceTemporaries(self.memory) if stream is self.update else contextlib.nullcontext(),
            ):
                yield
        finally:
            self.operations.pop()
            lanes.pop()

    def _thread_lanes(self) -> list[tuple[str, int, SimStream | None]]:
        if not hasattr(self._thread, "lanes"):
            self._thread.lanes, self._thread.reasons = [], []
        return self._thread.lanes

    @property
    def host_sync_reasons(self) -> list[str]:
        """Why the calling thread synchronises with the device on purpose (``host_sync``), innermost last."""
        self._thread_lanes()
        return self._thread.reasons

    @property
    def operation(self) -> tuple[str, int] | None:
        """The engine's lane and sub-group of the work being issued now (None outside any)."""
        return self.operations[-1] if self.operations else None

    @property
    def device_operation(self) -> tuple[str, int] | None:
        """The lane and sub-group of the work being issued now when its lane runs on a device stream (an upload,
        the device update, a cast, a download) and the calling thread issues it: where a host synchronisation stalls
        the launch loop."""
        lanes = self._thread_lanes()
        if lanes and lanes[-1][2] is not None:
            return lanes[-1][:2]
        return None

    @contextlib.contextmanager
    def host_sync(self, reason: str) -> Iterator[None]:
        """As the base class; the checker hears ``reason`` for the synchronisations issued meanwhile."""
        with super().host_sync(reason):
            self.host_sync_reasons.append(reason)
            try:
                yield
            finally:
                self.host_sync_reasons.pop()

    @property
    def current(self) -> SimStream:
        """The stream work is issued on now."""
        return self._current[-1]

    @property
    def compute(self) -> SimStream:
        return self.update

    @contextlib.contextmanager
    def on(self, stream: SimStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self._require_bound(f"switching to the {stream.name} stream")
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def record(self, stream: SimStream | None) -> SimEvent | None:
        if stream is None:
            return None
        self._require_bound(f"recording an event on the {stream.name} stream")
        event = SimEvent(next(self._event_ids), stream)
        if self.listener is not None:
            self.listener.on_record(event)
        return event

    def wait(self, stream: SimStream | None, event: SimEvent | None) -> None:
        if stream is not None and event is not None:
            self._require_bound(f"making the {stream.name} stream wait for an event")
            if self.listener is not None:
                self.listener.on_wait(stream, event)

    def host_wait(self, event: SimEvent | None) -> None:
        if event is not None:
            self._require_bound(f"waiting on the host for an event of the {event.stream.name} stream")
            if self.listener is not None:
                self.listener.on_host_wait(event)

    def done(self, event: SimEvent | None) -> bool:
        """Simulated work is done once issued, so a query answers True, and the host is ordered after the event as a
        wait orders it (the checker sees it as one); with :attr:`events_done` False every query answers "not yet", so
        that a test drives the engine's waiting path instead."""
        if event is None:
            return True
        if not self.events_done:
            return False
        self.host_wait(event)
        return True

    def device_synchronize(self) -> None:
        self._require_bound("synchronising the device")
        if self.listener is not None:
            self.listener.on_device_synchronize()

    def landed(self, sub_group: int) -> None:
        on_landed = getattr(self.listener, "on_landed", None)
        if on_landed is not None:
            on_landed(sub_group)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory: a CPU tensor the listener knows as device memory, freed when it is dropped."""
        self._require_bound("allocating device memory")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.memory_limit is not None and self.allocated_bytes + nbytes > self.memory_limit:
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: {nbytes} bytes requested, "
                f"{self.memory_limit - self.allocated_bytes} of {self.memory_limit} free"
            )
        capacity = self.memory.capacity
        if capacity is not None and self.memory.total_bytes + nbytes > capacity:
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: {nbytes} bytes requested, "
                f"{capacity - self.memory.total_bytes} of {capacity} free (the model holds {self.memory.model_bytes})"
            )
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        # The caching allocator ties a block to the stream current at allocation: that stream may reuse
        # it as soon as the host drops it.
        stream = self.current
        self.allocated_bytes += nbytes
        self.memory.allocated(nbytes)
        start = tensor.data_ptr()
        weakref.finalize(tensor, self._free, start, start + nbytes, nbytes, stream)
        if self.listener is not None:
            self.listener.on_alloc(tensor, stream)
        return tensor

    def record_stream(self, tensor: torch.Tensor, stream: SimStream | None) -> None:
        """As CUDA's ``record_stream``: the block ``tensor`` lies in goes back for reuse only once the work queued on
        ``stream`` when it is freed has run (the race checker orders the block's next user after it)."""
        if stream is not None:
            self._stream_uses.setdefault(tensor.untyped_storage().data_ptr(), set()).add(stream)

    def device_memory(self) -> tuple[int, int] | None:
        """(free now, capacity) of the simulated device when it has a ``capacity``; None otherwise."""
        capacity = self.memory.capacity
        return None if capacity is None else (max(0, capacity - self.memory.total_bytes), capacity)

    def reset_peak(self) -> None:
        self.memory.reset_peak()

    def peak_allocated(self) -> int:
        return self.memory.peak_since_reset

    def _free(self, start: int, end: int, nbytes: int, stream: SimStream) -> None:
        self.allocated_bytes -= nbytes
        self.memory.freed(nbytes)
        recorded = tuple(sorted(self._stream_uses.pop(start, ()), key=lambda s: s.id))
        if self.listener is not None:
            self.listener.on_free(start, end, stream, recorded)
