"""Ranks that measure and plan together, through the process group Lightning and DeepSpeed set up.

During the update every local rank streams over the same PCIe switch and updates on the same host memory
bandwidth at once. A rank that calibrates alone measures an idle node and overstates both; ranks that
calibrate at different moments measure different things, and may then choose different ``"auto"`` plans,
the slowest of which gates every step. So all ranks calibrate at the same moment (a collective first, then
all at once) and use the slowest rate of each kind over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_dos.model.nvme import DiskRates
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.planning.agree import ReduceMin, min_rates


def reduce_min_over_ranks(device: torch.device, group: object = None) -> ReduceMin | None:
    """Element-wise minimum over every rank of ``group``; None with a single process.

    Call it on the training thread, outside backward, at a point every rank reaches in the same order: ranks that
    entered it and another communicator (DeepSpeed's) in different orders would wait for each other for ever.

    Args:
        device: this rank's device; NCCL reduces tensors on it, other backends (gloo) reduce host tensors.
        group: the process group (None: the default one). Once DeepSpeed runs, the strategy passes its data-parallel
            group, whose collectives (the gradients' reduce-scatters) then share one communicator with these.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return None
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def reduce_min(values: list[float]) -> list[float]:
        # float64 holds every size and byte count exactly (below 2**53) and infinity for "no limit".
        tensor = torch.tensor(values, dtype=torch.float64, device=where)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        return tensor.tolist()  # waits for the collective on every backend

    return reduce_min


@dataclass(frozen=True)
class Calibration:
    """One rank's calibration.

    Attributes:
        started: wall-clock time (``time.time()``) the measurement began on this rank, after every rank was ready.
        ended: wall-clock time it ended.
        measured: the rates this rank measured.
        agreed: the rates every rank uses: each the minimum over the ranks (``measured`` with one rank).
    """

    started: float
    ended: float
    measured: HardwareRates
    agreed: HardwareRates


def calibrate_together(measure: Callable[[], HardwareRates], reduce_min: ReduceMin | None) -> Calibration:
    """Run ``measure`` on every rank at once and agree on the slowest rates.

    Args:
        measure: this rank's calibration.
        reduce_min: the ranks' element-wise minimum (:func:`reduce_min_over_ranks`); None for one process.
    """
    if reduce_min is not None:
        # A collective returns on no rank before every rank has entered it: the barrier before measuring.
        reduce_min([0.0])
    started = time.time()
    measured = measure()
    ended = time.time()
    agreed = min_rates(measured, reduce_min) if reduce_min is not None else measured
    return Calibration(started, ended, measured, agreed)


@dataclass(frozen=True)
class DriveMeasurement:
    """One rank's measurement of the drive under ``nvme_path``.

    Attributes:
        started: wall-clock time (``time.time()``) the measurement began on this rank, after every rank was ready.
        ended: wall-clock time it ended.
        agreed: the rates every rank that measured uses: each the minimum over those ranks.
    """

    started: float
    ended: float
    agreed: DiskRates


def measure_drive_together(
    measure: Callable[[], DiskRates] | None, reduce_min: ReduceMin | None
) -> DriveMeasurement | None:
    """Run ``measure`` on every rank at once and agree on the slowest rates: the node's ranks share its drive during
    the update, so each measures its share, as it will see the drive then (one rank measuring an idle drive would
    overstate it as many times as there are ranks). A rank with nothing to measure (``measure`` None: its state all
    fits its host budget, which ``"auto"`` resolves rank by rank) still takes part in both collectives, and gets None.

    Args:
        measure: this rank's measurement, or None.
        reduce_min: the ranks' element-wise minimum (:func:`reduce_min_over_ranks`); None for one process.
    """
    if reduce_min is not None:
        reduce_min([0.0])  # the barrier before measuring
    started = time.time()
    measured = measure() if measure is not None else None
    ended = time.time()
    rates = [measured.read_bps, measured.write_bps] if measured is not None else [float("inf")] * 2
    if reduce_min is not None:
        rates = reduce_min(rates)
    return DriveMeasurement(started, ended, DiskRates(*rates)) if measured is not None else None
