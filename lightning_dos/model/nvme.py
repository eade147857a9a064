"""The NVMe tier of the performance model: an update whose optimizer state does not all fit in host memory.

A sub-group whose master weights and states (``footprint.optimizer_state`` bytes per element) live in a file is
read into one of a bounded number of host staging slabs before its update (on the CPU, or streamed through the
device as :mod:`lightning_dos.model.perfmodel` models it), and written back after; the slab is free again once
the write is done. The disk is one queue shared by reads and writes (an NVMe drive's bandwidth is shared by
both directions), and by every rank of the node (:meth:`DiskRates.per_rank`). A write ready at the time the disk
picks its next operation goes first: it frees a slab. The sub-groups kept in host slabs (the host budget) need
no disk at all.

The same account gives stock ZeRO-3 NVMe offload (DeepSpeed's pipelined optimizer swapper, ``pipeline_read`` and
``pipeline_write`` on): every sub-group's state in a file, its gradient too, a few sub-groups in flight, each
sub-group's CPU update followed by its cast and a blocking upload of the 16-bit result
(:func:`stock_tiered_update_s`).

Between iterations the order of the file-backed sub-groups can alternate (MLP-Offload's cache-friendly order):
the last ones written are still in their slabs when the next update starts with them, so their reads are
skipped (``cached``); or stay forwards, the order the next forward needs them in (:func:`choose_files_order`
picks). Predictions, not measurements; knows nothing of Lightning, DeepSpeed or files.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_dos.model.iteration import forward_beside_update_s
from lightning_dos.model.overlap import OFF
from lightning_dos.model.perfmodel import HardwareRates, link_seconds, rates_for
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAM_FP32, Footprint

#: Sub-groups stock's pipelined swapper holds in flight: ``offload_optimizer.buffer_count`` counts one buffer per
#: tensor (master weights, two moments, gradient), and it runs only from 16 (4 sub-groups) with pipelining on; its
#: default, 4, runs out of buffers at the first step (bench/RESULTS.md, 2026-11-27).
STOCK_SLOTS = 4
#: The orders the file-backed host sub-groups can be taken in, iteration after iteration (:func:`files_update`).
ALTERNATE, FORWARD = "alternate", "forward"
ORDERS = (ALTERNATE, FORWARD)
#: The fewest staging slabs ours moves file-backed records through (each the size of the largest sub-group's
#: state): one being updated in, the next read ahead, the last written back, one spare for the alternating order.
STAGING_SLOTS = 4
#: Bytes the staging slabs hold together, at least (as many slabs as that takes): a drive moves its bytes in flight
#: per latency, so small records need more slabs to keep it busy. On this project's CPU machine's disk
#: (bench/RESULTS.md, 2026-11-27), reading and writing 16 records of 19 MB through 4 slabs moved 1.3-1.5 GB/s, through
#: 8 (153 MB) 2.1-2.4 GB/s, and 38 or 76 MB records with 153 MB in flight the same 2.2-2.5: the bytes in flight, not
#: the request size, set it.
IN_FLIGHT_BYTES = 128 << 20
#: The most staging slabs: past this the slabs' host memory buys the drive nothing more.
MAX_STAGING_SLOTS = 16


def staging_slots(record_bytes: int, records: int | None = None) -> int:
    """How many staging slabs of ``record_bytes`` each the NVMe tier moves its ``records`` file-backed records
    through: enough to hold :data:`IN_FLIGHT_BYTES`, from :data:`STAGING_SLOTS` to :data:`MAX_STAGING_SLOTS` (4 for
    any record of 32 MiB or more: a sub-group of 2.8M fp32 Adam elements), and above 4 no more than half the records,
    so that the slabs never become a second host tier (a slab keeps its record: with as many slabs as records,
    none would cross the drive). ``records`` None: the most it can be, for any number of records."""
    if record_bytes <= 0:
        raise ValueError(f"record_bytes must be positive, got {record_bytes}")
    wanted = min(MAX_STAGING_SLOTS, -(-IN_FLIGHT_BYTES // record_bytes))
    return max(STAGING_SLOTS, wanted if records is None else min(wanted, records // 2))


@dataclass(frozen=True)
class DiskRates:
    """What the node's NVMe drive (or array) under ``nvme_path`` does, bytes/s, all ranks together.

    Attributes:
        read_bps: sequential O_DIRECT read bandwidth.
        write_bps: sequential O_DIRECT write bandwidth.
    """

    read_bps: float
    write_bps: float

    def __post_init__(self) -> None:
        for name in ("read_bps", "write_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"disk {name} must be positive, got {getattr(self, name)}")

    def per_rank(self, ranks: int) -> DiskRates:
        """The share of one of ``ranks`` ranks that read and write the drive at once."""
        return DiskRates(self.read_bps / ranks, self.write_bps / ranks)

    def floor_s(self, read_bytes: float, write_bytes: float) -> float:
        """The least time the drive needs for these bytes: reads and writes share it."""
        return read_bytes / self.read_bps + write_bytes / self.write_bps


@dataclass(frozen=True)
class TieredPrediction:
    """The model's account of an update with a file-backed tier.

    Attributes:
        time_s: predicted update time, from the first read to the last write.
        read_bytes: bytes read from the drive.
        write_bytes: bytes written to it.
        disk_s: time the drive is busy (the disk-bandwidth floor of this update).
        host_s: time the CPU is busy.
        slots: staging slabs used.
        land_s: per sub-group, when its 16-bit result is in place for the next forward (a host sub-group's upload
            done, a device one's cast), from the update's start.
    """

    time_s: float
    read_bytes: int
    write_bytes: int
    disk_s: float
    host_s: float
    slots: int
    land_s: tuple[float, ...] = ()


def nvme_sub_groups(sizes: Sequence[int], host_budget_bytes: float, footprint: Footprint) -> list[int]:
    """The sub-groups whose state goes to files when the host slabs may hold ``host_budget_bytes`` of it, as the
    engine picks them (``InterleavedUpdate.first_file_backed``): counted from the first, every sub-group past the
    first that does not fit, a contiguous tail of the slabs. The first ones the update takes need no read, and the
    drive's reads run beside them."""
    held = 0.0
    for i, size in enumerate(sizes):
        held += size * footprint.optimizer_state
        if held > host_budget_bytes:
            return list(range(i, len(sizes)))
    return []


def tiered_plan(plan: Plan, on_nvme: Collection[int]) -> Plan:
    """``plan`` as the engine runs it with ``on_nvme`` in files: a file-backed sub-group planned resident is streamed
    (its state lives in its file between updates, not on the device)."""
    files = set(on_nvme)
    places = tuple(Place.DEVICE if i in files and p is Place.RESIDENT else p for i, p in enumerate(plan.places))
    return replace(plan, places=places)


def host_order(plan: Plan, on_nvme: Collection[int], backwards: bool, held: Collection[int] = ()) -> list[int]:
    """The order the engine's CPU takes ``plan``'s host sub-groups in: those in host slabs in the plan's order, and
    the file-backed ones after them, ``backwards`` every other step (MLP-Offload's cache-friendly order).

    ``held``: records the staging slabs hold when the update starts. The file-backed ones this order takes first and
    finds ``held`` go before the host-slab ones: they wait for no read, and their write-backs free the slabs the next
    reads land in, so the drive works while the CPU updates the host-slab ones instead of waiting for them (in the
    order that alternates, the step begins with those; in forward order they are the last needed, and nothing
    moves)."""
    files = set(on_nvme)
    kept = [i for i in plan.host_indices if i not in files]
    filed = [i for i in plan.host_indices if i in files]
    filed = filed[::-1] if backwards else filed
    ready = 0
    while ready < len(filed) and filed[ready] in held:
        ready += 1
    return filed[:ready] + kept + filed[ready:]


def kept_unwritten(
    host_order: Sequence[int], on_nvme: Collection[int], slots: int, order: str, streamed: Collection[int] = ()
) -> list[int]:
    """The file-backed host sub-groups whose write-backs an update in ``order`` puts off, as the engine does
    (``FileTier.begin``'s ``keep``): in :data:`ALTERNATE`, the last ones of ``host_order`` it takes, one fewer than
    the ``slots`` staging slabs (one stays free for a record moved otherwise: a reader's); they stay in their slabs,
    and the next update, which takes them first, updates them again and writes them back once. None in
    :data:`FORWARD` (the next update needs them last, and their slabs before), nor when file-backed sub-groups are
    ``streamed`` to the device: the next update reads those first and needs the slabs for it (the simulated 70B node
    streamed its first ones a slab at a time behind three kept records, 1% slower)."""
    if order != ALTERNATE or slots < 2 or any(i in on_nvme for i in streamed):
        return []
    files = [i for i in host_order if i in on_nvme]
    return files[max(0, len(files) - (slots - 1)) :]


def predict_tiered(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    disk: DiskRates,
    on_nvme: Collection[int],
    *,
    lp_bytes: int = 2,
    slots: int = 4,
    cached: Collection[int] = (),
    footprint: Footprint = ADAM_FP32,
    host_s_per_element: float | None = None,
    serial_upload: bool = False,
    host_order: Sequence[int] | None = None,
    gradient_in_files: bool = False,
    unwritten: Collection[int] = (),
) -> TieredPrediction:
    """Predict the update of ``plan`` when the sub-groups ``on_nvme`` keep their state in files on ``disk``
    (one rank's share), through ``slots`` host staging slabs.

    The engine's order: device sub-groups first (the device pipeline of :func:`perfmodel.predict`, each streamed
    one uploaded once its read has landed), then the host ones in the plan's order, each waiting for its read.
    ``cached``: file-backed sub-groups already in a slab when the update starts (the cache-friendly order), read
    from nowhere; each holds its slab from the start until its write-back is done, as the engine keeps it.
    ``host_s_per_element``: CPU seconds per element (default: the update and the cast at ``rates``);
    ``serial_upload``: each host sub-group's 16-bit upload blocks the CPU (stock's swapper); ``host_order``: the
    order the CPU takes its sub-groups in (default: the plan's); ``gradient_in_files``: a file-backed sub-group's
    gradient is read from its file too (``footprint.master`` bytes per element more; stock writes it there during
    backward); ``unwritten``: file-backed host sub-groups whose write-back is put off to the next update
    (:func:`kept_unwritten`), their slabs held to the end.
    """
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    rates = rates_for(rates, footprint)
    state = footprint.optimizer_state
    on_nvme = set(on_nvme)
    cached = [i for i in dict.fromkeys(cached) if i in on_nvme]
    if len(cached) > slots:
        raise ValueError(f"{len(cached)} cached records do not fit {slots} staging slabs")
    per_element = rates.host_s_per_element if host_s_per_element is None else host_s_per_element
    streaming = bool(plan.streamed_indices)
    up = rates.duplex_h2d_bps if streaming else rates.h2d_bps
    down = rates.duplex_d2h_bps if streaming else rates.d2h_bps

    disk_free = 0.0
    disk_busy = 0.0
    # A cached record's slab is its own until its write-back is done: no read goes through it before.
    slot_free = [float("inf")] * len(cached) + [0.0] * (slots - len(cached))
    cached_slot = {index: slot for slot, index in enumerate(cached)}
    writes: list[tuple[float, int, int]] = []  # (ready time, bytes, slot) not yet given to the drive
    read_bytes = write_bytes = 0

    def write(ready: float, nbytes: int, slot: int) -> None:
        nonlocal disk_free, disk_busy, write_bytes
        start = max(disk_free, ready)
        disk_free = start + nbytes / disk.write_bps
        disk_busy += nbytes / disk.write_bps
        slot_free[slot] = disk_free
        write_bytes += nbytes

    def read(i: int) -> tuple[float, int]:
        """Bring sub-group i into a slab: when it is there, and the slab."""
        nonlocal disk_free, disk_busy, read_bytes
        if i in cached_slot:
            return 0.0, cached_slot[i]
        while True:  # a write ready by the time this read could start goes first: it frees a slab
            slot = min(range(slots), key=slot_free.__getitem__)
            writes.sort()
            if not writes or writes[0][0] > max(disk_free, slot_free[slot]):
                break
            write(*writes.pop(0))
        if slot_free[slot] == float("inf"):
            raise ValueError(f"{slots} staging slabs are all held: too few for the sub-groups already in them")
        start = max(disk_free, slot_free[slot])
        nbytes = sizes[i] * (state + (footprint.master if gradient_in_files else 0))
        disk_free = start + nbytes / disk.read_bps
        disk_busy += nbytes / disk.read_bps
        read_bytes += nbytes
        slot_free[slot] = float("inf")  # held until its write is done
        return disk_free, slot

    h2d_free = compute_free = d2h_free = 0.0
    h2d_bytes = sum(footprint.resident_up * sizes[i] for i in plan.resident_indices)
    h2d_bytes += sum(footprint.streamed_up * sizes[i] for i in plan.streamed_indices)
    d2h_bytes = sum(footprint.streamed_down * sizes[i] for i in plan.streamed_indices)
    if not rates.shared_cpu:
        h2d_bytes += sum(lp_bytes * sizes[i] for i in plan.host_indices)
    land = [0.0] * len(sizes)
    for i in plan.resident_indices:
        h2d_free += footprint.resident_up * sizes[i] / up
        land[i] = compute_free = max(compute_free, h2d_free) + sizes[i] / rates.device_adam_eps
    device_slots = [0.0] * max(1, plan.device_buffers)
    for j, i in enumerate(plan.streamed_indices):
        landed, slot = read(i) if i in on_nvme else (0.0, -1)
        k = j % len(device_slots)
        h2d_free = max(h2d_free, device_slots[k], landed) + footprint.streamed_up * sizes[i] / up
        land[i] = compute_free = max(compute_free, h2d_free) + sizes[i] / rates.device_adam_eps
        d2h_free = device_slots[k] = max(d2h_free, compute_free) + footprint.streamed_down * sizes[i] / down
        if slot >= 0:
            writes.append((d2h_free, sizes[i] * state, slot))
    cpu_free = host_s = link_free = 0.0
    host_indices = plan.host_indices if host_order is None else list(host_order)
    if sorted(host_indices) != sorted(plan.host_indices):
        raise ValueError("host_order must list the plan's host sub-groups, each once")
    for i in host_indices:
        landed, slot = read(i) if i in on_nvme else (0.0, -1)
        work = sizes[i] * per_element
        cpu_free = max(cpu_free, landed) + work
        host_s += work
        upload = lp_bytes * sizes[i] / up
        land[i] = cpu_free
        if serial_upload:
            land[i] = cpu_free = cpu_free + upload
        elif not rates.shared_cpu:
            land[i] = link_free = max(link_free, cpu_free) + upload
        if slot >= 0 and i not in unwritten:
            writes.append((cpu_free, sizes[i] * state, slot))
    for pending in sorted(writes):
        write(*pending)
    # Host uploads and device uploads share the link: it needs at least all the bytes' worth of time (as in
    # perfmodel.predict, which this is with no file-backed sub-group).
    link = 0.0 if rates.shared_cpu else link_seconds(h2d_bytes, d2h_bytes, rates)
    if rates.shared_cpu:  # the "device" is the CPU: its work and the host's add up
        cpu_free += max(h2d_free, compute_free, d2h_free)
    end = max(disk_free, cpu_free, link_free, link, h2d_free, compute_free, d2h_free)
    return TieredPrediction(end, read_bytes, write_bytes, disk_busy, host_s, slots, tuple(land))


def stock_tiered_update_s(
    sizes: Sequence[int],
    rates: HardwareRates,
    disk: DiskRates,
    *,
    lp_bytes: int = 2,
    slots: int = STOCK_SLOTS,
    footprint: Footprint = ADAM_FP32,
) -> TieredPrediction:
    """Stock ZeRO-3 NVMe offload with DeepSpeed's pipelined swapper: every sub-group's state in a file, read
    ahead into ``slots`` sub-groups' buffers and written back behind the CPU; each sub-group's CPU update followed by
    its cast and a blocking 16-bit upload, no device update (a host budget changes nothing: stock keeps no
    optimizer state in host memory beyond its buffers). DeepSpeed also swaps each sub-group's fp32 gradient out to
    its file during backward and reads it back for the update (seen in its swap directory, bench/RESULTS.md): the
    update reads ``footprint.master`` bytes per element more than it writes."""
    plan = Plan(tuple(Place.HOST for _ in sizes))
    return predict_tiered(
        sizes,
        plan,
        rates,
        disk,
        range(len(sizes)),
        lp_bytes=lp_bytes,
        slots=slots,
        footprint=footprint,
        serial_upload=True,
        gradient_in_files=True,
    )


def slab_hits(held: Sequence[int], needed: Sequence[int], slots: int) -> list[int]:
    """Which of the records ``needed`` (in the update's order) are found in the ``slots`` staging slabs, which hold
    ``held`` when the update starts, as the engine's slabs are used (``FileTier``): a record once used is not needed
    again, so its slab is free; a read takes a free slab, else evicts the record needed furthest ahead (Belady's
    choice); a read ahead never evicts a record still needed."""
    if len(held) > slots:
        raise ValueError(f"{len(held)} records held in {slots} slabs")
    slabs: list[int | None] = [*held, *[None] * (slots - len(held))]
    hits = []
    for k, index in enumerate(needed):
        if index in slabs:
            hits.append(index)
            slabs[slabs.index(index)] = None
        elif None not in slabs:
            ahead = list(needed[k:])
            furthest = max(slabs, key=lambda r: ahead.index(r) if r in ahead else len(ahead))
            slabs[slabs.index(furthest)] = None
    return hits


def tiered_update(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    disk: DiskRates,
    host_budget_bytes: float,
    *,
    footprint: Footprint = ADAM_FP32,
    **options: Any,  # files_update's keywords: their defaults are kept there alone
) -> TieredPrediction:
    """A steady-state update of ``plan`` with ``host_budget_bytes`` of optimizer state in host slabs and the rest in
    files (:func:`nvme_sub_groups`): :func:`files_update`, with its keyword ``options`` (``order``, ``backwards``,
    ``lp_bytes``, ``slots``)."""
    on_nvme = nvme_sub_groups(sizes, host_budget_bytes, footprint)
    return files_update(sizes, plan, rates, disk, on_nvme, footprint=footprint, **options)


def files_update(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    disk: DiskRates,
    on_nvme: Sequence[int],
    *,
    order: str = ALTERNATE,
    backwards: bool = True,
    lp_bytes: int = 2,
    slots: int = STAGING_SLOTS,
    footprint: Footprint = ADAM_FP32,
) -> TieredPrediction:
    """A steady-state update of ``plan`` with the sub-groups ``on_nvme`` in files, as the engine runs it
    (:func:`tiered_plan`, :func:`host_order`), in the file-backed host sub-groups' ``order``:

    - :data:`ALTERNATE`: reversed every other iteration, so that an update starts with the file-backed sub-groups
      the previous one wrote last, still in their slabs (MLP-Offload's cache-friendly order); ``backwards``: this
      update is one that takes them backwards (after one that took them forwards), else the one after it;
    - :data:`FORWARD`: the partition's order every iteration (the next forward needs them in it); only the records
      the slabs keep until the update needs them are not read (:func:`slab_hits`).
    """
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(ORDERS)}")
    backwards = backwards and order == ALTERNATE
    previously_backwards = order == ALTERNATE and not backwards
    plan = tiered_plan(plan, on_nvme)
    files = set(on_nvme)
    streamed = [i for i in plan.streamed_indices if i in files]
    # The previous iteration wrote its streamed file-backed sub-groups back first (each as its download landed, or
    # when a slab was needed: all before its file-backed host sub-groups took theirs), then those in its own order:
    # the last records it wrote are still in the slabs.
    before = streamed + [i for i in host_order(plan, on_nvme, backwards=previously_backwards) if i in files]
    taken = host_order(plan, on_nvme, backwards=backwards, held=before[-slots:])
    cached = slab_hits(before[-slots:], streamed + [i for i in taken if i in files], slots)
    # In the alternating order the last records taken stay in their slabs unwritten: the next update writes them.
    unwritten = kept_unwritten(taken, files, slots, order, streamed)
    return predict_tiered(
        sizes,
        plan,
        rates,
        disk,
        on_nvme,
        lp_bytes=lp_bytes,
        slots=slots,
        cached=cached,
        footprint=footprint,
        host_order=taken,
        unwritten=unwritten,
    )


@dataclass(frozen=True)
class OrderChoice:
    """Which order the file-backed host sub-groups are taken in, and why.

    Attributes:
        order: :data:`ALTERNATE` or :data:`FORWARD`, whichever predicts the shorter time.
        alternate_s: the mean over the two updates of the alternation (backwards, then forwards) of the time
            compared: the iteration when the next forward runs beside the update, else the update.
        forward_s: the same with the file-backed sub-groups taken forwards every iteration.
    """

    order: str
    alternate_s: float
    forward_s: float


def choose_files_order(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    disk: DiskRates,
    on_nvme: Sequence[int],
    *,
    phases: tuple[float, float] | None = None,
    overlap: str = OFF,
    lp_bytes: int = 2,
    slots: int = STAGING_SLOTS,
    footprint: Footprint = ADAM_FP32,
) -> OrderChoice:
    """The file-backed sub-groups' order the planner runs: :data:`ALTERNATE` skips the reads of the records the slabs
    still hold, but every other update takes the file-backed sub-groups backwards, so the first of them the next
    forward needs lands last; :data:`FORWARD` reads more (the records the slabs kept are the last it needs, and hold
    their slabs till then) and lands them in the order the forward needs them. With the update alone (``overlap``
    off, or ``phases`` not measured yet) the shorter update wins; when the next forward runs beside the update
    (``phases``: forward and backward seconds), the shorter iteration
    (:func:`~lightning_dos.model.iteration.forward_beside_update_s`). The host updates ``overlap="auto"`` runs during
    backward are left out of both: the file-backed sub-groups are not among them, and the rest come first in either
    order."""
    kwargs = {"lp_bytes": lp_bytes, "slots": slots, "footprint": footprint}
    steps = {
        ALTERNATE: [files_update(sizes, plan, rates, disk, on_nvme, backwards=b, **kwargs) for b in (True, False)],
        FORWARD: [files_update(sizes, plan, rates, disk, on_nvme, order=FORWARD, **kwargs)],
    }

    def seconds(update: TieredPrediction) -> float:
        if phases is None or overlap == OFF:
            return update.time_s
        forward_s, backward_s = phases
        return backward_s + forward_beside_update_s(sizes, update.land_s, forward_s, update.time_s)

    mean = {order: sum(map(seconds, updates)) / len(updates) for order, updates in steps.items()}
    order = ALTERNATE if mean[ALTERNATE] <= mean[FORWARD] else FORWARD
    return OrderChoice(order, mean[ALTERNATE], mean[FORWARD])
