"""The strategy's NVMe tier settings: ``offload_optimizer.device: nvme`` taken from the DeepSpeed config (DeepSpeed
itself then offloads to ``cpu``: the engine moves the state between host and files), the host budget resolved, and
every check made before any work (:mod:`lightning_dos.host.disk`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_dos.errors import DOSConfigError
from lightning_dos.host.hostmem import HostMemory
from lightning_dos.host.memlock import LockLimit, check_lock_limit
from lightning_dos.host.ranks import DriveMeasurement
from lightning_dos.model.nvme import DiskRates

if TYPE_CHECKING:
    from lightning_dos.integration.preflight import HostFigure

#: Share of the host memory found spare that ``host_memory_budget="auto"`` gives the optimizer state.
AUTO_SHARE = 0.9
#: Bytes written and read back on ``nvme_path`` at start-up to measure the drive (a fraction of a second on NVMe).
CALIBRATION_BYTES = 64 << 20


@dataclass
class NvmeTier:
    """Where and how the file-backed optimizer state is kept.

    Attributes:
        path: ``nvme_path``: the directory of the swap files (one per rank).
        host_budget: ``host_memory_budget``: bytes of master weights and optimizer state kept in host memory per
            rank, or ``"auto"`` (resolved by the pre-flight, :func:`resolve_host_budget`).
        block_size: bytes per I/O request (DeepSpeed's ``aio.block_size``).
        queue_depth: requests in flight per staging slab (``aio.queue_depth``).
        threads: threads that split each request (``aio.intra_op_parallelism``; ``aio.thread_count`` in older
            DeepSpeed configs).
        host_bytes: ``host_budget`` resolved by this fit's pre-flight (None before it).
        drive: the drive's read and write bandwidth, measured on ``path`` by this fit's pre-flight when state goes to
            files (None otherwise), every rank at once, the slowest over them: the ratio scheduler predicts each
            update with it.
        measurement: that measurement, with when it began and ended on this rank (None when none was taken).
    """

    path: str
    host_budget: int | str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    host_bytes: int | None = None
    drive: DiskRates | None = None
    measurement: DriveMeasurement | None = None


def check_host_budget(value: Any) -> None:
    """Refuse a ``host_memory_budget`` that is not ``"auto"`` or a non-negative number of bytes."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise DOSConfigError(
            f"host_memory_budget={value!r} is not valid for DeepOptimizerStatesStrategy; use 'auto' or a non-negative "
            "number of bytes of optimizer state kept in host memory per rank (0: all of it on NVMe)"
        )


def take_nvme_tier(config: dict[str, Any], host_budget: int | str) -> NvmeTier | None:
    """The NVMe tier ``config`` asks for (``zero_optimization.offload_optimizer.device: nvme``), taken out of it:
    the section then says ``cpu`` to DeepSpeed, whose own swapper must not run. None when it asks for none."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if not isinstance(offload, dict) or str(offload.get("device", "cpu")).lower() != "nvme":
        return None
    path = offload.pop("nvme_path", None)
    if not path:
        raise DOSConfigError(
            "zero_optimization.offload_optimizer.device='nvme' needs nvme_path: the directory on the NVMe drive where "
            "each rank keeps its swap file"
        )
    offload["device"] = "cpu"
    for key in ("buffer_count", "pipeline_read", "pipeline_write", "fast_init"):  # DeepSpeed's swapper's, not ours
        offload.pop(key, None)
    aio = config.get("aio") or {}
    tier = NvmeTier(str(path), host_budget)
    for key, field in (("block_size",) * 2, ("queue_depth",) * 2, ("intra_op_parallelism", "threads"),
                       ("thread_count", "threads")):  # fmt: skip
        if key in aio:
            value = aio[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DOSConfigError(f"aio.{key}={value!r} is not valid; use a positive integer")
            setattr(tier, field, value)
    if tier.block_size % 4096:
        raise DOSConfigError(f"aio.block_size={tier.block_size} is not valid; use a multiple of 4096 bytes")
    return tier


def resolve_host_budget(
    tier: NvmeTier,
    state_bytes: int,
    other_bytes: int,
    memory: HostMemory | None,
    ranks: int,
    startup_share: float = 0.0,
) -> int:
    """Bytes of this rank's ``state_bytes`` of master weights and optimizer state kept in host memory: the budget
    asked for, or under ``"auto"`` a share (:data:`AUTO_SHARE`) of what the host limit leaves each of the node's
    ``ranks`` once their ``other_bytes`` (gradient buffers, staging, the 16-bit ring) are counted, and, of the state
    bound for the file, the ``startup_share`` start-up holds until it is written there (DeepSpeed's fp32 master
    partitions: 1/3 of Adam's fp32 state); never more than the state. No readable limit: all of it."""
    if tier.host_budget != "auto":
        return min(int(tier.host_budget), state_bytes)
    if memory is None:
        return state_bytes
    # other + b + startup_share * (state - b) must fit what each rank has: solved for b.
    spare = memory.headroom // max(1, ranks) - other_bytes - startup_share * state_bytes
    return max(0, min(state_bytes, int(spare * AUTO_SHARE / (1.0 - startup_share))))


def check_locked_memory(staging: int, figure: HostFigure, limit: LockLimit | None = None) -> None:
    """Refuse, before the drive is measured, a rank that may not ``mlock`` what the tier locks (a
    :class:`DOSConfigError` naming ``RLIMIT_MEMLOCK`` and the fix; see :mod:`lightning_dos.host.memlock`): at most at
    once, the measurement's :data:`CALIBRATION_BYTES` at start-up (freed before the slabs are made), or the
    ``staging`` slabs beside the DeepSpeed buffers of the rank's pre-flight ``figure`` where DeepSpeed locks them
    with the same allocator (``DS_PIN_MEMORY_BACKEND=native``). ``limit``: this process's when None."""
    native = sum(n for what, n in figure.items if what.startswith("DeepSpeed")) if figure.backend == "native" else 0
    slabs = staging + native
    beside = f" beside DeepSpeed's {native / 2**20:.1f} MiB under DS_PIN_MEMORY_BACKEND=native" if native else ""
    what = (
        f"the drive's measurement ({CALIBRATION_BYTES / 2**20:.0f} MiB) and then the staging slabs "
        f"({staging / 2**20:.1f} MiB{beside})"
    )
    smaller = ", or smaller staging slabs (a smaller sub_group_size)" if slabs > CALIBRATION_BYTES else ""
    check_lock_limit(
        max(CALIBRATION_BYTES, slabs), what, setting="offload_optimizer.device='nvme'", also=smaller, limit=limit
    )
