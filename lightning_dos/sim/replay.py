"""Replays the engine's logged schedule on a virtual node: a discrete-event model of one rank's hardware.

The input is the stream-race checker's operation log (:class:`~lightning_dos.sim.findings.LoggedOp`):
the order in which the engine *actually* issued its work, with every stream, event, wait and host wait.
The model:

- each **host thread** (the update's; in a whole iteration also the training thread's) walks its entries in
  program order on a clock of its own: host Adam (with the gradient's unscale, which the one-pass host update
  does alongside) at ``host_adam_eps``, the 16-bit cast at ``host_cast_eps``; issuing device work costs
  nothing; a host wait, a synchronisation or another thread's mark (a condition variable) blocks it until the
  awaited work has finished;
- each **stream** runs its work in order; a wait holds it until the event's work has finished;
- one **copy engine per direction** (uploads on ``h2d`` and ``lp_h2d`` share one, downloads use the other)
  serves one copy at a time, at the profile's solo rate, or its duplex rate while the other direction is
  busy too (rates change as copies start and end), in the order the copies became runnable (each at the head
  of its stream, its waits met): a host sub-group's upload, runnable once its CPU work is done, goes before a
  streamed upload that became runnable after it, and waits for the one in flight;
- the engine's **compute stream** runs the device update at ``device_adam_eps`` (scaled to the optimizer's rule
  and dtypes, :func:`~lightning_dos.model.perfmodel.rates_for`); other device kernels (the 16-bit cast,
  gradient scaling) are memory-bound and run at the bandwidth device Adam implies, by the bytes each element
  moves; forward and backward layers (a whole iteration's) take the seconds logged with them; kernels of
  different streams run side by side;
- the **drive** (the NVMe tier's swap file, :mod:`lightning_dos.sim.simdrive`) serves one request at a time, in
  the order the host issued them, at the drive's read or write rate (one rank's share:
  :meth:`~lightning_dos.model.nvme.DiskRates.per_rank`); a host wait for a request blocks its thread until it is
  done;
- each sub-group's update is charged once per side, at the rule's rate, however many kernels the engine ran
  it in (:func:`one_update_per_sub_group`): the compiled host pass is one, torch's path for a rule or dtype
  is several (conversions, one kernel per term), and the calibrated rate is that of the whole update.

Sizes scale: every logged amount is multiplied by ``scale``, so a test-sized run replays as the real model.
The figures are simulated, not measured.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_dos.model.iteration import write_allocate_share
from lightning_dos.model.nvme import DiskRates
from lightning_dos.model.perfmodel import HardwareRates, overlapped, rates_for, update_bytes
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.sim.findings import HOST, LoggedOp

COPY_LANES = {"upload": "h2d", "lp_upload": "h2d", "download": "d2h", "grad_download": "d2h"}
#: The drive's requests (the NVMe tier): one queue, reads and writes.
DRIVE_LANES = ("nvme_read", "nvme_write")
#: Compute-stream work whose logged ``seconds`` are its time (the forward's and backward's layers).
LAYER_LANES = ("forward", "backward")
_EPS = 1e-15


@dataclass
class ReplaySpan:
    """One operation on the virtual node's clock."""

    lane: str
    stream: str
    start_s: float
    end_s: float
    amount: float
    sub_group: int = -1


@dataclass
class ReplayResult:
    """What the replayed update did.

    Attributes:
        time_s: update time: from the first operation to the host's return from its last wait.
        busy_s: seconds each resource worked: ``host``, ``h2d`` and ``d2h`` copy engines, ``compute``, and the
            ``drive`` when the log has its requests.
        h2d_bytes: bytes uploaded.
        d2h_bytes: bytes downloaded.
        read_bytes: bytes read from the drive.
        write_bytes: bytes written to it.
        spans: every operation, for a trace.
        host_clock_s: each host thread's clock when it had done its last entry.
        marks_s: when each ``host_record`` was reached.
    """

    time_s: float
    busy_s: dict[str, float]
    h2d_bytes: float
    d2h_bytes: float
    spans: list[ReplaySpan] = field(default_factory=list)
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    host_clock_s: dict[int, float] = field(default_factory=dict)
    marks_s: dict[int, float] = field(default_factory=dict)

    def busy_share(self) -> dict[str, float]:
        return {k: (v / self.time_s if self.time_s > 0 else 0.0) for k, v in self.busy_s.items()}


@dataclass
class _Item:
    kind: str  # "op", "record", "wait"
    issued: float
    lane: str = ""
    amount: float = 0.0
    event: int = 0
    remaining: float = 0.0
    started: float = -1.0
    sub_group: int = -1
    done: bool = False
    finished: float = 0.0
    runnable: float = 0.0  # when it reached the head of its stream (or was issued, if later)


def device_kernel_bytes(lane: str, footprint: Footprint = ADAM_FP32, lp_bytes: int = 2) -> int:
    """Bytes per element a device kernel of ``lane`` moves for ``footprint``: the update reads the gradient and
    reads and writes master weights and states (28 for Adam in fp32: ``perfmodel.update_bytes``), the cast reads
    master weights and writes ``lp_bytes``, any other kernel (gradient scaling) reads and writes the gradient."""
    if lane == "device_adam":
        return update_bytes(footprint)
    if lane == "cast":
        return footprint.master + lp_bytes
    return 2 * footprint.master


class _Device:
    """Streams, copy engines and the compute stream, advanced only as far as the host needs."""

    def __init__(self, rates: HardwareRates, disk: DiskRates | None = None) -> None:
        self.rates, self.disk = rates, disk
        self.now = 0.0
        self.queues: dict[int, deque[_Item]] = {}
        self.done_events: dict[int, float] = {}
        self.active: dict[str, tuple[int, _Item]] = {}  # resource -> (stream, item)
        self.spans: list[ReplaySpan] = []
        self.busy = {"h2d": 0.0, "d2h": 0.0, "compute": 0.0, **({"drive": 0.0} if disk is not None else {})}

    def submit(self, stream: int, item: _Item) -> None:
        queue = self.queues.setdefault(stream, deque())
        if not queue:
            item.runnable = max(item.issued, self.now)
        queue.append(item)

    def _resource(self, lane: str, stream: int) -> str:
        """A copy engine, or the compute of one stream: kernels of different streams run side by side (the
        engine's are short and memory-bound beside the forward's and backward's; their contention is not
        modelled), a stream's own run one at a time."""
        if lane in DRIVE_LANES:
            return "drive"
        return COPY_LANES.get(lane, f"compute:{stream}")

    def _rate(self, resource: str) -> float:
        r = self.rates
        if resource.startswith("compute"):
            return 1.0  # compute items carry seconds of work already
        if resource == "drive":
            reading = self.active["drive"][1].lane == "nvme_read"
            return self.disk.read_bps if reading else self.disk.write_bps
        duplex = ("d2h" if resource == "h2d" else "h2d") in self.active
        if resource == "h2d":
            return r.duplex_h2d_bps if duplex else r.h2d_bps
        return r.duplex_d2h_bps if duplex else r.d2h_bps

    def _start_ready(self) -> None:
        """Retire the records and met waits at the streams' heads, then start, on each free resource, the work
        that became runnable first. Retiring comes first so that a copy whose wait was met now competes with
        the copies already waiting (otherwise a stream behind a met wait would lose to any other stream)."""
        progressed = True
        while progressed:
            progressed = False
            candidates: list[tuple[float, int, int, _Item]] = []
            for stream, queue in self.queues.items():
                if not queue or any(s == stream for s, _ in self.active.values()):
                    continue
                head = queue[0]
                if head.issued > self.now + _EPS:
                    continue
                if head.kind == "record":
                    self.done_events[head.event] = self.now
                    self._pop(stream)
                    progressed = True
                elif head.kind == "wait":
                    if head.event in self.done_events:
                        self._pop(stream)
                        progressed = True
                else:
                    candidates.append((head.runnable, stream, id(head), head))
            if progressed:
                continue
            for _, stream, _, head in sorted(candidates, key=lambda c: (c[0], c[1])):
                resource = self._resource(head.lane, stream)
                if resource in self.active:
                    continue
                head.started = self.now
                self.active[resource] = (stream, head)
                progressed = True

    def _pop(self, stream: int) -> _Item:
        queue = self.queues[stream]
        item = queue.popleft()
        item.done, item.finished = True, self.now
        if queue:
            queue[0].runnable = max(queue[0].issued, self.now)
        return item

    def _next_time(self) -> float | None:
        times = [self.now + item.remaining / self._rate(res) for res, (_, item) in self.active.items()]
        times += [q[0].issued for q in self.queues.values() if q and q[0].issued > self.now + _EPS]
        return min(times) if times else None

    def advance(self, until: Any, limit: float = math.inf) -> None:
        """Run the device until ``until()`` is true, nothing is left to run, or the next change would come after
        ``limit`` (a host thread that may still issue work then)."""
        while True:
            self._start_ready()
            if until():
                return
            t = self._next_time()
            if t is None or t > limit:
                return
            dt = max(0.0, t - self.now)
            rates = {res: self._rate(res) for res in self.active}
            finished = []
            for res, (_, item) in self.active.items():
                item.remaining -= rates[res] * dt
                self.busy[res.split(":")[0]] += dt
                if item.remaining <= max(_EPS, 1e-9 * item.amount):
                    finished.append(res)
            self.now = t
            for res in finished:
                stream, item = self.active.pop(res)
                self._pop(stream)
                span = ReplaySpan(item.lane, str(stream), item.started, self.now, item.amount, item.sub_group)
                self.spans.append(span)

    def idle(self, stream: int | None = None) -> bool:
        queues = self.queues.values() if stream is None else [self.queues.get(stream, deque())]
        return all(not q for q in queues)


def _kernel_seconds(lane: str, elements: float, rates: HardwareRates, footprint: Footprint) -> float:
    """Seconds of a device kernel; ``rates`` in the unit profiles keep (Adam with fp32 state)."""
    if lane == "device_adam":
        return elements / rates_for(rates, footprint).device_adam_eps
    # Device Adam's elements/s times its bytes per element: the device's memory bandwidth.
    bandwidth = rates.device_adam_eps * update_bytes(ADAM_FP32)
    return elements * device_kernel_bytes(lane, footprint) / bandwidth


def _host_seconds(lane: str, elements: float, rates: HardwareRates, footprint: Footprint) -> float:
    if lane == "host_adam":
        return elements / rates_for(rates, footprint).host_adam_eps
    if lane == "host_cast":
        return elements / rates.host_cast_eps
    if lane == "host_write_allocate":  # an update out of place reads the state's lines it writes before writing them
        return elements * write_allocate_share(footprint) / rates_for(rates, footprint).host_adam_eps
    # The gradient's unscale is part of the one-pass host update whose rate host_adam_eps is (calibrate
    # measures unscale + Adam together); allocations and scalars cost nothing here.
    return 0.0


#: Lanes of a sub-group's update computation, per side: (the update, its 16-bit cast, the rest of its kernels).
UPDATE_LANES = {
    True: ("host_adam", "host_cast", "host_elementwise"),
    False: ("device_adam", "cast", "device_elementwise"),
}


def one_update_per_sub_group(log: Sequence[LoggedOp]) -> list[LoggedOp]:
    """``log`` with each sub-group's update computation on each side (host, device) as one update and one cast
    of its elements, where its first update and first cast operation were; its other kernels are dropped.

    The performance model and calibration time the engine's update of a sub-group as a whole (the compiled host
    pass unscales, updates and casts in one; torch's path for a rule or dtype runs conversions and one kernel per
    term, and a gradient-scaling kernel on the device), so the replay charges it so too. The sub-group's elements:
    the largest operation's, or the sum of its update operations' where the update ran in tiles. Operations of no
    sub-group are left as they are."""
    elements: dict[tuple[bool, int], int] = defaultdict(int)
    updates: dict[tuple[bool, int], int] = defaultdict(int)
    for entry in log:
        host = entry.stream == HOST
        if entry.kind == "op" and entry.sub_group >= 0 and entry.lane in UPDATE_LANES[host]:
            key = (host, entry.sub_group)
            elements[key] = max(elements[key], entry.elements)
            if entry.lane == UPDATE_LANES[host][0]:
                updates[key] += entry.elements
    out: list[LoggedOp] = []
    seen: set[tuple[bool, int, str]] = set()
    for entry in log:
        host = entry.stream == HOST
        if entry.kind != "op" or entry.sub_group < 0 or entry.lane not in UPDATE_LANES[host]:
            out.append(entry)
            continue
        key = (host, entry.sub_group)
        update, cast, _ = UPDATE_LANES[host]
        lane = cast if entry.lane == cast else update
        if (*key, lane) in seen:
            continue
        seen.add((*key, lane))
        out.append(replace(entry, lane=lane, elements=max(elements[key], updates[key])))
    return out


def replay(
    log: Sequence[LoggedOp],
    rates: HardwareRates,
    scale: float = 1.0,
    *,
    footprint: Footprint = ADAM_FP32,
    disk: DiskRates | None = None,
) -> ReplayResult:
    """Replay ``log`` on the node ``rates`` describes, every amount multiplied by ``scale``; ``footprint`` is the
    optimizer's rule and dtypes the logged engine ran (its update rates and kernel bytes; copies move the bytes
    logged); ``disk``: the drive's rates, one rank's share (needed when the log has drive requests).

    Each host thread of the log (``LoggedOp.host``) walks its own entries in program order on a clock of its own;
    the thread whose clock is earliest goes next, so that work reaches the device in the order it was issued in
    time. A thread blocked on a host wait, a stream or device synchronisation, or a mark of another thread
    (``host_record``: a condition variable) resumes when that has happened. Event ids are unique per record (the
    simulated streams and the checker number each record afresh), so a wait names the one record it waits for;
    waiting for an event never recorded returns at once, as on a GPU."""
    if rates.device_adam_eps <= 0:
        raise ValueError("replay needs a profile with an accelerator (device_adam_eps > 0)")
    entries = one_update_per_sub_group(log)
    if disk is None and any(e.kind == "op" and e.lane in DRIVE_LANES for e in entries):
        raise ValueError("the log has the NVMe tier's drive requests: give the drive's rates (disk=DiskRates(...))")
    recorded = {e.event for e in entries if e.kind in ("record", "host_record")}
    if any(e.kind == "op" and e.lane == "host_adam" for e in entries):
        # The copies beside the host update at their calibrated share, as the performance model charges them
        # (perfmodel.overlapped: throughout, where the plan has host sub-groups). The training thread's slowdown
        # beside the update (overlap_launch_speed, overlap_host_speed) is the model's alone: not replayed.
        rates = overlapped(rates)
    device = _Device(rates, disk)
    threads: dict[int, deque[LoggedOp]] = {}
    for entry in entries:
        threads.setdefault(entry.host, deque()).append(entry)
    clock = dict.fromkeys(threads, 0.0)
    marks: dict[int, float] = {}  # host_record events: when their thread reached them
    snapshots: dict[int, list[_Item]] = {}  # a synchronising thread's work to wait for, taken as it reached it
    host_busy = 0.0
    host_spans: list[ReplaySpan] = []
    h2d_bytes = d2h_bytes = 0.0
    drive_bytes = dict.fromkeys(DRIVE_LANES, 0.0)

    def waiting(thread: int) -> bool:
        """``thread`` is blocked: on a host wait for a recorded event or mark, or a synchronisation it has reached."""
        head = threads[thread][0]
        return thread in snapshots or (head.kind == "host_wait" and head.event in recorded)

    def done_at(thread: int) -> float | None:
        """When the wait at the head of ``thread`` is over (None: not yet)."""
        entry = threads[thread][0]
        if entry.kind == "host_wait":
            if entry.event in marks:
                return marks[entry.event]
            return device.done_events.get(entry.event)
        waited = snapshots.get(thread)
        if waited is None or any(not item.done for item in waited):
            return None
        return max((item.finished for item in waited), default=0.0)

    while True:
        live = [h for h, ops in threads.items() if ops]
        if not live:
            break
        blocked = [h for h in live if waiting(h)]
        running = [h for h in live if h not in blocked]
        horizon = min((clock[h] for h in running), default=math.inf)
        # The device runs up to the earliest running thread's clock, or until a blocked thread may go on.
        device.advance(lambda waiting=blocked: any(done_at(h) is not None for h in waiting), limit=horizon)
        resumed = {h: at for h in blocked if (at := done_at(h)) is not None}
        for h, at in resumed.items():
            clock[h] = max(clock[h], at)
            threads[h].popleft()
            snapshots.pop(h, None)
        if resumed:
            continue
        if not running:
            raise RuntimeError(f"replay deadlock: host threads {sorted(blocked)} wait for work never issued")
        h = min(running, key=lambda t: (clock[t], t))
        entry = threads[h][0]
        now = clock[h]
        if entry.kind in ("sync", "stream_sync"):
            # Every earlier-clocked thread has issued its work: the synchronisation waits for what is queued now.
            streams = device.queues if entry.kind == "sync" else {entry.stream: device.queues.get(entry.stream, ())}
            snapshots[h] = [item for queue in streams.values() for item in queue]
            continue
        threads[h].popleft()
        if entry.kind == "op" and entry.stream == HOST:
            seconds = _host_seconds(entry.lane, entry.elements * scale, rates, footprint)
            if seconds > 0:
                span = ReplaySpan(entry.lane, "host", now, now + seconds, entry.elements * scale, entry.sub_group)
                host_spans.append(span)
            clock[h] = now + seconds
            host_busy += seconds
        elif entry.kind == "op":
            if entry.lane in ("scalar", "alloc"):
                continue
            if entry.lane in DRIVE_LANES:
                amount = work = entry.nbytes * scale
                drive_bytes[entry.lane] += amount
            elif entry.lane in COPY_LANES:
                amount = work = entry.nbytes * scale
                if COPY_LANES[entry.lane] == "h2d":
                    h2d_bytes += amount
                else:
                    d2h_bytes += amount
            elif entry.lane in LAYER_LANES:  # forward or backward layers: seconds given, not scaled
                amount = work = entry.seconds
            else:
                amount = entry.elements * scale
                work = _kernel_seconds(entry.lane, amount, rates, footprint)
            device.submit(entry.stream, _Item("op", now, entry.lane, amount, remaining=work, sub_group=entry.sub_group))
        elif entry.kind in ("record", "wait"):
            device.submit(entry.stream, _Item(entry.kind, now, event=entry.event))
        elif entry.kind == "host_record":
            marks[entry.event] = now
    device.advance(lambda: device.idle())  # anything not waited for still counts
    end = max([*clock.values(), device.now] + [s.end_s for s in device.spans])
    busy = {"host": host_busy, **device.busy}
    spans = sorted(host_spans + device.spans, key=lambda s: (s.start_s, s.lane))
    return ReplayResult(
        end, busy, h2d_bytes, d2h_bytes, spans, drive_bytes["nvme_read"], drive_bytes["nvme_write"], dict(clock), marks
    )


def write_perfetto(path: str | Path, result: ReplayResult, title: str = "lightning-dos simulate") -> Path:
    """Write ``result`` as a Chrome/Perfetto trace: one lane per operation kind, microseconds."""
    lanes = sorted({s.lane for s in result.spans})
    tids = {lane: i + 1 for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": f"{title} (simulated, not measured)"}}
    ]
    events += [
        {"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": lane}} for lane, tid in tids.items()
    ]
    for span in result.spans:
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": tids[span.lane],
                "name": span.lane,
                "ts": span.start_s * 1e6,
                "dur": (span.end_s - span.start_s) * 1e6,
                "args": {"stream": span.stream, "amount": span.amount, "sub_group": span.sub_group},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
