"""How much host memory this process may still use, and a pre-flight check against it.

Host memory runs out differently from device memory: the kernel's OOM killer (or the container's
cgroup limit) ends the process with no Python error at all, at start-up or in the middle of a run.
So before the optimizer state is allocated, what it will need is compared with the tightest of:

- the cgroup limit of this process (v2 ``memory.max`` less ``memory.current``; v1
  ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``),
- ``MemAvailable`` in ``/proc/meminfo`` (what the kernel can give without swapping),
- ``LIGHTNING_DOS_HOST_MEMORY_LIMIT`` when set: a cap in bytes (``"64e9"`` works) on this process's
  resident memory, for schedulers that enforce limits the process cannot read.

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Environment variable: a host-memory cap in bytes for this process (its resident set counts against it).
LIMIT_ENV = "LIGHTNING_DOS_HOST_MEMORY_LIMIT"
#: cgroup v1 writes a number near 2**63 when there is no limit.
_NO_LIMIT = 1 << 60


class HostMemoryError(MemoryError):
    """The host does not have the memory the optimizer state needs; raised before anything is allocated."""


@dataclass(frozen=True)
class HostMemory:
    """The binding host-memory limit of this process.

    Attributes:
        headroom: bytes the process may still allocate.
        limit: the limit itself, in bytes.
        in_use: bytes counted against that limit now.
        source: where the limit comes from (for the error message).
    """

    headroom: int
    limit: int
    in_use: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_paths(proc: Path) -> tuple[str | None, str | None]:
    """This process's (v2, v1 memory) cgroup paths from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _cgroup_limits(sys_cgroup: Path, proc: Path) -> list[HostMemory]:
    found = []
    v2, v1 = _cgroup_paths(proc)
    # Inside a container the cgroup namespace usually shows this process's group as the mount's root.
    for rel in [v2] if v2 is not None else []:
        for base in dict.fromkeys([sys_cgroup / rel.lstrip("/"), sys_cgroup]):
            limit, used = _read_int(base / "memory.max"), _read_int(base / "memory.current")
            if limit is not None and used is not None:
                found.append(HostMemory(limit - used, limit, used, f"cgroup v2 memory.max ({base})"))
                break
    memory = sys_cgroup / "memory"
    for rel in [v1] if v1 is not None else []:
        for base in dict.fromkeys([memory / rel.lstrip("/"), memory]):
            limit = _read_int(base / "memory.limit_in_bytes")
            used = _read_int(base / "memory.usage_in_bytes")
            if limit is not None and used is not None:
                if limit < _NO_LIMIT:
                    found.append(HostMemory(limit - used, limit, used, f"cgroup v1 memory.limit_in_bytes ({base})"))
                break
    return found


def _meminfo(proc: Path) -> HostMemory | None:
    values = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(values) < 2:
        return None
    total, available = values["MemTotal"], values["MemAvailable"]
    return HostMemory(available, total, total - available, "MemAvailable in /proc/meminfo")


def resident_bytes(proc: Path = Path("/proc")) -> int:
    """This process's resident set size (``VmRSS``), 0 where it cannot be read."""
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parse_limit(text: str) -> int:
    """Parse ``LIGHTNING_DOS_HOST_MEMORY_LIMIT`` (bytes; ``"64e9"`` and ``"64000000000"`` both work)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{LIMIT_ENV}={text!r} is not valid; use a number of bytes such as 64e9")
    return int(value)


def host_memory(
    env: Mapping[str, str] = os.environ, sys_cgroup: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")
) -> HostMemory | None:
    """The tightest host-memory limit that applies to this process (None when none can be read)."""
    found = _cgroup_limits(sys_cgroup, proc)
    meminfo = _meminfo(proc)
    if meminfo is not None:
        found.append(meminfo)
    if env.get(LIMIT_ENV):
        cap, rss = parse_limit(env[LIMIT_ENV]), resident_bytes(proc)
        found.append(HostMemory(cap - rss, cap, rss, LIMIT_ENV))
    return min(found, key=lambda m: m.headroom) if found else None


def check_host_memory(needed: int, what: str, fix: str, memory: HostMemory | None = None) -> None:
    """Raise :class:`HostMemoryError` when ``needed`` bytes exceed the headroom of the binding limit.

    Args:
        needed: bytes about to be allocated.
        what: what they are for, for the message.
        fix: what the user can change, for the message.
        memory: the limit to check against (None: :func:`host_memory`).
    """
    memory = memory if memory is not None else host_memory()
    if memory is None or needed <= memory.headroom:
        return
    gb = 1e9
    raise HostMemoryError(
        f"lightning-dos: {what} needs {needed / gb:.2f} GB of host memory, but this process may allocate only "
        f"{max(0, memory.headroom) / gb:.2f} GB more (limit {memory.limit / gb:.2f} GB from {memory.source}, "
        f"{memory.in_use / gb:.2f} GB in use). {fix}"
    )


def return_freed_memory() -> bool:
    """Give the C allocator's freed heap pages back to the system (glibc ``malloc_trim``); False elsewhere.

    Buffers under glibc's mmap threshold (up to 32 MB) are carved from the heap, and freeing them does not
    lower the resident set: DeepSpeed's fp32 partitions, once the engine's slabs have replaced them, and
    the temporaries of DeepSpeed's start-up would otherwise stay resident for the whole run.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True


_malloc_trim = None
