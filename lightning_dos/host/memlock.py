"""The locked-memory limit (``RLIMIT_MEMLOCK``, ``ulimit -l``): checked before anything is ``mlock``'ed.

DeepSpeed's page-locked allocator (``new_cpu_locked_tensor``: the NVMe tier's staging slabs, the start-up drive
measurement's buffer, DeepSpeed's own buffers under ``DS_PIN_MEMORY_BACKEND=native``) locks its pages with
``mlock``. Past the limit ``mlock`` fails, the allocator returns nullptr, and its ``assert`` aborts the process
(SIGABRT, no Python error). A non-root container's default limit is 8 MiB; a process with ``CAP_IPC_LOCK`` (root,
normally) is not held to it. (CUDA's ``cudaHostRegister``, which pins the engine's own slabs, is not charged to it.)

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from lightning_dos.errors import DOSConfigError

#: The capability that lifts the limit (``linux/capability.h``).
CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class LockLimit:
    """What this process may ``mlock``.

    Attributes:
        soft: the limit ``mlock`` is held to, bytes (None: unlimited).
        hard: the most the soft limit may be raised to without privilege, bytes (None: unlimited).
        locked: bytes this process holds locked now (``VmLck``): they count against the limit too.
        exempt: the process has ``CAP_IPC_LOCK``, so the limit does not apply.
    """

    soft: int | None
    hard: int | None
    locked: int = 0
    exempt: bool = False

    def allows(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more can be locked."""
        return self.exempt or self.soft is None or self.locked + nbytes <= self.soft


def _status_fields(text: str) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def lock_limit(status: str | None = None) -> LockLimit:
    """This process's :class:`LockLimit`: ``getrlimit(RLIMIT_MEMLOCK)``, and from ``status`` (the calling thread's
    ``/proc/thread-self/status`` when None; capabilities are per thread) ``VmLck`` and ``CapEff``'s bit
    :data:`CAP_IPC_LOCK`. Where the status cannot be read, no capability and nothing locked are assumed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if status is None:
        for path in ("/proc/thread-self/status", "/proc/self/status"):
            try:
                status = Path(path).read_text()
                break
            except OSError:
                continue
    fields = _status_fields(status or "")
    try:
        exempt = bool(int(fields.get("CapEff", "0"), 16) >> CAP_IPC_LOCK & 1)
    except ValueError:
        exempt = False
    locked_kb = fields.get("VmLck", "0 kB").split()[0]
    return LockLimit(
        soft=None if soft == resource.RLIM_INFINITY else soft,
        hard=None if hard == resource.RLIM_INFINITY else hard,
        locked=int(locked_kb) * 1024 if locked_kb.isdigit() else 0,
        exempt=exempt,
    )


def _kib(nbytes: int) -> int:
    return -(-nbytes // 1024)


def check_lock_limit(nbytes: int, what: str, *, setting: str, also: str = "", limit: LockLimit | None = None) -> None:
    """Refuse, with one line naming the limit and the fix, a run that would ``mlock`` ``nbytes`` (at most at once)
    beyond what this process may lock.

    Args:
        nbytes: the most bytes the run holds locked at once, beyond what is locked now.
        what: what they are, for the message (plural: "... need N MiB").
        setting: the setting that asks for them (the message begins with it).
        also: a further fix the caller knows of, for the message's end ("or ...").
        limit: the limit to check against (:func:`lock_limit` when None).
    """
    limit = lock_limit() if limit is None else limit
    if limit.allows(nbytes) or limit.soft is None:
        return
    needed = limit.locked + nbytes
    held = f", {limit.locked / 2**20:.1f} MiB of it already locked" if limit.locked else ""
    if limit.hard is None or limit.hard >= needed:
        hard = "unlimited" if limit.hard is None else f"{_kib(limit.hard)} KiB"
        raise_it = f"`ulimit -l {_kib(needed)}`, which the hard limit, {hard}, allows without privilege"
    else:
        raise_it = f"`ulimit -l unlimited` as root: the hard limit is {_kib(limit.hard)} KiB"
    raise DOSConfigError(
        f"{setting}: {what} need {nbytes / 2**20:.1f} MiB of mlock'ed memory per rank, but RLIMIT_MEMLOCK "
        f"(`ulimit -l`) is {_kib(limit.soft)} KiB{held} and the process lacks CAP_IPC_LOCK, so DeepSpeed's "
        f"page-locked allocator would abort it: raise the limit where training starts ({raise_it}; docker run "
        "--ulimit memlock=-1; memlock in /etc/security/limits.conf, or LimitMEMLOCK= under systemd), or grant the "
        f"process CAP_IPC_LOCK (docker run --cap-add IPC_LOCK){also}"
    )
