"""The NVMe tier of the performance model (lightning_dos/model/nvme.py): pure arithmetic, no files."""

from __future__ import annotations

import json
import random

import pytest

from lightning_dos.commands.main import main
from lightning_dos.model.nvme import (
    ALTERNATE,
    FORWARD,
    DiskRates,
    choose_files_order,
    files_update,
    host_order,
    kept_unwritten,
    nvme_sub_groups,
    predict_tiered,
    slab_hits,
    staging_slots,
    stock_tiered_update_s,
    tiered_plan,
    tiered_update,
)
from lightning_dos.model.perfmodel import predict
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAM_FP32
from lightning_dos.planning.profiles import load_profile, save_profile

RATES, META = load_profile("paper-h100x4")
RANKS = 4
#: 70B over four ranks in DeepSpeed's default sub-groups of 1e9 elements; a drive of 25 GB/s reads and 10 writes.
ELEMENTS = int(70e9) // RANKS
SIZES = [int(1e9)] * (ELEMENTS // int(1e9)) + [ELEMENTS % int(1e9)]
DISK = DiskRates(25e9, 10e9).per_rank(RANKS)
STATE = ELEMENTS * ADAM_FP32.optimizer_state


def random_plan(rng: random.Random) -> tuple[list[int], Plan]:
    sizes = [rng.randint(1, 10**6) for _ in range(rng.randint(1, 20))]
    return sizes, Plan(tuple(rng.choice(list(Place)) for _ in sizes), device_buffers=rng.randint(1, 3))


def test_with_nothing_in_files_it_is_the_two_tier_model() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes, plan = random_plan(rng)
        expected = predict(sizes, plan, RATES, 2).time_s
        assert predict_tiered(sizes, plan, RATES, DISK, []).time_s == pytest.approx(expected, rel=1e-12)


def test_the_drive_moves_each_file_backed_sub_group_once_each_way_and_bounds_the_time() -> None:
    rng = random.Random(1)
    for _ in range(200):
        sizes, plan = random_plan(rng)
        candidates = [i for i in range(len(sizes)) if plan.places[i] is not Place.RESIDENT]
        on_nvme = rng.sample(candidates, rng.randint(0, len(candidates)))
        slots = rng.randint(1, 4)
        disk = DiskRates(rng.uniform(1e8, 1e10), rng.uniform(1e8, 1e10))
        got = predict_tiered(sizes, plan, RATES, disk, on_nvme, slots=slots)
        moved = sum(sizes[i] for i in on_nvme) * ADAM_FP32.optimizer_state
        assert got.read_bytes == got.write_bytes == moved
        assert got.disk_s == pytest.approx(disk.floor_s(moved, moved))
        # Never faster than the drive, nor than the same plan with everything in host memory.
        assert got.time_s >= got.disk_s * (1 - 1e-12)
        assert got.time_s >= predict(sizes, plan, RATES, 2).time_s * (1 - 1e-12)


def test_a_host_budget_keeps_the_first_sub_groups_and_a_resident_one_in_files_is_streamed() -> None:
    sizes = [10, 10, 10, 10]
    plan = Plan((Place.HOST, Place.RESIDENT, Place.DEVICE, Place.HOST))
    state = ADAM_FP32.optimizer_state
    assert nvme_sub_groups(sizes, 0, ADAM_FP32) == [0, 1, 2, 3]
    assert nvme_sub_groups(sizes, 2 * 10 * state, ADAM_FP32) == [2, 3]
    assert nvme_sub_groups(sizes, 4 * 10 * state, ADAM_FP32) == []
    assert tiered_plan(plan, [1, 2, 3]).places == (Place.HOST, Place.DEVICE, Place.DEVICE, Place.HOST)
    assert tiered_plan(plan, [2, 3]) == plan
    # Those in host slabs first; the file-backed ones backwards every other step.
    all_host = Plan(tuple(Place.HOST for _ in range(5)))
    assert host_order(all_host, [2, 3, 4], backwards=True) == [0, 1, 4, 3, 2]
    assert host_order(all_host, [2, 3, 4], backwards=False) == [0, 1, 2, 3, 4]
    # The file-backed ones the slabs hold that the order takes first go before the host-slab ones; held ones it
    # takes later (forward order after a forward step) stay where they are.
    assert host_order(all_host, [2, 3, 4], backwards=True, held=[4, 3]) == [4, 3, 0, 1, 2]
    assert host_order(all_host, [2, 3, 4], backwards=True, held=[3]) == [0, 1, 4, 3, 2]
    assert host_order(all_host, [2, 3, 4], backwards=False, held=[3, 4]) == [0, 1, 2, 3, 4]


def test_ours_against_stocks_pipelined_swapper_at_70b_on_the_papers_node() -> None:
    """Stock reads and writes every sub-group whatever the host memory; ours keeps the budget's share in host
    slabs. Both run at the drive's pace (within 1.25x of the disk-bandwidth floor)."""
    stock = stock_tiered_update_s(SIZES, RATES, DISK)
    # Stock reads each sub-group's gradient back from its file too (DeepSpeed swaps it out during backward).
    assert stock.write_bytes == STATE and stock.read_bytes == STATE + ELEMENTS * ADAM_FP32.master
    assert stock.time_s <= 1.25 * stock.disk_s
    plan = Plan(tuple(Place.DEVICE if i % 2 == 0 else Place.HOST for i in range(len(SIZES))))
    ratios = {}
    for share in (0.0, 0.25, 0.5):
        ours = tiered_update(SIZES, plan, RATES, DISK, share * STATE)
        assert ours.time_s <= 1.25 * ours.disk_s
        ratios[share] = stock.time_s / ours.time_s
    assert ratios[0.0] >= 1.0 and ratios[0.5] >= 1.6 and ratios[0.0] < ratios[0.25] < ratios[0.5]


def test_the_alternating_order_skips_the_reads_of_what_the_slabs_still_hold() -> None:
    plan = Plan(tuple(Place.HOST for _ in SIZES))
    forward = tiered_update(SIZES, plan, RATES, DISK, 0, order=FORWARD)
    alternating = tiered_update(SIZES, plan, RATES, DISK, 0, order=ALTERNATE, backwards=True, slots=4)
    # The reversed order starts with the last four sub-groups: the previous update wrote them last. Taken forwards
    # again, the first read evicts the one needed last (Belady's choice) and the other three wait in their slabs.
    state = sum(SIZES) * ADAM_FP32.optimizer_state
    assert alternating.read_bytes == state - sum(SIZES[-4:]) * ADAM_FP32.optimizer_state
    assert forward.read_bytes == state - sum(SIZES[-4:-1]) * ADAM_FP32.optimizer_state
    # Every record is written back taken forwards; taken backwards, the last three (one fewer than the slabs: the
    # first three of the partition) stay in their slabs unwritten, for the next update, which takes them first.
    assert forward.write_bytes == state
    assert alternating.write_bytes == state - sum(SIZES[:3]) * ADAM_FP32.optimizer_state
    assert alternating.time_s < forward.time_s


def test_the_alternating_order_keeps_the_last_records_unwritten_one_fewer_than_the_slabs() -> None:
    order = [0, 1, 7, 6, 5, 4, 3]  # host-slab sub-groups 0 and 1, then the file-backed ones backwards
    assert kept_unwritten(order, range(3, 8), slots=4, order=ALTERNATE) == [5, 4, 3]
    assert kept_unwritten(order, range(3, 8), slots=4, order=FORWARD) == []
    assert kept_unwritten(order, range(3, 8), slots=1, order=ALTERNATE) == []  # the one slab stays free
    assert kept_unwritten(order, [6], slots=4, order=ALTERNATE) == [6]
    # A file-backed sub-group streamed to the device: the next update reads it first, through the slabs; one that
    # keeps its state in host memory does not count.
    assert kept_unwritten(order, range(3, 9), slots=4, order=ALTERNATE, streamed=[2, 8]) == []
    assert kept_unwritten(order, range(3, 8), slots=4, order=ALTERNATE, streamed=[2]) == [5, 4, 3]


def test_the_planner_alternates_unless_the_model_finds_forwards_faster() -> None:
    plan = Plan(tuple(Place.HOST for _ in SIZES))
    everything = nvme_sub_groups(SIZES, 0, ADAM_FP32)
    # All in files, the update alone: the alternation skips a read every update, and wins.
    alone = choose_files_order(SIZES, plan, RATES, DISK, everything)
    assert alone.order == ALTERNATE and alone.alternate_s < alone.forward_s
    # The next forward beside the update (60 s, backward 120 s): taken backwards, the first file-backed sub-group the
    # forward needs lands last every other iteration; forwards, the forward follows the update: a shorter iteration.
    beside = choose_files_order(SIZES, plan, RATES, DISK, everything, phases=(60.0, 120.0), overlap="forward")
    assert beside.order == FORWARD and beside.forward_s < beside.alternate_s
    # The iteration it compares is at least backward + forward, and at least backward + the update.
    update = files_update(SIZES, plan, RATES, DISK, everything, order=FORWARD)
    assert beside.forward_s >= 120.0 + max(60.0, update.time_s) - 1e-9
    # With overlap off the phases change nothing: the update alone decides.
    assert choose_files_order(SIZES, plan, RATES, DISK, everything, phases=(60.0, 120.0)) == alone
    # Taken forwards again, the records the slabs kept are the last the update needs, and hold their slabs till then:
    # fewer slabs to read ahead through, and more bytes read than alternating.
    half = nvme_sub_groups(SIZES, STATE / 2, ADAM_FP32)
    alternating = [files_update(SIZES, plan, RATES, DISK, half, backwards=b) for b in (True, False)]
    forwards = files_update(SIZES, plan, RATES, DISK, half, order=FORWARD)
    assert all(a.read_bytes < forwards.read_bytes and a.time_s < forwards.time_s for a in alternating)
    assert choose_files_order(SIZES, plan, RATES, DISK, half).order == ALTERNATE
    with pytest.raises(ValueError, match="order='sideways' is not one of alternate, forward"):
        files_update(SIZES, plan, RATES, DISK, half, order="sideways")


def test_the_slabs_hits_follow_the_engines_slab_rule() -> None:
    # Held records used once free their slab; a miss with no free slab evicts the record needed furthest ahead.
    assert slab_hits([5, 6], [6, 5, 4], 2) == [6, 5]
    assert slab_hits([5, 6], [1, 2, 5, 6], 2) == [5]
    assert slab_hits([], [1, 2], 4) == []
    with pytest.raises(ValueError, match="slabs"):
        slab_hits([1, 2, 3], [1], 2)


def test_small_records_get_more_staging_slabs_up_to_half_of_them() -> None:
    """Enough slabs for 128 MiB in flight (small records), at least 4, at most 16, and above 4 never more than half
    the file-backed records (a slab keeps its record: with one per record, none would cross the drive)."""
    record = 12 * 1_592_640  # 19.1 MB: the bench's medium GPT's sub-groups
    assert staging_slots(record) == 8 and staging_slots(record, 16) == 8 and staging_slots(record, 10) == 5
    assert staging_slots(record, 2) == 4  # the fewest, whatever the records
    assert staging_slots(12 * int(1e9)) == 4 == staging_slots(32 << 20, 100)  # large records: 4, as before
    assert staging_slots(8400) == 16 and staging_slots(8400, 20) == 10
    with pytest.raises(ValueError, match="record_bytes"):
        staging_slots(0)


def test_bad_figures_are_refused_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="read_bps"):
        DiskRates(0, 1e9)
    with pytest.raises(ValueError, match="write_bps"):
        DiskRates(1e9, -1)
    plan = Plan((Place.HOST, Place.HOST))
    with pytest.raises(ValueError, match="slots"):
        predict_tiered([1, 1], plan, RATES, DISK, [0], slots=0)
    with pytest.raises(ValueError, match="host_order"):
        predict_tiered([1, 1], plan, RATES, DISK, [0], host_order=[0])


def _plan(capsys, *args: str) -> dict:  # noqa: ANN001
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_shows_ours_against_stock_nvme_offload_per_host_budget(capsys, tmp_path) -> None:  # noqa: ANN001
    """`plan --nvme-read-gbs 25 --nvme-write-gbs 10` on the paper's node at 70B: ours as fast as stock with no host
    memory for the state, faster with more, each at its drive's pace; the profile's nvme entry does the same."""
    nvme = _plan(capsys, "--params", "70e9", "--nvme-read-gbs", "25", "--nvme-write-gbs", "10")["nvme"]
    rows = {row["host_budget"]: row for row in nvme["rows"]}
    assert set(rows) == {0.0, 0.25, 0.5} and nvme["ranks"] == 4
    assert rows[0.0]["file_share"] == 1.0 and rows[0.5]["file_share"] == pytest.approx(0.5, abs=0.02)
    assert rows[0.0]["ours_vs_stock"] >= 1.0 and rows[0.5]["ours_vs_stock"] >= 1.6
    for row in rows.values():
        assert row["ours_s"] <= 1.25 * row["ours_disk_floor_s"] and row["stock_s"] <= 1.25 * row["stock_disk_floor_s"]
    profile = tmp_path / "node.yaml"
    rates, meta = load_profile("paper-h100x4")
    save_profile(profile, rates, **meta, nvme={"read_bps": 25e9, "write_bps": 10e9})
    assert _plan(capsys, "--params", "70e9", "--profile", str(profile))["nvme"] == nvme
    assert _plan(capsys, "--params", "70e9")["nvme"] is None  # no drive named: no NVMe rows
    assert main(["plan", "--params", "70e9", "--nvme-read-gbs", "25", "--nvme-write-gbs", "10"]) == 0
    assert "ours vs" in capsys.readouterr().out  # the table form


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nvme-read-gbs", "25"], "--nvme-write-gbs"),
        (["--nvme-read-gbs", "0", "--nvme-write-gbs", "10"], "read_bps"),
        (["--nvme-read-gbs", "25", "--nvme-write-gbs", "10", "--host-budget", "half"], "--host-budget"),
        (["--nvme-read-gbs", "25", "--nvme-write-gbs", "10", "--host-budget", "-1"], "--host-budget"),
    ],
)
def test_plan_refuses_bad_nvme_figures_naming_them(capsys, args: list[str], named: str) -> None:  # noqa: ANN001
    assert main(["plan", "--params", "70e9", *args]) == 2
    assert named in capsys.readouterr().err


def test_the_tier_takes_deepspeeds_aio_block_and_leaves_deepspeed_offloading_to_cpu():
    from lightning_dos.integration.nvme_tier import take_nvme_tier

    config = {
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 16}},
        "aio": {"block_size": 1 << 21, "queue_depth": 16, "intra_op_parallelism": 2},
    }
    tier = take_nvme_tier(config, "auto")
    assert (tier.path, tier.block_size, tier.queue_depth, tier.threads) == ("/x", 1 << 21, 16, 2)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    # DeepSpeed's older name for the same setting.
    legacy = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
    legacy["aio"] = {"thread_count": 3}
    assert take_nvme_tier(legacy, 0).threads == 3
