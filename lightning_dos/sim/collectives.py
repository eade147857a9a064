"""A recorder of the collectives a process issues: which process group, which op, from which thread, whether
autograd's backward was running, and whose code called it.

Two ranks deadlock when they enter two communicators in different orders, or when one enters a collective the other
never reaches. A rank's collectives issued from an autograd hook are ordered by how far backward has gone (a rank
whose first bucket is all padding reaches a gradient hook one bucket later), and those issued from a thread of their
own by nothing at all. So lightning-dos issues its collectives on the training thread, outside backward, on
DeepSpeed's data-parallel group; a test records every rank's collectives with :class:`CollectiveRecorder` and
compares them (``tests/jobs/collectives_ranks.py``).

The recorder wraps ``torch.distributed``'s collectives (and their ``distributed_c10d`` names, which DeepSpeed's
communication backend binds when it starts): install it before DeepSpeed initialises. Collectives that bypass
``torch.distributed`` (DeepSpeed's CPU shared-memory all-reduce, NCCL calls from C++) are not seen.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: The collectives recorded (those a name is missing for in this torch are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)
#: Packages a collective's caller is attributed to, by a directory in its file's path.
ORIGINS = (("lightning_dos", "lightning_dos"), ("deepspeed", "deepspeed"), ("lightning", "lightning"))


@dataclass(frozen=True)
class Collective:
    """One collective as its rank issued it.

    Attributes:
        op: the ``torch.distributed`` function.
        group: the process group's name (the default group's is ``"0"``); the same group has the same name on
            every rank.
        ranks: the global ranks of that group.
        thread: the name of the issuing thread (``MainThread`` for the training thread).
        in_backward: backward was running on the issuing thread: autograd's (the call came from an autograd hook)
            or DeepSpeed's ``engine.backward`` (its epilogue reduces the last bucket once autograd has returned).
        origin: whose code called ``torch.distributed``: ``lightning_dos``, ``deepspeed``, ``lightning`` or
            ``other``.
        where: that caller, as ``file:line function``.
    """

    op: str
    group: str
    ranks: tuple[int, ...]
    thread: str
    in_backward: bool
    origin: str
    where: str


class CollectiveRecorder:
    """Records every collective issued through ``torch.distributed`` while installed (:meth:`install`)."""

    def __init__(self) -> None:
        #: The collectives issued so far, in the order this process issued them.
        self.calls: list[Collective] = []
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Callable]] = []

    def install(self) -> CollectiveRecorder:
        """Wrap the collectives of ``torch.distributed`` and ``torch.distributed.distributed_c10d``."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped: dict[int, Callable] = {}
        for module in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is None or getattr(original, "_lightning_dos_recorded", False):
                    continue
                if id(original) not in wrapped:
                    wrapped[id(original)] = self._wrap(name, original)
                self._saved.append((module, name, original))
                setattr(module, name, wrapped[id(original)])
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0) == 0:  # one collective calling another is one collective
                self._record(name, signature, args, kwargs)
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        recorded._lightning_dos_recorded = True  # type: ignore[attr-defined]
        return recorded

    def _record(self, name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        import torch.distributed as dist

        try:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            group = None
        group = group if group is not None else dist.group.WORLD
        origin, where = _caller()
        call = Collective(
            op=name,
            group=str(getattr(group, "group_name", "?")),
            ranks=tuple(dist.get_process_group_ranks(group)),
            thread=threading.current_thread().name,
            in_backward=torch._C._current_graph_task_id() != -1 or inside_backward(),
            origin=origin,
            where=where,
        )
        with self._lock:
            self.calls.append(call)

    def save(self, path: str | Path) -> None:
        """Write the calls as JSON (one object per call)."""
        Path(path).write_text(json.dumps([asdict(c) for c in self.calls]))

    @staticmethod
    def load(path: str | Path) -> list[Collective]:
        return [Collective(**{**c, "ranks": tuple(c["ranks"])}) for c in json.loads(Path(path).read_text())]


def _caller() -> tuple[str, str]:
    """The package and place of the nearest caller outside ``torch.distributed`` and this module."""
    frame = sys._getframe(2)
    here = __file__
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != here and f"torch{os.sep}distributed" not in filename:
            break
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    filename = frame.f_code.co_filename
    parts = Path(filename).parts
    origin = next((label for directory, label in ORIGINS if directory in parts), "other")
    return origin, f"{'/'.join(parts[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"


def inside_backward() -> bool:
    """A ``backward`` of torch (``Tensor.backward``, ``torch.autograd.backward``) or of DeepSpeed's engine is on
    the calling thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "backward":
            parts = Path(frame.f_code.co_filename).parts
            if "deepspeed" in parts or ("torch" in parts and ("autograd" in parts or parts[-1] == "_tensor.py")):
                return True
        frame = frame.f_back
    return False


def per_thread(calls: list[Collective]) -> dict[str, list[tuple[str, str, str]]]:
    """Each thread's sequence of (group, op, origin): what must be the same on every rank."""
    threads: dict[str, list[tuple[str, str, str]]] = {}
    for call in calls:
        threads.setdefault(call.thread, []).append((call.group, call.op, call.origin))
    return threads
