"""One notice on the console before a build of native code: what is built, why, and about how long it takes.

A first run builds the engine's host kernel (``host_adam.c``, seconds) and DeepSpeed's ops (the NVMe tier's async
I/O op: minutes on a small machine); without a word, that reads as a hang. A build says so as it starts, on
stderr, wrapped at 80 columns; a run that finds everything built prints nothing.
"""

from __future__ import annotations

import os
import sys
import textwrap

WIDTH = 80


def cores() -> int:
    """The CPU cores this process may run on (a build runs its compiler jobs on them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def about(cpu_seconds: tuple[float, float], jobs: int = 1, on_cores: int | None = None) -> str:
    """The wall time, as "about 2-5 minutes on 2 cores", of ``jobs`` compiler jobs costing ``cpu_seconds`` together
    (a low and a high figure) when they share ``on_cores`` cores (:func:`cores` by default)."""
    n = on_cores if on_cores is not None else cores()
    parallel = max(1, min(n, jobs))
    low, high = (seconds / parallel for seconds in cpu_seconds)
    where = f" on {n} core{'s' if n != 1 else ''}" if jobs > 1 else ""
    if high < 90:
        return f"about {max(1, round(low))}-{max(2, round(high))} s{where}"
    low_min = max(1, round(low / 60))
    return f"about {low_min}-{max(low_min + 1, round(high / 60))} minutes{where}"


def build_notice(what: str, why: str, when: str, how_long: str) -> str:
    """The notice: one line where it fits :data:`WIDTH` columns, else what and why on the first, when and how long
    on the second (indented), each wrapped should it still not fit."""
    first = f"lightning-dos: building {what} {why}"
    second = f"({when}, {how_long}) ..."
    if len(first) + 1 + len(second) <= WIDTH:
        return f"{first} {second}"
    wrap = textwrap.TextWrapper(WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join([wrap.fill(first), wrap.fill("  " + second)])


def announce_build(what: str, why: str, when: str, how_long: str) -> None:
    """Print :func:`build_notice` on stderr now (before the build starts, flushed)."""
    print(build_notice(what, why, when, how_long), file=sys.stderr, flush=True)
