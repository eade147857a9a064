"""Host cores and threads per rank: which cores each local rank is bound to, and how many threads it runs.

Host Adam and the 16-bit cast run on torch's intra-op threads. Launchers disagree on how many each rank
gets: ``torchrun`` sets ``OMP_NUM_THREADS=1`` (one core per rank), ``srun`` sets nothing (every rank uses
every core, and they oversubscribe), Lightning's launcher divides the cores but binds nothing. Here every
local rank gets ``usable cores // local ranks`` cores of its own, taken first from the NUMA node of its
accelerator where that can be read, and as many threads.

Pure functions on lists of CPU indices, plus small readers of Linux's sysfs (they return None or empty when
a file is missing). Knows nothing of Lightning.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SYS = Path("/sys")


@dataclass(frozen=True)
class HostPlacement:
    """Threads and cores of one rank.

    Attributes:
        threads: torch intra-op threads the rank runs with.
        cores: the logical CPUs the rank is bound to; None when its binding is left as launched.
        why: how the choice was made, in a few words (printed once per rank).
    """

    threads: int
    cores: tuple[int, ...] | None
    why: str


def parse_cpulist(text: str) -> list[int]:
    """CPU indices of a Linux cpulist such as ``"0-3,8,10-11"`` (empty text: none)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpulist(cpus: Sequence[int]) -> str:
    """The shortest cpulist of ``cpus`` (``[0, 1, 2, 5]`` -> ``"0-2,5"``)."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a PCI device (``0000:3b:00.0``), from CUDA's device properties."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def read_pci_numa_node(address: str, sys_root: Path = SYS) -> int | None:
    """NUMA node of a PCI device; None when unknown (no such file, or -1 on single-node machines)."""
    try:
        node = int((sys_root / "bus" / "pci" / "devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def read_numa_cpus(sys_root: Path = SYS) -> dict[int, list[int]]:
    """Logical CPUs of every NUMA node (empty when the machine does not say)."""
    nodes: dict[int, list[int]] = {}
    for path in sorted((sys_root / "devices" / "system" / "node").glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def read_physical_cores(cpus: Sequence[int], sys_root: Path = SYS) -> dict[int, Hashable]:
    """The physical core (package, core id) of each logical CPU, where sysfs says (SMT siblings share one)."""
    cores: dict[int, Hashable] = {}
    for cpu in cpus:
        topology = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        try:
            cores[cpu] = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            continue
    return cores


def split_cores(
    usable: Sequence[int],
    ranks: int,
    rank_nodes: Sequence[int | None] = (),
    node_cpus: Mapping[int, Sequence[int]] | None = None,
    physical_core: Mapping[int, Hashable] | None = None,
) -> list[list[int]]:
    """Disjoint sets of ``len(usable) // ranks`` CPUs, one per local rank (the remainder stays unused).

    Every rank computes the same split from the same inputs, so no communication is needed to keep them
    disjoint. A rank whose accelerator sits on a known NUMA node (``rank_nodes[r]``, with that node's CPUs
    in ``node_cpus``) takes its cores there first, in rank order; the others, and ranks whose node ran out,
    take the lowest free CPUs. SMT siblings (same ``physical_core``) are kept next to each other, so a rank
    gets whole cores where the count allows.

    Args:
        usable: the CPUs the ranks may use (their affinity).
        ranks: how many local ranks share them.
        rank_nodes: NUMA node of each local rank's accelerator, None where unknown (shorter: unknown).
        node_cpus: CPUs of each NUMA node.
        physical_core: physical core of each CPU, to keep SMT siblings together.

    Raises:
        ValueError: with fewer usable CPUs than ranks (no disjoint split exists).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    per_rank = len(usable) // ranks
    if per_rank < 1:
        raise ValueError(f"{len(usable)} usable CPU(s) cannot be split among {ranks} local ranks")
    physical_core = physical_core or {}
    # Siblings next to each other, physical cores in order of their first CPU.
    first_of: dict[Hashable, int] = {}
    for cpu in sorted(usable):
        first_of.setdefault(physical_core.get(cpu, ("cpu", cpu)), cpu)
    order = sorted(usable, key=lambda cpu: (first_of[physical_core.get(cpu, ("cpu", cpu))], cpu))
    free = dict.fromkeys(order)  # an ordered set
    split: list[list[int]] = [[] for _ in range(ranks)]
    node_cpus = node_cpus or {}
    for rank in range(ranks):
        node = rank_nodes[rank] if rank < len(rank_nodes) else None
        if node is None or node not in node_cpus:
            continue
        on_node = set(node_cpus[node])
        split[rank] = [cpu for cpu in free if cpu in on_node][:per_rank]
        for cpu in split[rank]:
            del free[cpu]
    for rank in range(ranks):
        need = per_rank - len(split[rank])
        taken = list(free)[:need]
        split[rank] += taken
        for cpu in taken:
            del free[cpu]
    return [sorted(cores) for cores in split]


def choose_host_placement(
    setting: int | str,
    local_rank: int,
    affinities: Sequence[Sequence[int]],
    rank_nodes: Sequence[int | None] = (),
    node_cpus: Mapping[int, Sequence[int]] | None = None,
    physical_core: Mapping[int, Hashable] | None = None,
) -> HostPlacement:
    """Threads and cores for one local rank.

    Args:
        setting: ``host_threads``: a positive number of threads (used as given, the binding left as launched)
            or ``"auto"``.
        local_rank: this rank's index among the ranks of its node.
        affinities: the CPUs each local rank may run on as launched, indexed by local rank.
        rank_nodes: NUMA node of each local rank's accelerator, None where unknown.
        node_cpus: CPUs of each NUMA node.
        physical_core: physical core of each CPU.

    With ``"auto"``: when the launcher already gave the local ranks disjoint CPUs (``srun --cpu-bind``,
    ``torchrun --numa-binding=exclusive``, ``numactl``), that binding is kept and each rank runs one thread
    per CPU it has; otherwise the CPUs all ranks may use are split with :func:`split_cores`.
    """
    own = sorted(affinities[local_rank])
    if not isinstance(setting, str):
        return HostPlacement(int(setting), None, "host_threads set explicitly")
    physical_core = physical_core or {}

    def threads_on(cpus: Sequence[int]) -> int:  # one per physical core: SMT siblings share its memory port
        return max(1, len({physical_core.get(cpu, ("cpu", cpu)) for cpu in cpus}))

    ranks = len(affinities)
    sets = [set(a) for a in affinities]
    if ranks > 1 and sum(len(s) for s in sets) == len(set().union(*sets)):
        return HostPlacement(threads_on(own), None, "auto: the launcher's binding, disjoint per rank, is kept")
    shared = sorted(set.intersection(*sets))
    if len(shared) < ranks:
        # No disjoint split: share what this rank may use, one thread per core it would get.
        return HostPlacement(
            max(1, threads_on(own) // ranks), None, f"auto: {len(shared)} CPU(s) shared by {ranks} local ranks"
        )
    cores = split_cores(shared, ranks, rank_nodes, node_cpus, physical_core)[local_rank]
    node = rank_nodes[local_rank] if local_rank < len(rank_nodes) else None
    where = f", accelerator on NUMA node {node}" if node is not None else ""
    why = f"auto: {len(shared)} usable CPU(s) // {ranks} local rank(s){where}"
    return HostPlacement(threads_on(cores), tuple(cores), why)


@dataclass(frozen=True)
class ThreadOption:
    """The host update on ``threads`` intra-op threads beside the training thread, as measured
    (:func:`lightning_dos.planning.calibrate.measure_contention`).

    Attributes:
        threads: the update's threads.
        host_s_per_element: the update's seconds per element alone on that many threads.
        host_speed: its rate beside the training thread, as a share of its rate alone.
        launch_speed: the training thread's rate beside it, as a share of its rate alone.
    """

    threads: int
    host_s_per_element: float
    host_speed: float
    launch_speed: float

    def overlapped_s(self, training_s: float, elements: float) -> float:
        """The overlapped phase: ``training_s`` of training-thread work (alone) beside the update of ``elements``,
        each slowed by the other, the longer of the two."""
        return max(training_s / self.launch_speed, elements * self.host_s_per_element / self.host_speed)


#: How much shorter (a share) the overlapped phase must be predicted with a core left to the training thread for
#: ``"auto"`` to leave it: less is within the noise of a measurement on a machine running other work.
LEAVE_CORE_MARGIN = 0.03


def choose_update_threads(
    options: Sequence[ThreadOption], training_s: float | None = None, elements: float = 1.0
) -> ThreadOption:
    """Of ``options`` (every thread count, or every core and one fewer), the one whose overlapped phase
    (:meth:`ThreadOption.overlapped_s`) is shortest; the most threads unless another is at least
    :data:`LEAVE_CORE_MARGIN` shorter.

    ``training_s``: the training thread's work beside the update of ``elements``; None takes the balance point,
    where that work alone lasts as long as the update alone on the most threads (the overlap is then tightest and
    each side's slowdown shows whole in the iteration; before forward and backward are measured it is the case
    overlap aims for: the update just hidden)."""
    if not options:
        raise ValueError("no thread count to choose from")
    most = max(options, key=lambda option: option.threads)
    if training_s is None:
        training_s = elements * most.host_s_per_element
    best = min(options, key=lambda option: (option.overlapped_s(training_s, elements), -option.threads))
    if best.overlapped_s(training_s, elements) < (1 - LEAVE_CORE_MARGIN) * most.overlapped_s(training_s, elements):
        return best
    return most


__all__ = [
    "HostPlacement",
    "ThreadOption",
    "choose_update_threads",
    "choose_host_placement",
    "format_cpulist",
    "parse_cpulist",
    "pci_address",
    "read_numa_cpus",
    "read_pci_numa_node",
    "read_physical_cores",
    "split_cores",
]
