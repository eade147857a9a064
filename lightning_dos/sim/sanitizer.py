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
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dos.engine import host_workers
from lightning_dos.engine.pool import FP32_BYTES
from lightning_dos.sim.allocator_model import CachingAllocatorModel
from lightning_dos.sim.deepspeed_model import DeepSpeedModel, ModelledBackward
from lightning_dos.sim.drive_model import DriveModel
from lightning_dos.sim.findings import (
    DRIVE_REQUESTS,
    DS_ALLGATHER,
    DS_REDUCE,
    HOST,
    TRAINING,
    Access,
    HostSync,
    HostSyncError,
    LoggedOp,
    Race,
    StreamRaceError,
    _byte_range,
    _caller,
    _Region,
)
from lightning_dos.sim.simstreams import (
    D2H,
    H2D,
    LP_H2D,
    UPDATE,
    SimEvent,
    SimStream,
    SimStreams,
)
from lightning_dos.sim.torch_csan import SanitizerUnavailableError, torch_sanitizer

#: The compiled one-pass host update (``native``): the rule's step and, when ``lp_out`` is given, the 16-bit cast.
HOST_UPDATE_OPS = ("host_update",)
#: Ops that only allocate memory: no work for the replay.
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


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


class StreamSanitizer(CachingAllocatorModel, DeepSpeedModel, DriveModel):
    """Checks happens-before between every access the engine (and modelled DeepSpeed) makes.

    Use :meth:`streams` to build the engine's simulated streams, :meth:`watch` to run the engine's calls
    under the checker with DeepSpeed's side modelled, or :meth:`active` around calls of your own.

    Args:
        memory_limit: bytes of simulated device memory (None: unlimited).
        raise_on_race: raise :class:`StreamRaceError` at the first race instead of collecting them.
    """

    def __init__(self, memory_limit: int | None = None, raise_on_race: bool = False) -> None:
        csan = torch_sanitizer()
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
        #: The drive's requests: a pseudo-stream each, and the event that marks its end.
        self._drive_requests = itertools.count(DRIVE_REQUESTS)
        self._drive_events = itertools.count(-3_000_000, -1)

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
        for stream, state in list(self.syncs.current_sync_states.items()):
            if stream < DRIVE_REQUESTS:  # the device's streams: a device synchronisation does not wait for the drive
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
        lp_out = out_param = None
        for argument, value in self._zip_arguments(schema, args, kwargs):
            if argument.name == "non_blocking":
                blocking = not value
            if argument.name == "lp_out":
                lp_out = value
            elif argument.name == "out_param":
                out_param = value
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
        if op in HOST_UPDATE_OPS and out_param is not None:  # out of place: the lines it writes are read first
            logged.append(LoggedOp("op", stream, "host_write_allocate", out_param.numel()))
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

    # -- DeepSpeed's backward and the next forward, as watch() models them (a timed replay adds their work) ------

    def check(self) -> None:
        """Raise :class:`StreamRaceError` if any race was found, else :class:`HostSyncError` if any undeclared host
        synchronisation was issued inside a device lane."""
        if self.races:
            raise StreamRaceError(self.races)
        if self.host_syncs:
            raise HostSyncError(self.host_syncs)


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
