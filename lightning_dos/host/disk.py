"""The NVMe drive under ``nvme_path``: checked before any work, and its bandwidth measured.

Checks, each a :class:`~lightning_dos.errors.DOSConfigError` naming the setting and what would do:

- the directory exists, is a directory, and a file can be created in it;
- it has room for the state that would live there (how much is needed, how much is free);
- its filesystem accepts ``O_DIRECT`` (DeepSpeed's async I/O op opens every swap file with it; tmpfs on older
  kernels, some network and FUSE filesystems refuse it);
- DeepSpeed's async I/O op (``AsyncIOBuilder``, libaio) can be built here: without ``libaio-dev`` it cannot, and
  the message names the package and the command.

:func:`measure_disk` times sequential reads and writes through that op, as the swapper would issue them (O_DIRECT,
blocks of ``block_size`` bytes, ``queue_depth`` in flight, from page-locked buffers: :class:`AioSettings`), into a
:class:`~lightning_dos.model.nvme.DiskRates` for the performance model.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import shutil
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_dos.engine.swap_files import ALIGNMENT  # O_DIRECT's unit: the drive's logical block, a page at least
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import quiet
from lightning_dos.host.extensions import announce_op_builds
from lightning_dos.host.memlock import check_lock_limit
from lightning_dos.model.nvme import DiskRates

LIBAIO_HINT = (
    "DeepSpeed's async I/O op needs libaio's headers and library, which this machine lacks: install them with "
    "`apt-get install libaio-dev` (Debian, Ubuntu; `dnf install libaio-devel` on Fedora or RHEL), or run "
    "`bash scripts/nvme-tools.sh` as root, which does; then run again"
)


def check_nvme_path(path: str | os.PathLike, needed_bytes: int = 0, *, setting: str = "nvme_path") -> Path:
    """``path`` resolved, once it is a writable directory with ``needed_bytes`` free on a filesystem that accepts
    O_DIRECT; otherwise a :class:`DOSConfigError` naming ``setting`` and what is wrong."""
    where = Path(path).expanduser()
    if not where.exists():
        raise DOSConfigError(
            f"{setting}={str(path)!r} does not exist: create it, or name a directory on the NVMe drive"
        )
    if not where.is_dir():
        raise DOSConfigError(f"{setting}={str(path)!r} is not a directory: name a directory on the NVMe drive")
    probe = where / f".lightning-dos-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as error:
        raise DOSConfigError(
            f"{setting}={str(path)!r}: cannot create a file there ({error.strerror}): name a directory this process "
            "may write"
        ) from None
    os.close(fd)
    try:
        _check_o_direct(probe, path, setting)
    finally:
        probe.unlink(missing_ok=True)
    free = shutil.disk_usage(where).free
    if needed_bytes > free:
        raise DOSConfigError(
            f"{setting}={str(path)!r} has {free / 1e9:.2f} GB free; the optimizer state that would live there needs "
            f"{needed_bytes / 1e9:.2f} GB: free {(needed_bytes - free) / 1e9:.2f} GB more, name another directory, or "
            "keep more of the state in host memory"
        )
    return where.resolve()


def _check_o_direct(probe: Path, path: str | os.PathLike, setting: str) -> None:
    """Write and read one aligned block of ``probe`` with O_DIRECT, as the swapper will."""
    block = mmap.mmap(-1, ALIGNMENT)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        try:
            os.write(fd, block)
            os.lseek(fd, 0, os.SEEK_SET)
            os.readv(fd, [block])
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        raise DOSConfigError(
            f"{setting}={str(path)!r}: its filesystem refuses O_DIRECT ({error.strerror}), which DeepSpeed's async "
            "I/O opens every swap file with: name a directory on a local filesystem of the NVMe drive (ext4, xfs)"
        ) from None
    finally:
        block.close()


def aio_unavailable() -> str | None:
    """Why DeepSpeed's async I/O op cannot be built here (:data:`LIBAIO_HINT`), or None when it can."""
    quiet.install()  # DeepSpeed's "Setting accelerator to CPU" as its op builders load, among others
    from deepspeed.ops.op_builder import AsyncIOBuilder

    # DeepSpeed's check compiles and links a program calling io_submit, with the stderr file descriptor sent to a
    # file meanwhile: a sys.stderr without one (a captured stream) would make it answer False whatever is installed.
    with quiet.known_prints_dropped(), contextlib.redirect_stderr(sys.__stderr__ or sys.stderr):
        compatible = AsyncIOBuilder().is_compatible(verbose=False)
    return None if compatible else LIBAIO_HINT


def load_aio(setting: str = "offload_optimizer.device='nvme'"):  # noqa: ANN201 - DeepSpeed's extension module
    """DeepSpeed's async I/O op, built on first use (a few minutes) and cached in torch's extensions directory; a
    :class:`DOSConfigError` naming ``setting`` (what asked for it) where it cannot be built."""
    reason = aio_unavailable()
    if reason is not None:
        raise DOSConfigError(f"{setting}: {reason}")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    announce_op_builds()  # its first build takes minutes
    with quiet.known_prints_dropped(), arch_list_deepspeed_parses():  # "DeepSpeed async_io built successfully"
        return AsyncIOBuilder().load(verbose=False)


def deepspeed_arch_list(value: str) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT builder can read it: "X.Y" or "X.Y+PTX" entries, ';'-separated.

    Its builder splits each entry at the dot and reads both parts as integers, so an arch-specific target that torch
    and nvcc accept ("9.0a", Hopper's wgmma target; "10.0f") stops every CUDA op build with "invalid literal for
    int()". Such an entry becomes its plain "X.Y"; anything else unreadable is dropped; None when nothing is left."""
    entries: list[str] = []
    for entry in value.replace(";", " ").split():
        parsed = re.fullmatch(r"(\d+)\.(\d+)[A-Za-z]*(\+PTX)?", entry)
        if parsed is not None:
            token = f"{parsed[1]}.{parsed[2]}{parsed[3] or ''}"
            if token not in entries:
                entries.append(token)
    return ";".join(entries) or None


@contextlib.contextmanager
def arch_list_deepspeed_parses():  # noqa: ANN201 - a context manager
    """``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed reads (:func:`deepspeed_arch_list`) while an op builds, then
    the user's value again. On a GPU node whose environment names "9.0a" (an H200, 2026-11-28) the async I/O op
    would not build otherwise; it has no CUDA kernels, so the targets it is built for change nothing."""
    name = "TORCH_CUDA_ARCH_LIST"
    value = os.environ.get(name)
    readable = None if value is None else deepspeed_arch_list(value)
    if value is None or readable == value.strip():
        yield
        return
    if readable is None:
        del os.environ[name]  # DeepSpeed then reads the visible GPUs' capabilities
    else:
        os.environ[name] = readable
    try:
        yield
    finally:
        os.environ[name] = value


@dataclass(frozen=True)
class AioSettings:
    """How a measurement drives DeepSpeed's async I/O op: requests in blocks of ``block_size`` bytes, ``queue_depth``
    of them in flight, each split over ``threads`` threads (the op's ``intra_op_parallelism``)."""

    block_size: int = 1 << 20
    queue_depth: int = 32
    threads: int = 2


@contextlib.contextmanager
def _measurement_files(
    path: str | os.PathLike, nbytes: int, suffixes: Sequence[str], settings: AioSettings
) -> Iterator[list[tuple[Any, Any, Path]]]:
    """For each of ``suffixes``: a handle of the async I/O op, a page-locked buffer of ``nbytes`` random bytes and a
    file name on the drive under ``path`` (``.lightning-dos-measure-<pid>-<random><suffix>``), for as long as the
    ``with`` lasts; then the files are removed and the buffers freed. DeepSpeed's notice about SSD wear (logged once
    per process, at the first write) is dropped meanwhile: a run that keeps state on the drive says it in its own
    words (:func:`ssd_wear_notice`)."""
    import torch

    if nbytes <= 0 or nbytes % ALIGNMENT:
        raise ValueError(f"nbytes must be a positive multiple of {ALIGNMENT}, got {nbytes}")
    total = nbytes * len(suffixes)
    where = check_nvme_path(path, total)
    aio = load_aio()
    # Past RLIMIT_MEMLOCK DeepSpeed's allocator aborts the process: refused by name instead.
    check_lock_limit(total, "the drive measurement's buffers", setting=f"measuring the drive under {str(path)!r}")
    handles = [
        aio.aio_handle(settings.block_size, settings.queue_depth, False, True, settings.threads) for _ in suffixes
    ]
    buffers = [h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8)) for h in handles]
    stem = f".lightning-dos-measure-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    files = [where / f"{stem}{suffix}" for suffix in suffixes]
    try:
        with quiet.log_line_dropped(*quiet.SSD_WEAR_NOTICE):
            for buffer in buffers:
                buffer.random_(0, 256)
            yield list(zip(handles, buffers, files))
    finally:
        for file in files:
            file.unlink(missing_ok=True)
        for handle, buffer in zip(handles, buffers):
            handle.free_cpu_locked_tensor(buffer)


def measure_disk(
    path: str | os.PathLike, nbytes: int = 256 << 20, *, settings: AioSettings = AioSettings(), repeats: int = 2
) -> DiskRates:
    """Sequential read and write bandwidth of the drive under ``path`` through DeepSpeed's async I/O op: a file of
    ``nbytes`` written and read back from page-locked memory, ``repeats`` times, best of each (the file is removed
    after). Reads right after writes may come from the drive's own cache; use ``nbytes`` well above it (several
    GB) for figures that hold over a whole update. DeepSpeed's notice about SSD wear is dropped
    (:func:`_measurement_files`)."""
    with _measurement_files(path, nbytes, [""], settings) as [(handle, buffer, target)]:
        write_s, read_s = _best_write_and_read(handle, buffer, target, repeats)
    return DiskRates(read_bps=nbytes / read_s, write_bps=nbytes / write_s)


def ssd_wear_notice(written_per_step: int) -> str:
    """What DeepSpeed's one 365-character notice says, for a run that writes ``written_per_step`` bytes of optimizer
    state to the drive every step (per rank), in lines of at most 80 columns."""
    per_step = f"{written_per_step / 1e9:.2f} GB" if written_per_step >= 1e8 else f"{written_per_step / 1e6:.2f} MB"
    said = (
        f"lightning-dos: each step writes up to {per_step} of optimizer state per rank to the drive: that wears out a "
        "consumer SSD's rated endurance (TBW) fast; use a datacenter SSD for sustained training."
    )
    return "\n".join(textwrap.wrap(said, 80, subsequent_indent="  "))


def _best_write_and_read(handle, buffer, target: Path, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """Seconds of the fastest of ``repeats`` writes of ``buffer`` into ``target``, and of the reads back."""
    best_write = best_read = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        handle.async_pwrite(buffer, str(target), 0)
        handle.wait()
        best_write = min(best_write, time.perf_counter() - start)
        start = time.perf_counter()
        handle.async_pread(buffer, str(target), 0)
        handle.wait()
        best_read = min(best_read, time.perf_counter() - start)
    return best_write, best_read


def measure_mixed(
    path: str | os.PathLike, nbytes: int = 256 << 20, *, settings: AioSettings = AioSettings(), repeats: int = 2
) -> float:
    """Bytes per second the drive under ``path`` moves reading ``nbytes`` and writing ``nbytes`` at once (two handles
    of DeepSpeed's async I/O op, one request each, from page-locked memory), the fastest of ``repeats``: the rate of
    an update whose reads and writes overlap, as both ours and DeepSpeed's swapper run them. A drive serves the two
    directions together faster than one after the other where its reads and writes do not share one queue."""
    best = float("inf")
    with _measurement_files(path, nbytes, ["-read", "-write"], settings) as [reading, writing]:
        (reader, read_buffer, source), (writer, write_buffer, target) = reading, writing
        reader.async_pwrite(read_buffer, str(source), 0)
        reader.wait()
        for _ in range(repeats):
            start = time.perf_counter()
            reader.async_pread(read_buffer, str(source), 0)
            writer.async_pwrite(write_buffer, str(target), 0)
            reader.wait()
            writer.wait()
            best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def build_nvme_ops() -> int:
    """``python -m lightning_dos.host.disk``: build the NVMe tier's ops now (DeepSpeed's async I/O and pinned-memory
    ops, into this install's extensions folder, each announced), so that the first NVMe run does not wait minutes for
    them (``scripts/nvme-tools.sh`` runs it). One line and exit status 1 where they cannot be built."""
    from lightning_dos.host.extensions import use_own_extensions_dir

    use_own_extensions_dir()
    try:
        load_aio("building the NVMe tier's ops")
        from deepspeed.ops.op_builder import PinMemoryBuilder

        with quiet.known_prints_dropped(), arch_list_deepspeed_parses():
            PinMemoryBuilder().load(verbose=False)
    except DOSConfigError as error:
        print(f"lightning-dos: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(build_nvme_ops())
