"""What the stream-race checker finds and logs: accesses and the races between them, host synchronisations in
the hot path, the operation log the virtual node replays, and the errors that list them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_dos.sim.simstreams import (
    STREAM_NAMES,
)

#: Pseudo-streams: the host thread, and DeepSpeed's streams as modelled.
#: TRAINING is the training thread while the update runs on a thread of its own (``overlap="forward"``), HOST
#: the thread running the update.
HOST, DS_REDUCE, DS_ALLGATHER, TRAINING = 100, 101, 102, 103
#: The NVMe drive (the file tier's requests): one queue in the replay's log. To the race checker each request runs
#: on a pseudo-stream of its own, numbered from DRIVE_REQUESTS: requests on different slabs run side by side, and a
#: request runs beside everything the host does until the host waits for it.
DRIVE, DRIVE_REQUESTS = 104, 1_000_000


NAMES = {
    **STREAM_NAMES,
    HOST: "host",
    DS_REDUCE: "deepspeed.reduce",
    DS_ALLGATHER: "deepspeed.allgather",
    TRAINING: "training thread",
    DRIVE: "the drive",
}


def stream_name(stream: int) -> str:
    """A stream's or pseudo-stream's name for messages."""
    return "the drive" if stream >= DRIVE_REQUESTS else NAMES.get(stream, str(stream))


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
        return f"{self.op} on {stream_name(self.stream)} {verb} it ({self.where})"


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
