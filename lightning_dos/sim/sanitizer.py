"""A stream-race checker for the engine on a simulated accelerator (CUDA's ordering rules, checked on CPU).

It is torch's CUDA sanitizer algorithm (``torch.cuda._sanitizer``: per-stream vector clocks, events that
copy a clock, waits that merge one) extended to what the engine needs checked on a machine with no GPU:

- **Every aten op** is seen by a ``TorchDispatchMode`` and classified into reads and writes from its
  schema (as CSAN does). An op touching device memory is a kernel or copy on the simulated stream that is
  current (:class:`~lightning_dos.sim.simstreams.SimStreams`); an op touching only host memory runs on a
  **host pseudo-stream**, in program order. CSAN ignores host tensors; here host reads of slabs that a
  download writes (a checkpoint after a flush without its host wait) are races like any other.
- **Issue order.** Work issued on a stream is ordered after everything the host did before issuing it.
- **Aliasing.** Accesses are keyed by byte ranges, not ``data_ptr()``: views of one slab start at
  different offsets (DeepSpeed's whole-flat all-gather against the engine's per-sub-group writes).
- **Device vs host memory.** Device memory is what the engine allocated through its streams (staging and
  resident blocks) plus what the caller declares (DeepSpeed's 16-bit partitions).
- **The caching allocator.** A device block may be freed only once every access to it is ordered before
  what the allocator may hand it to next (its allocation stream's later work); a new allocation starts a
  fresh history.
- **Host synchronisations in the hot path.** Inside a lane the engine issues on a device stream (an upload,
  the device update, a cast, a download), a host read of a device value (``.item()``, ``float()``, ``int()``,
  ``bool()``, ``.tolist()``, ``.cpu()``, ``.numpy()``), a blocking copy between host and device, a host wait on
  an event or a device synchronisation stalls the launch loop behind the device's queue: each is reported
  (:class:`HostSync`) unless the engine declared why (``streams.host_sync(reason)``).
- **DeepSpeed's side**, which never runs asynchronously on CPU, is modelled from its source
  (:meth:`StreamSanitizer.watch`): gradient copies into the host buffers on its reduce stream during
  backward (the host waits for that stream at the end of backward, unless the accelerator resolves data
  dependencies itself), and the next forward's all-gather reading the 16-bit partitions on a stream of its
  own, without waiting on the engine's streams.

Blind spots (docs/stream-sanitizer.md): C++ extension ops that bypass the dispatcher, NCCL, copies inside
libraries that do not go through aten, and every DeepSpeed access not modelled here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dos.engine import host_workers
from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.pool import FP32_BYTES
from lightning_dos.sim.simstreams import (
    COMPUTE,
    D2H,
    H2D,
    LP_H2D,
    STREAM_NAMES,
    UPDATE,
    SimEvent,
    SimStream,
    SimStreams,
)

#: torch versions whose private ``torch.cuda._sanitizer`` this module was tested with.
TESTED_TORCH = "2.13"

#: Pseudo-streams: the host thread, and DeepSpeed's streams as modelled.
#: TRAINING is the training thread while the update runs on a thread of its own (``overlap="forward"``), HOST
#: the thread running the update.
HOST, DS_REDUCE, DS_ALLGATHER, TRAINING = 100, 101, 102, 103
NAMES = {
    **STREAM_NAMES,
    HOST: "host",
    DS_REDUCE: "deepspeed.reduce",
    DS_ALLGATHER: "deepspeed.allgather",
    TRAINING: "training thread",
}


#: The compiled one-pass host update (``native``): the rule's step and, when ``lp_out`` is given, the 16-bit cast.
HOST_UPDATE_OPS = ("host_adam", "host_update")
#: Ops that only allocate memory: no work for the replay.
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


class SanitizerUnavailableError(RuntimeError):
    """torch's private CUDA-sanitizer classes are missing or changed."""


def _torch_sanitizer() -> Any:
    """torch's ``StreamSynchronizations`` and ``zip_arguments``, checked; a clear error if they changed."""
    try:
        from torch.cuda import _sanitizer as csan
    except ImportError as error:  # pragma: no cover - depends on the torch build
        raise SanitizerUnavailableError(f"torch {torch.__version__} has no torch.cuda._sanitizer ({error})") from None
    needed = {
        "StreamSynchronizations": (
            "create_stream",
            "create_event",
            "update_seq_num",
            "record_state",
            "stream_wait_for_event",
            "is_ordered_after",
            "_state_wait_for_other",
            "current_sync_states",
        ),
        "zip_arguments": (),
    }
    for name, members in needed.items():
        owner = getattr(csan, name, None)
        probe = owner() if name == "StreamSynchronizations" and owner is not None else owner
        missing = [m for m in members if not hasattr(probe, m)]
        if owner is None or missing:
            raise SanitizerUnavailableError(
                f"torch {torch.__version__}'s torch.cuda._sanitizer.{name} lacks {missing or 'itself'}; the stream "
                f"sanitizer was tested with torch {TESTED_TORCH}"
            )
    return csan


@dataclass(frozen=True)
class Access:
    """One read or write of a byte range by one operation."""

    start: int
    end: int
    write: bool
    stream: int
    seq: int
    op: str
    where: str

    def describe(self) -> str:
        verb = "wrote" if self.write else "read"
        return f"{self.op} on {NAMES.get(self.stream, self.stream)} {verb} it ({self.where})"


@dataclass(frozen=True)
class Race:
    """Two accesses to overlapping memory, at least one a write, with nothing ordering them (or a free
    before an access to the freed block was ordered)."""

    memory: str
    current: Access | None
    previous: Access

    def __str__(self) -> str:
        now = f"{self.current.describe()}" if self.current is not None else "the caching allocator freed it"
        return f"race on {self.memory}: {now}, unordered with an earlier {self.previous.describe()}"


@dataclass(frozen=True)
class LoggedOp:
    """One entry of the operation log, in host program order (what the replay consumes).

    ``kind`` is ``op`` (work on ``stream``: ``lane`` says which, ``elements`` and ``nbytes`` how much),
    ``record`` / ``wait`` (``event`` on ``stream``), ``host_wait`` (the host blocks on ``event``),
    ``stream_sync`` (the host blocks on ``stream``), ``sync`` (the host waits for the whole device), or
    ``host_record`` (the host thread marks ``event`` reached: a condition variable another thread waits on).
    ``sub_group`` is the engine's sub-group the op worked on, when the engine named it (-1 otherwise).
    ``host`` is the host thread that issued it (:data:`HOST`, the update's; :data:`TRAINING`, the training
    thread's); ``seconds`` the time of a modelled forward or backward kernel (the iteration's replay).
    """

    kind: str
    stream: int = HOST
    lane: str = ""
    elements: int = 0
    nbytes: int = 0
    event: int = 0
    sub_group: int = -1
    host: int = HOST
    seconds: float = 0.0


@dataclass(frozen=True)
class HostSync:
    """A host synchronisation issued inside one of the engine's device lanes.

    ``what`` is the synchronisation (the op or call), ``lane`` and ``sub_group`` the engine's operation it was
    issued in, ``where`` the engine's line, ``reason`` what the engine declared (``streams.host_sync``; None
    for an undeclared one, which is an error).
    """

    what: str
    lane: str
    sub_group: int
    where: str
    reason: str | None = None

    def __str__(self) -> str:
        why = f" (declared: {self.reason})" if self.reason else ""
        return f"host sync in the {self.lane} lane of sub-group {self.sub_group}: {self.what} ({self.where}){why}"


@dataclass
class _Region:
    start: int
    end: int
    name: str
    device: bool


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + span * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _caller() -> str:
    """The innermost frame in lightning_dos (outside this module), or any frame that looks like the engine."""
    frame = sys._getframe(2)
    fallback = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if "lightning_dos" in name and "/sim/" not in name or "loop" in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        if not fallback and "torch" not in name:
            fallback = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback


class _Mode(TorchDispatchMode):
    def __init__(self, checker: StreamSanitizer) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return self.checker._dispatch(func, args, kwargs or {})


class _LaneFunctions(TorchFunctionMode):
    """Inside a device lane: the host reads of a device tensor that never reach the dispatcher on a CPU tensor."""

    READS = frozenset({"tolist", "cpu", "numpy"})

    def __init__(self, checker: StreamSanitizer) -> None:
        super().__init__()
        self.checker = checker

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in self.READS and args and isinstance(args[0], torch.Tensor):
            if self.checker._device_value(args[0]):
                self.checker._host_sync(f"Tensor.{name}() of a device tensor")
        return func(*args, **(kwargs or {}))


class StreamSanitizer:
    """Checks happens-before between every access the engine (and modelled DeepSpeed) makes.

    Use :meth:`streams` to build the engine's simulated streams, :meth:`watch` to run the engine's calls
    under the checker with DeepSpeed's side modelled, or :meth:`active` around calls of your own.

    Args:
        memory_limit: bytes of simulated device memory (None: unlimited).
        raise_on_race: raise :class:`StreamRaceError` at the first race instead of collecting them.
    """

    def __init__(self, memory_limit: int | None = None, raise_on_race: bool = False) -> None:
        csan = _torch_sanitizer()
        self._zip_arguments = csan.zip_arguments
        self.syncs = csan.StreamSynchronizations()
        for stream in (H2D, LP_H2D, D2H, UPDATE, HOST, DS_REDUCE, DS_ALLGATHER, TRAINING):
            self.syncs.create_stream(stream)
        #: The host thread whose waits and issues are being recorded (HOST, or TRAINING in the modelled forward).
        self.host = HOST
        #: Pseudo-events marking the update thread's program order when it let each sub-group be read.
        self._landings: dict[int, int] = {}
        self._landing_ids = -1
        #: Ids of the modelled end-of-backward events (apart from the simulated streams' own).
        self._backward_events = itertools.count(-2_000_000, -1)
        self.memory_limit = memory_limit
        self.raise_on_race = raise_on_race
        self.seq = 0
        self.races: list[Race] = []
        self.log: list[LoggedOp] = []
        self.regions: list[_Region] = []
        self._accesses: dict[int, list[Access]] = {}
        self._sim: SimStreams | None = None
        self._depth = 0
        #: Undeclared host synchronisations inside the engine's device lanes (errors: :meth:`check`).
        self.host_syncs: list[HostSync] = []
        #: Declared ones, with the engine's reason.
        self.declared_host_syncs: list[HostSync] = []
        #: Byte ranges of live tensors made by an op issued in a device lane from no device memory (the step-count
        #: scalars' fill): host memory to the race checks (docs/stream-sanitizer.md), device values to this check.
        self._made_in_lanes: dict[int, tuple[int, int]] = {}
        self._made_ids = itertools.count()

    # -- setting up -------------------------------------------------------------------------------

    def streams(self, device: torch.device | str = "cpu") -> SimStreams:
        """Simulated streams reporting to this checker (pass as ``streams=`` or ``streams_factory=``)."""
        self._sim = SimStreams(torch.device(device), listener=self, memory_limit=self.memory_limit)
        return self._sim

    def name(self, tensor: torch.Tensor, name: str, device: bool = False) -> None:
        """Name a block of memory for race messages; ``device=True`` declares it device memory."""
        extent = _byte_range(tensor)
        if extent is None:
            return
        for region in self.regions:
            if (region.start, region.end) == extent:
                region.name, region.device = name, region.device or device
                return
        self.regions.append(_Region(*extent, name, device))

    @functools.cached_property
    def _mode(self) -> _Mode:
        return _Mode(self)

    def active(self) -> Any:
        """A context in which every aten op is checked."""
        return _Active(self)

    # -- StreamListener (called by SimStreams) ----------------------------------------------------

    def _log(self, entry: LoggedOp) -> None:
        """Append ``entry`` to the log, issued by the host thread being recorded."""
        self.log.append(dataclasses.replace(entry, host=self.host) if entry.host != self.host else entry)

    def _issue(self, stream: int) -> None:
        """Work issued on ``stream`` is ordered after everything the host has done or waited for."""
        states = self.syncs.current_sync_states
        self.syncs._state_wait_for_other(states[stream], states[self.host])

    def on_landed(self, sub_group: int) -> None:
        """The update thread lets ``sub_group`` be read: a thread that sees it (the engine's condition variable)
        is ordered after everything the update thread did so far."""
        self._landing_ids -= 1
        self.syncs.create_event(self._landing_ids)
        self.syncs.record_state(self._landing_ids, HOST)
        self._landings[sub_group] = self._landing_ids
        self._log(LoggedOp("host_record", event=self._landing_ids))

    def on_record(self, event: SimEvent) -> None:
        self._issue(event.stream.id)
        self.syncs.create_event(event.id)
        self.syncs.record_state(event.id, event.stream.id)
        self._log(LoggedOp("record", event.stream.id, event=event.id))

    def on_wait(self, stream: SimStream, event: SimEvent) -> None:
        self._issue(stream.id)
        self.syncs.stream_wait_for_event(stream.id, event.id)
        self._log(LoggedOp("wait", stream.id, event=event.id))

    def in_lane(self, stream: SimStream | None) -> Any:
        """While a lane on a device stream is issued under the checker, watch the host reads that a CPU tensor's
        methods do without the dispatcher (``tolist``)."""
        if stream is None or self._depth == 0:
            return contextlib.nullcontext()
        return _LaneFunctions(self)

    def _host_sync(self, what: str) -> None:
        """``what`` synchronises the host with the device: an error inside a device lane unless declared."""
        operation = self._sim.device_operation if self._sim is not None else None
        if operation is None:
            return
        reasons = self._sim.host_sync_reasons
        sync = HostSync(what, *operation, where=_caller(), reason=reasons[-1] if reasons else None)
        (self.declared_host_syncs if sync.reason else self.host_syncs).append(sync)
        if sync.reason is None and self.raise_on_race:
            raise HostSyncError([sync])

    def _device_value(self, tensor: torch.Tensor) -> bool:
        """``tensor`` lives on the device: device memory, or made in a device lane (the step-count scalars)."""
        extent = _byte_range(tensor)
        if extent is None:
            extent = (tensor.data_ptr(), tensor.data_ptr() + 1)
        if self._is_device([tensor]):
            return True
        return any(start <= extent[0] < end for start, end in self._made_in_lanes.values())

    def _made_in_device_lane(self, tensor: torch.Tensor) -> None:
        extent = _byte_range(tensor)
        if extent is None:
            return
        key = next(self._made_ids)
        self._made_in_lanes[key] = extent
        weakref.finalize(tensor, self._made_in_lanes.pop, key, None)

    def on_host_wait(self, event: SimEvent) -> None:
        self._host_sync(f"a host wait on an event of {event.stream.name}")
        self.syncs.stream_wait_for_event(self.host, event.id)
        self._log(LoggedOp("host_wait", event=event.id))

    def on_device_synchronize(self) -> None:
        self._host_sync("a device synchronisation")
        host = self.syncs.current_sync_states[HOST]
        for state in list(self.syncs.current_sync_states.values()):
            self.syncs._state_wait_for_other(host, state)
        self._log(LoggedOp("sync"))

    def stream_synchronize(self, stream: int) -> None:
        """The host blocks until ``stream``'s work is done (``stream.synchronize()``)."""
        states = self.syncs.current_sync_states
        self.syncs._state_wait_for_other(states[HOST], states[stream])
        self._log(LoggedOp("stream_sync", stream))

    def stream_wait_stream(self, waiter: int, target: int) -> None:
        """``waiter`` waits for all work issued so far on ``target`` (``waiter.wait_stream(target)``)."""
        self._issue(waiter)
        states = self.syncs.current_sync_states
        self.syncs._state_wait_for_other(states[waiter], states[target])

    def on_alloc(self, tensor: torch.Tensor, stream: SimStream) -> None:
        extent = _byte_range(tensor)
        if extent is None:
            return
        # A new allocation starts a fresh history with a write on its stream, as torch's CUDA sanitizer models
        # `torch.empty`: the caching allocator may hand out a block whose last user's work is still queued on that
        # stream (it was freed there), so another stream's first access must be ordered after the allocation.
        self.seq += 1
        self.syncs.update_seq_num(stream.id, self.seq)
        key = tensor.untyped_storage().data_ptr()
        self._accesses[key] = [Access(*extent, True, stream.id, self.seq, "allocation", "the caching allocator")]
        self.regions = [r for r in self.regions if r.end <= extent[0] or r.start >= extent[1]]
        self.regions.append(_Region(*extent, f"device block of {tensor.numel()} x {tensor.dtype}", True))

    def _track_temporary(self, tensor: torch.Tensor) -> None:
        """A tensor a device kernel allocated (an optimizer formula's intermediate): device memory of the kernel's
        stream until it is freed. On the simulated accelerator it is host memory that the host's own temporaries
        may reuse next; on a GPU it never is, so its history goes with it."""
        extent = _byte_range(tensor)
        if extent is None or self._region(extent[0]) is not None:
            return
        region = _Region(*extent, f"device temporary of {tensor.numel()} x {tensor.dtype}", True)
        self.regions.append(region)
        weakref.finalize(tensor, self._forget_temporary, region)

    def _forget_temporary(self, region: _Region) -> None:
        self._accesses.pop(region.start, None)
        self.regions = [r for r in self.regions if r is not region]

    def on_free(self, start: int, end: int, stream: SimStream, recorded: tuple[SimStream, ...] = ()) -> None:
        """A device block goes back to the caching allocator, which hands it next to work on ``stream`` (the one it
        was allocated on) at once, or, for the streams in ``recorded`` (``record_stream``), only once the work they
        hold now has run: every access to it must be ordered before one of those, or before the host's free."""
        memory = self._label(start)
        waiters = (stream.id, HOST, *(s.id for s in recorded))
        for previous in self._accesses.pop(start, []):
            if previous.stream == stream.id:
                continue
            if not any(self.syncs.is_ordered_after(w, previous.seq, previous.stream) for w in waiters):
                self._report(Race(memory, None, previous))
        self.regions = [r for r in self.regions if not (r.start == start and r.end == end)]

    # -- modelled accesses (DeepSpeed's side) -------------------------------------------------------

    def model_access(
        self, stream: int, op: str, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()
    ) -> None:
        """Record an access that did not go through aten on its real stream (a modelled DeepSpeed copy)."""
        self._launch(stream, op, list(reads), list(writes), where="modelled")

    # -- the checks ---------------------------------------------------------------------------------

    def _region(self, start: int) -> _Region | None:
        for region in self.regions:
            if region.start <= start < region.end:
                return region
        return None

    def _label(self, start: int) -> str:
        region = self._region(start)
        if region is None:
            return f"host memory at {start:#x}"
        return f"{region.name} (+{start - region.start} bytes)"

    def _is_device(self, tensors: Iterable[torch.Tensor]) -> bool:
        for t in tensors:
            extent = _byte_range(t)
            region = self._region(extent[0]) if extent is not None else None
            if region is not None and region.device:
                return True
        return False

    def _report(self, race: Race) -> None:
        self.races.append(race)
        if self.raise_on_race:
            raise StreamRaceError([race])

    def _launch(self, stream: int, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor], where: str) -> None:
        if stream != HOST:
            self._issue(stream)
        self.seq += 1
        self.syncs.update_seq_num(stream, self.seq)
        written = {id(t) for t in writes}
        accesses = [(t, False) for t in reads if id(t) not in written] + [(t, True) for t in writes]
        for tensor, write in accesses:
            extent = _byte_range(tensor)
            if extent is None:
                continue
            key = tensor.untyped_storage().data_ptr()
            current = Access(*extent, write, stream, self.seq, op, where)
            history = self._accesses.setdefault(key, [])
            kept = []
            for previous in history:
                overlaps = previous.start < current.end and current.start < previous.end
                if not overlaps:
                    kept.append(previous)
                    continue
                ordered = self.syncs.is_ordered_after(stream, previous.seq, previous.stream)
                if not ordered and (write or previous.write):
                    self._report(Race(self._label(max(previous.start, current.start)), current, previous))
                covered = current.start <= previous.start and previous.end <= current.end
                # Anything ordered after `current` is ordered after what it covers, so that can go; a read
                # never replaces a write (a later read on another stream must still be checked against it).
                if not (ordered and covered and (write or not previous.write)):
                    kept.append(previous)
            kept.append(current)
            self._accesses[key] = kept

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        schema = func._schema
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        blocking = True
        lp_out = None
        for argument, value in self._zip_arguments(schema, args, kwargs):
            if argument.name == "non_blocking":
                blocking = not value
            if argument.name == "lp_out":
                lp_out = value
            alias = argument.alias_info
            if alias is not None and not alias.is_write:
                continue  # a view: metadata only
            (writes if alias is not None else reads).extend(_tensors(value))
        out = func(*args, **kwargs)
        fresh = []
        results = (out,) if len(schema.returns) == 1 else (out or ())
        for result, value in zip(schema.returns, results, strict=False):
            if result.alias_info is None:
                fresh.extend(_tensors(value))
        for t in fresh:  # a new allocation: a fresh history
            extent = _byte_range(t)
            if extent is not None:
                self._accesses.pop(t.untyped_storage().data_ptr(), None)
        touched = reads + writes + fresh
        if not touched:
            return out  # metadata only (a view)
        device = self._is_device(touched)
        stream = self._sim.current.id if device and self._sim is not None else HOST
        if device:
            for t in fresh:
                self._track_temporary(t)
        elif fresh and self._sim is not None and self._sim.device_operation is not None:
            for t in fresh:
                self._made_in_device_lane(t)
        op = schema.name.split("::")[-1]
        self._launch(stream, op, reads, writes + fresh, where=_caller())
        logged = [self._classify(op, stream, reads, writes + fresh)]
        if op in HOST_UPDATE_OPS and lp_out is not None:  # the compiled one-pass update also casts into lp_out
            logged.append(LoggedOp("op", stream, "host_cast", lp_out.numel(), lp_out.numel() * FP32_BYTES))
        operation = self._sim.operation if self._sim is not None else None
        for one in logged:
            self._log(dataclasses.replace(one, sub_group=operation[1]) if operation else one)
        crosses = device and not all(self._is_device([t]) for t in touched)
        if op == "_local_scalar_dense" and self._device_value(reads[0]):
            self._host_sync("aten._local_scalar_dense of a device tensor (.item(), float(), int(), bool())")
        elif crosses and blocking and op == "copy_":
            self._host_sync("a blocking copy between host and device")
        if crosses and (blocking and op == "copy_" or op == "_local_scalar_dense"):
            self.stream_synchronize(stream)  # a blocking transfer or a .item(): the host waits for the stream
        return out

    def _classify(self, op: str, stream: int, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> LoggedOp:
        """Which lane of the update an op belongs to, and how much work it is (for the replay)."""
        elements = max((t.numel() for t in writes), default=0)
        if op in ALLOCATIONS:
            return LoggedOp("op", stream, "alloc")
        if op.startswith("_fused_adam") or op in HOST_UPDATE_OPS:  # torch's kernels, or the compiled one-pass update
            lane = "host_adam" if stream == HOST else "device_adam"
            return LoggedOp("op", stream, lane, elements=sum(t.numel() for t in _tensors(writes[:1])))
        if op == "copy_" and writes and reads:
            dst, src = writes[0], reads[0]
            nbytes = src.numel() * src.element_size()
            if stream == HOST:
                return LoggedOp("op", stream, "host_cast", elements=dst.numel(), nbytes=nbytes)
            dst_device, src_device = self._is_device([dst]), self._is_device([src])
            if dst_device and not src_device:
                return LoggedOp("op", stream, "lp_upload" if stream == LP_H2D else "upload", dst.numel(), nbytes)
            if src_device and not dst_device:
                return LoggedOp("op", stream, "download", dst.numel(), nbytes)
            return LoggedOp("op", stream, "cast", elements=dst.numel(), nbytes=nbytes)
        if elements <= 1:
            return LoggedOp("op", stream, "scalar")
        return LoggedOp("op", stream, "host_elementwise" if stream == HOST else "device_elementwise", elements)

    # -- DeepSpeed's side around the engine's calls -------------------------------------------------

    def watch(
        self,
        engine: Any,
        backward_sync: bool = True,
        overlap: bool = False,
        early: bool = False,
        threaded: bool = False,
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
        """
        pool = engine.pool
        slabs = [pool.param, *pool.states]
        for slab, label in zip(slabs, ("param", *engine.rule.states), strict=True):
            self.name(slab, f"{label} slab")
        if pool.lp_staging is not None:
            self.name(pool.lp_staging.storage, "16-bit staging ring")
        step, flush, drop = engine.step, engine.flush_resident, engine.drop_resident
        start, wait_all = engine.start, engine.wait_all
        #: The inputs of the threaded update whose next forward is still to model.
        joined: list[Any] = []

        def watched_step(plan: Any, inputs: Any, arrivals: Any = None) -> Any:
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

        def watched_flush() -> None:
            with self.active():
                flush()
            # The checkpoint then reads the host slabs.
            self.model_access(HOST, "checkpoint.save", reads=slabs)

        def watched_drop() -> None:
            # A checkpoint load has just written the host slabs.
            self.model_access(HOST, "checkpoint.load", writes=slabs)
            with self.active():
                drop()

        def watched_start(work: Any) -> None:
            def checked() -> None:
                with self.active():  # dispatch modes are per thread: check the update thread's work
                    work()

            start(checked)

        def watched_wait_all() -> None:
            try:
                wait_all()
            finally:
                if joined:
                    self._overlapped_forward(engine, joined.pop())
                    states = self.syncs.current_sync_states
                    self.syncs._state_wait_for_other(states[TRAINING], states[HOST])

        engine.step, engine.flush_resident, engine.drop_resident = watched_step, watched_flush, watched_drop
        if threaded:
            engine.start, engine.wait_all = watched_start, watched_wait_all

    # -- DeepSpeed's backward and the next forward, as watch() models them (a timed replay adds their work) ------

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
            for sg in engine.sub_groups:
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

    def check(self) -> None:
        """Raise :class:`StreamRaceError` if any race was found, else :class:`HostSyncError` if any undeclared host
        synchronisation was issued inside a device lane."""
        if self.races:
            raise StreamRaceError(self.races)
        if self.host_syncs:
            raise HostSyncError(self.host_syncs)


class ModelledBackward(GradientArrivals):
    """Backward as ``overlap="auto"`` meets it, in the update's own thread of control: each time the engine asks for
    the next final gradient, DeepSpeed's reduce stream copies one sub-group's gradient into the host buffers (the
    last sub-groups first, as backward visits the last layers first) and the sub-group is reported final with that
    copy's event; after the last one, backward ends (with DeepSpeed's end-of-backward synchronisation when
    ``backward_sync``) and the step proceeds."""

    def __init__(self, checker: StreamSanitizer, engine: Any, inputs: Any, backward_sync: bool) -> None:
        super().__init__()
        self.checker, self.inputs, self.backward_sync, self.engine = checker, inputs, backward_sync, engine
        self.order = [sg for sg in reversed(engine.sub_groups)]
        self.reduce = SimStream(DS_REDUCE, NAMES[DS_REDUCE])
        self.events = itertools.count(-1_000_000, -1)

    def next(self) -> tuple[int, object] | None:
        checker = self.checker
        if not self.order:
            if self.backward_sync:
                checker.stream_synchronize(DS_REDUCE)
            checker.end_of_backward(self.engine)
            self.end(GradientArrivals.RUN)
            return None
        sg = self.order.pop(0)
        grad = self.inputs.grads[sg.ds_group][sg.ds_offset : sg.ds_offset + sg.numel]
        checker.model_access(DS_REDUCE, "deepspeed.partition_grads (one sub-group)", writes=[grad])
        event = SimEvent(next(self.events), self.reduce)
        checker.on_record(event)
        return sg.index, event


class _Active:
    """Checks every aten op of this thread. Dispatch modes are per thread, so the engine's host worker
    threads are switched off meanwhile: the host update then runs its tiles on the calling thread, which is
    the same host program order (the workers are joined before the update returns), now visible."""

    def __init__(self, checker: StreamSanitizer) -> None:
        self.checker = checker
        self._workers: Any = None

    def __enter__(self) -> None:
        if self.checker._depth == 0:
            self._workers = host_workers.workers
            host_workers.workers = lambda: None
            self.checker._mode.__enter__()
        self.checker._depth += 1

    def __exit__(self, *exc: object) -> None:
        self.checker._depth -= 1
        if self.checker._depth == 0:
            self.checker._mode.__exit__(*exc)
            host_workers.workers = self._workers


def _listed(findings: Sequence[object], what: str, shown: int = 10) -> str:
    """``N what:`` and the first ``shown`` findings, one a line (a checker's error message)."""
    lines = "\n  ".join(str(f) for f in findings[:shown])
    more = f"\n  ... and {len(findings) - shown} more" if len(findings) > shown else ""
    return f"{len(findings)} {what}:\n  {lines}{more}"


class StreamRaceError(AssertionError):
    """The engine's stream ordering has a race (each one listed)."""

    def __init__(self, races: Sequence[Race]) -> None:
        self.races = list(races)
        super().__init__(_listed(self.races, "stream race(s)"))


class HostSyncError(AssertionError):
    """The engine synchronises the host with the device inside its device lanes without saying why."""

    def __init__(self, syncs: Sequence[HostSync]) -> None:
        self.syncs = list(syncs)
        super().__init__(_listed(self.syncs, "host synchronisation(s) in the hot path"))


__all__ = [
    "DS_ALLGATHER",
    "ModelledBackward",
    "DS_REDUCE",
    "HOST",
    "Access",
    "HostSync",
    "HostSyncError",
    "LoggedOp",
    "Race",
    "SanitizerUnavailableError",
    "StreamRaceError",
    "StreamSanitizer",
]
