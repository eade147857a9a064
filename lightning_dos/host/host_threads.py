"""Applies ``host_threads`` to this process: binds it to its cores and sets torch's thread count.

The choice itself is :func:`lightning_dos.host.cores.choose_host_placement`; this module gathers what it
needs (every local rank's affinity and accelerator NUMA node, through the process group when there is one),
applies it, and prints it once per rank. With ``overlap`` on, :func:`leave_training_core` then measures whether
the update should leave the training thread a core of its own (:func:`lightning_dos.host.cores.choose_update_threads`).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
from dataclasses import replace

import torch

from lightning_dos.host.cores import (
    HostPlacement,
    ThreadOption,
    choose_host_placement,
    choose_update_threads,
    format_cpulist,
    pci_address,
    read_numa_cpus,
    read_pci_numa_node,
    read_physical_cores,
)
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.planning.calibrate import Contention, measure_contention

_printed: dict[int, HostPlacement] = {}


def accelerator_numa_node(device: torch.device) -> int | None:
    """NUMA node of ``device`` when it is a CUDA GPU whose PCI address sysfs knows; None otherwise."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if any(i is None for i in ids):
        return None
    return read_pci_numa_node(pci_address(*ids))


def _affinity() -> list[int]:
    # Linux has it; elsewhere every CPU counts as usable (and nothing is bound: see bind_process).
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _local_ranks(local_rank: int, device: torch.device) -> tuple[list[list[int]], list[int | None], int]:
    """Affinity and accelerator NUMA node of every rank on this node, and this rank's index among them."""
    mine = (socket.gethostname(), local_rank, _affinity(), accelerator_numa_node(device))
    everyone = [mine]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    local = sorted((r for r in everyone if r[0] == mine[0]), key=lambda r: r[1])
    return [r[2] for r in local], [r[3] for r in local], [r[1] for r in local].index(local_rank)


def bind_process(cpus: tuple[int, ...]) -> None:
    """Bind every thread of this process that still has the main thread's affinity to ``cpus`` (threads
    started later inherit it); threads someone else bound keep their binding. A no-op where the OS has no
    affinity calls."""
    if not hasattr(os, "sched_setaffinity"):
        return
    before = os.sched_getaffinity(0)
    if set(cpus) == before:
        return
    os.sched_setaffinity(0, cpus)
    # A thread not yet rebound may start another, which inherits the old mask: sweep until none is left.
    for _ in range(10):
        moved = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                if os.sched_getaffinity(int(tid)) == before:
                    os.sched_setaffinity(int(tid), cpus)
                    moved += 1
            except OSError:  # the thread has exited meanwhile
                continue
        if not moved:
            break


def apply_host_threads(setting: int | str, local_rank: int, global_rank: int, device: torch.device) -> HostPlacement:
    """Choose, apply and print (once per rank and choice) this rank's host threads and cores.

    Args:
        setting: the strategy's ``host_threads``: a positive number of threads, or ``"auto"``.
        local_rank: this rank's index on its node.
        global_rank: this rank's index in the job (for the printed line).
        device: this rank's accelerator (its NUMA node is preferred), or the CPU.
    """
    affinities, nodes, index = _local_ranks(local_rank, device)
    everyone = sorted(set().union(*map(set, affinities)))
    placement = choose_host_placement(
        setting, index, affinities, nodes, read_numa_cpus(), read_physical_cores(everyone)
    )
    if placement.cores is not None:
        bind_process(placement.cores)
    torch.set_num_threads(placement.threads)
    _say(placement, global_rank)
    return placement


def _say(placement: HostPlacement, global_rank: int) -> None:
    """Print ``placement`` for this rank, once per rank and choice."""
    if _printed.get(global_rank) != placement:
        _printed[global_rank] = placement
        cpus = format_cpulist(_affinity())
        # One write of the whole line: ranks share the console, and print() writes the newline separately.
        # The reason goes on a second line where the console is too narrow for both (80 columns in a log file).
        head = f"[rank {global_rank}] host threads: {placement.threads} on CPUs {cpus}"
        line = f"{head} ({placement.why})"
        if len(line) > shutil.get_terminal_size().columns:
            line = f"{head}\n[rank {global_rank}]   ({placement.why})"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@functools.lru_cache(maxsize=8)
def _contention(
    device: torch.device, numel: int, threads: int, footprint: Footprint, sub_group: int | None
) -> Contention:
    # Once per process and set-up (it does not change between fits), as the calibration is.
    return measure_contention(device, numel, threads, footprint=footprint, sub_group=sub_group)


def leave_training_core(
    placement: HostPlacement,
    global_rank: int,
    device: torch.device,
    numel: int,
    footprint: Footprint = ADAM_FP32,
    sub_group: int | None = None,
    *,
    forward_on_host_threads: bool | None = None,
) -> tuple[HostPlacement, Contention]:
    """With ``host_threads="auto"`` and ``overlap`` on: keep the update on every thread ``placement`` gives, or on one
    fewer so that the training thread (whose forward and backward run beside the update, bound by ZeRO-3's hooks)
    has a core of its own, whichever makes the overlapped phase shorter as measured
    (:func:`~lightning_dos.planning.calibrate.measure_contention` on each count,
    :func:`~lightning_dos.host.cores.choose_update_threads` at the balance point); sets torch's thread count to it
    and says so. With one thread there is none to leave (said too).

    On a CPU "device" every core is kept and nothing is chosen: forward and backward are the CPU's own kernels there,
    on the same torch thread count as the update's (one count per process), so a core left would slow them as much
    (measured once on 2 cores: the README's main job with a core left ran its forward and backward on one thread,
    and its predicted update phase strayed to a median 3.3x the measured one, against within 1.5x on every core).

    Args:
        placement: what :func:`apply_host_threads` chose and applied.
        global_rank: this rank's index in the job (for the printed line).
        device: the engine's device; numel, footprint, sub_group: the measurement's (as for calibration).
        forward_on_host_threads: whether forward and backward run on torch's host threads (None: on a CPU device).

    Returns:
        The placement now in force, and the contention measured at its thread count (for the calibration).
    """
    threads = placement.threads
    if forward_on_host_threads is None:
        forward_on_host_threads = device.type == "cpu"
    if forward_on_host_threads:
        return placement, _contention(device, numel, threads, footprint, sub_group)
    if threads < 2:
        kept = replace(placement, why=f"{placement.why}; overlap on, but one core: none left to the training thread")
        _say(kept, global_rank)
        return kept, _contention(device, numel, 1, footprint, sub_group)
    measured = {n: _contention(device, numel, n, footprint, sub_group) for n in (threads, threads - 1)}
    options = [ThreadOption(n, m.host_s_per_element, m.host_speed, m.launch_speed) for n, m in measured.items()]
    chosen = choose_update_threads(options)
    if chosen.threads == threads:
        return placement, measured[threads]
    balance = measured[threads].host_s_per_element  # the training thread's work at the balance point, per element
    phase = {o.threads: o.overlapped_s(balance, 1.0) / balance for o in options}
    kept = replace(
        placement,
        threads=chosen.threads,
        why=f"{placement.why}; with overlap on, one core left to the training thread: overlapped phase "
        f"{phase[chosen.threads]:.2f}x its work alone, {phase[threads]:.2f}x on {threads} threads (measured)",
    )
    torch.set_num_threads(chosen.threads)
    _say(kept, global_rank)
    return kept, measured[chosen.threads]
