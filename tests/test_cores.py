"""Host cores per rank: the split is disjoint, NUMA-local first, keeps SMT siblings together; applying it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_dos.host.cores import (
    HostPlacement,
    ThreadOption,
    choose_host_placement,
    choose_update_threads,
    format_cpulist,
    parse_cpulist,
    read_numa_cpus,
    read_pci_numa_node,
    read_physical_cores,
    split_cores,
)
from lightning_dos.host.host_threads import apply_host_threads, leave_training_core


def test_cpulists_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_split_is_disjoint_and_even() -> None:
    split = split_cores(list(range(18)), 4)
    assert split == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # 16, 17 stay free
    with pytest.raises(ValueError, match="cannot be split among 3"):
        split_cores([0, 1], 3)


def test_ranks_take_the_cores_of_their_accelerators_numa_node_first() -> None:
    nodes = {0: list(range(8)), 1: list(range(8, 16))}
    # GPUs 0 and 1 on node 1, GPUs 2 and 3 on node 0.
    split = split_cores(list(range(16)), 4, [1, 1, 0, 0], nodes)
    assert split == [[8, 9, 10, 11], [12, 13, 14, 15], [0, 1, 2, 3], [4, 5, 6, 7]]
    # Three ranks on a node with room for two: the third spills over to the other node's free cores.
    split = split_cores(list(range(16)), 4, [0, 0, 0, None], nodes)
    assert split[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and split[2] == [8, 9, 10, 11] and split[3] == [12, 13, 14, 15]


def test_smt_siblings_stay_with_the_same_rank() -> None:
    # Linux numbers the second hardware thread of core c as c + cores: (0, 4), (1, 5), ...
    physical = {cpu: (0, cpu % 4) for cpu in range(8)}
    split = split_cores(list(range(8)), 2, physical_core=physical)
    assert split == [[0, 1, 4, 5], [2, 3, 6, 7]]
    placement = choose_host_placement("auto", 1, [list(range(8))] * 2, physical_core=physical)
    assert placement == HostPlacement(2, (2, 3, 6, 7), placement.why), "one thread per physical core"


def test_auto_splits_shared_cpus_keeps_a_disjoint_launcher_binding_and_an_explicit_number_wins() -> None:
    shared = [[0, 1, 2, 3]] * 2
    assert choose_host_placement("auto", 1, shared).cores == (2, 3)
    assert choose_host_placement("auto", 1, shared).threads == 2
    bound = choose_host_placement("auto", 1, [[0, 1, 2], [3, 4, 5]])
    assert bound.cores is None and bound.threads == 3 and "launcher" in bound.why
    crowded = choose_host_placement("auto", 2, [[0, 1]] * 3)
    assert crowded.cores is None and crowded.threads == 1
    explicit = choose_host_placement(6, 0, shared)
    assert explicit == HostPlacement(6, None, "host_threads set explicitly")


def test_sysfs_readers(tmp_path: Path) -> None:
    pci = tmp_path / "bus" / "pci" / "devices"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0" / "numa_node").write_text("1\n")
    (pci / "0000:af:00.0").mkdir()
    (pci / "0000:af:00.0" / "numa_node").write_text("-1\n")
    assert read_pci_numa_node("0000:3b:00.0", tmp_path) == 1
    assert read_pci_numa_node("0000:af:00.0", tmp_path) is None  # single-node machines say -1
    assert read_pci_numa_node("0000:00:00.0", tmp_path) is None
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(cpus)
    assert read_numa_cpus(tmp_path) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    topology = tmp_path / "devices" / "system" / "cpu" / "cpu5" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text("1")
    (topology / "core_id").write_text("2")
    assert read_physical_cores([5, 6], tmp_path) == {5: (1, 2)}


def test_applying_in_one_process_sets_threads_binds_and_prints_once(capsys: pytest.CaptureFixture) -> None:
    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        explicit = apply_host_threads(1, 0, 0, torch.device("cpu"))
        assert explicit.cores is None and torch.get_num_threads() == 1
        auto = apply_host_threads("auto", 0, 0, torch.device("cpu"))
        assert auto.cores == tuple(sorted(before_cpus)), "a single local rank keeps every usable CPU"
        assert torch.get_num_threads() == auto.threads >= 1
        apply_host_threads("auto", 0, 0, torch.device("cpu"))  # the same choice again: nothing printed
        lines = capsys.readouterr().out.splitlines()  # a reason too wide for the console has a line of its own
        assert all(line.startswith("[rank 0] ") for line in lines), lines
        assert len([line for line in lines if line.startswith("[rank 0] host threads: ")]) == 2, lines
    finally:
        torch.set_num_threads(before_threads)
        os.sched_setaffinity(0, before_cpus)


def test_a_core_is_left_to_the_training_thread_when_the_measured_overlap_is_shorter_so() -> None:
    """At the balance point (the training thread's work alone as long as the update alone on every core), each
    option's phase is the longer of the two sides, each slowed by the other."""
    # Hooks starved by the update's threads (0.5 of their rate); memory-bound update, barely slower on one core less.
    crowded = ThreadOption(2, 1.0e-9, 0.9, 0.5)
    freed = ThreadOption(1, 1.1e-9, 0.95, 0.97)
    assert crowded.overlapped_s(1.0, 1e9) == pytest.approx(2.0)
    assert freed.overlapped_s(1.0, 1e9) == pytest.approx(1.1e-9 * 1e9 / 0.95)
    assert choose_update_threads([crowded, freed]) == freed
    # A compute-bound update that one core less slows by half: the hooks' share does not pay for it.
    halved = ThreadOption(1, 2.0e-9, 0.95, 1.0)
    assert choose_update_threads([crowded, halved]) == crowded
    # Within the margin the update keeps every core; with a longer training thread's work one core less wins.
    close = ThreadOption(1, 1.0e-9, 0.51, 1.0)  # 1.96 against 2.0: 2% shorter
    assert choose_update_threads([crowded, close]) == crowded
    assert choose_update_threads([crowded, halved], training_s=10.0, elements=1e9) == halved
    with pytest.raises(ValueError, match="no thread count"):
        choose_update_threads([])


def test_with_overlap_auto_keeps_every_core_or_leaves_one_as_measured_and_says_so(
    capsys: pytest.CaptureFixture,
) -> None:
    """Measured for real on this machine's cores (as an accelerator's training thread would be: its forward and
    backward off torch's host threads): the count kept is in force and said; with one thread there is nothing to
    leave, which is said too. On a CPU device, whose forward runs on those threads, every core is kept."""
    before = torch.get_num_threads()
    device, size = torch.device("cpu"), {"numel": 1 << 21, "sub_group": 1 << 19}
    try:
        two = HostPlacement(2, None, "auto: test")
        assert leave_training_core(two, 0, device, **size)[0] == two
        one = HostPlacement(1, None, "auto: test")
        kept, contention = leave_training_core(one, 0, device, **size, forward_on_host_threads=False)
        assert kept.threads == contention.threads == 1 and "none left to the training thread" in kept.why
        kept, contention = leave_training_core(two, 0, device, **size, forward_on_host_threads=False)
        assert kept.threads == contention.threads == torch.get_num_threads() in (1, 2)
        assert (kept == two) == (kept.threads == 2) and (kept.threads == 2 or "one core left" in kept.why)
        out = capsys.readouterr().out
        assert "none left to the training thread" in out
    finally:
        torch.set_num_threads(before)
