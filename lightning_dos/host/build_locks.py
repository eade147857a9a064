"""Build locks left by killed builds: said in one line, and removed where no process can be holding them.

torch's JIT (``torch.utils.cpp_extension.load``, every DeepSpeed op this project loads) takes a ``lock`` file in
the op's build folder for each load, built or not (``FileBaton``: created with ``O_CREAT | O_EXCL``, its file
descriptor kept open until the build or load is over, then closed and the file removed). A process killed in
between (SIGKILL, a job's time limit, a closed terminal) leaves the file, and every later load of that op waits for
it to go, for ever and without a word.

:func:`clear_or_wait` runs before each such load (:mod:`lightning_dos.host.extensions` installs it). It removes a
lock only where it can prove it abandoned on this host:

- the op's folder is on a local filesystem (on NFS and other shared ones a process on another host could hold it);
- the lock belongs to this user (or this process is root), so every process that could have taken it can be seen;
- no process has the lock file itself open (its device and inode, in ``/proc/*/fd``: a process ID reused since
  proves nothing either way, an open file does), twice, :data:`SETTLE_S` apart (torch closes the file just before
  it removes it);
- the processes deciding this at once (a run's ranks) take turns, under ``flock`` on the op's folder.

Then it says so in one line and the load goes on. A lock some process holds is waited for, quietly at first (a
rank loading the op holds it for a second), then in one line naming the process and how long it has held it, and
again every :data:`REMIND_S`; should the holder die meanwhile, the lock is removed as above. A lock it cannot prove
abandoned is waited for too, in one line saying why and which file to remove if no build of the op is running.

Linux only (``/proc``); elsewhere torch's own wait runs unchanged. From torch 2.14 the JIT holds an OS-level lock on
the file instead (the kernel releases it when the holder dies, and the file stays), so nothing is cleared there
(:func:`lightning_dos.host.extensions.lock_files_block`). Only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

#: torch's lock file in an op's build folder (``cpp_extension._jit_compile``).
LOCK_NAME = "lock"
#: Seconds a lock may be waited for before the wait is said (a load of a built op holds it about a second).
QUIET_S = 5.0
#: Seconds between reminders while the wait goes on.
REMIND_S = 600.0
#: Seconds between the two looks that must both find no holder before a lock is removed.
SETTLE_S = 0.5
#: Seconds between looks at the lock file while waiting, and between looks at who holds it.
POLL_S = 0.25
INSPECT_S = 2.0
#: Filesystems whose files only this host's processes can hold open. Any other (nfs, cifs, lustre, gpfs, ceph,
#: fuse, ...) may be shared with other hosts, whose processes no look at /proc can see.
LOCAL_FILESYSTEMS = frozenset(
    "ext2 ext3 ext4 xfs btrfs zfs f2fs bcachefs jfs reiserfs nilfs2 tmpfs ramfs overlay vfat exfat ntfs3".split()
)


@dataclass(frozen=True)
class LockState:
    """What one look at a lock found.

    Attributes:
        kind: "free" (no lock), "held" (``holders`` have it open), "abandoned" (provably held by no one) or
            "unknown" (it cannot be proved abandoned: ``why``).
        identity: the lock file's device and inode (None when free).
        age_s: seconds since the lock was taken (its modification time; torch never writes it).
        holders: the processes that have it open.
        why: why a lock held by no visible process cannot be called abandoned.
    """

    kind: str
    identity: tuple[int, int] | None = None
    age_s: float = 0.0
    holders: tuple[int, ...] = ()
    why: str = ""


def supported() -> bool:
    """Whether processes' open files can be seen here (Linux's ``/proc``)."""
    return os.path.isdir("/proc/self/fd")


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The type of the filesystem ``path`` is on ("ext4", "nfs4", ...), from ``/proc/self/mountinfo``; None where
    it cannot be told."""
    try:
        device = os.stat(path).st_dev
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields, _, rest = line.partition(" - ")
                major, _, minor = fields.split()[2].partition(":")
                if os.makedev(int(major), int(minor)) == device and rest:
                    return rest.split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None


def _processes() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _boot_time() -> float:
    with open("/proc/stat") as handle:
        return float(next(line for line in handle if line.startswith("btime ")).split()[1])


def started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, to the second), None where it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            ticks = int(handle.read().rpartition(")")[2].split()[19])  # field 22, after the command in parentheses
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def holders_of(identity: tuple[int, int], owner: int, taken: float) -> tuple[tuple[int, ...], str]:
    """The processes with the file ``identity`` (device, inode) open, and, where a process that could have taken it
    at ``taken`` (one of its ``owner``'s, started by then) could not be looked into, why the answer may be
    incomplete ("" when it is complete).

    A process started after the lock was taken did not take it: it can hold it only as a child forked by its taker,
    and a lock whose taker ended is never released, whatever its children hold."""
    holders: list[int] = []
    hidden = ""
    for pid in _processes():
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:  # ended meanwhile
            continue
        except OSError:  # another user's, or one made undumpable (a set-user-ID program, ssh-agent)
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            start = started(pid)
            if uid == owner and not hidden and (start is None or start <= taken + 1.0):  # btime: to the second
                hidden = f"process {pid} ({_command(pid)}), one of its owner's, cannot be looked into"
            continue
        for fd in fds:
            try:
                if not os.readlink(f"{fd_dir}/{fd}").rpartition("/")[2].startswith(LOCK_NAME):  # " (deleted)" too
                    continue
                opened = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if (opened.st_dev, opened.st_ino) == identity:
                holders.append(pid)
                break
    return tuple(holders), hidden


def inspect(lock: str | os.PathLike[str]) -> LockState:
    """One look at ``lock``: free, held (by whom), abandoned, or not provably either."""
    try:
        info = os.lstat(lock)
    except FileNotFoundError:
        return LockState("free")
    identity = (info.st_dev, info.st_ino)
    age = max(0.0, time.time() - info.st_mtime)
    if not stat.S_ISREG(info.st_mode):
        return LockState("unknown", identity, age, why="it is not a plain file")
    holders, hidden = holders_of(identity, info.st_uid, info.st_mtime)
    if holders:
        return LockState("held", identity, age, holders)
    kind = filesystem_type(os.path.dirname(os.path.abspath(lock)))
    if kind not in LOCAL_FILESYSTEMS:
        fs = f"its filesystem is {kind}" if kind else "its filesystem's type is unknown"
        why = f"{fs}, where a build on another host cannot be seen from here"
    elif os.geteuid() not in (0, info.st_uid):
        why = f"it belongs to user {info.st_uid}, whose processes this one cannot look into"
    else:
        why = hidden
    return LockState("unknown" if why else "abandoned", identity, age, why=why)


def _command(pid: int) -> str:
    """``pid``'s command line, shortened to about 60 characters."""
    if pid == os.getpid():
        return "this process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            words = handle.read().rstrip(b"\0").decode(errors="replace").split("\0")
    except OSError:
        return "ended"
    words[0] = os.path.basename(words[0])
    text = " ".join(" ".join(words).split())  # one line, whatever the arguments hold
    return text if len(text) <= 60 else text[:57] + "..."


def duration(seconds: float) -> str:
    """``seconds`` as "35 s", "4 min", "3 h" or "2 days"."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


@contextlib.contextmanager
def _turn(folder: str) -> Iterator[None]:
    """One process at a time in ``folder`` (``flock`` on the folder itself: nothing is added to it)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def remove_if_abandoned(lock: str | os.PathLike[str]) -> LockState:
    """Remove ``lock`` where it is provably abandoned; return what was found (kind "abandoned": it was removed).

    Two looks :data:`SETTLE_S` apart must find the same file and no holder (a holder closes the file just before it
    removes it); the processes doing this take turns, so none removes a lock another has just taken."""
    with _turn(os.path.dirname(os.path.abspath(lock))):
        first = inspect(lock)
        if first.kind != "abandoned":
            return first
        time.sleep(SETTLE_S)
        second = inspect(lock)
        if second.kind != "abandoned" or second.identity != first.identity:
            return second
        os.remove(lock)
        return second


def _wrapped(message: str) -> str:
    """``message`` in lines of at most 80 columns (as the build notice: lightning_dos.engine.announce), the later ones
    indented; a path longer than a line is kept whole."""
    return textwrap.fill(message, 80, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def _removed_line(lock: str, what: str, state: LockState) -> str:
    return (
        f"lightning-dos: removed the build lock of {what} ({lock}): the build or load that took it "
        f"{duration(state.age_s)} ago ended without releasing it, and no process on this host holds it"
    )


def _waiting_line(lock: str, what: str, state: LockState, waited: float, still: bool) -> str:
    lead = "still waiting" if still else "waiting"
    if state.kind == "held":
        pid = state.holders[0]
        line = (
            f"lightning-dos: {lead} for process {pid} ({_command(pid)}), which has held the build lock of {what} "
            f"for {duration(state.age_s)}"
        )
        return line if still else f"{line}: it is building or loading the op ({lock})"
    return (
        f"lightning-dos: {lead} for the build lock of {what}, taken {duration(state.age_s)} ago "
        f"(waited {duration(waited)}): {state.why}; if no build of the op is running, remove {lock}"
    )


def _identity(lock: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(lock)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def clear_or_wait(lock: str | os.PathLike[str], what: str, out: TextIO | None = None) -> None:
    """Before a load of the op whose build lock is ``lock`` (``what`` names the op): return at once where there is
    none; remove it and say so where it is abandoned; else wait until it goes (or its holder ends), saying so after
    :data:`QUIET_S` and every :data:`REMIND_S`. Each line goes to ``out`` (stderr), flushed."""
    if not supported():
        return
    lock = os.fspath(lock)
    stream = out if out is not None else sys.stderr
    start = time.monotonic()
    said_at: float | None = None
    while True:
        state = inspect(lock)
        if state.kind == "free":
            return
        if state.kind == "abandoned":
            state = remove_if_abandoned(lock)
            if state.kind == "abandoned":
                print(_wrapped(_removed_line(lock, what, state)), file=stream, flush=True)
                return
            continue
        waited = time.monotonic() - start
        if (said_at is None and waited >= QUIET_S) or (said_at is not None and waited - said_at >= REMIND_S):
            print(
                _wrapped(_waiting_line(lock, what, state, waited, still=said_at is not None)), file=stream, flush=True
            )
            said_at = waited
        # Until the next look at who holds it, only whether this same file is still there.
        looked = time.monotonic()
        while _identity(lock) == state.identity and time.monotonic() - looked < INSPECT_S:
            time.sleep(POLL_S)


__all__ = ["LockState", "clear_or_wait", "inspect", "remove_if_abandoned"]
