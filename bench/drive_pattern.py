"""The NVMe tier's requests with nothing else running: how near the drive's floor can an update get that moves one
sub-group's record per request through a few staging slabs, on this drive?

Replays what the tier asks of the drive in an update that keeps none of the optimizer state in host memory, and
nothing else: no training, no CPU update, no copies. Every record (master weights and two Adam moments, fp32) is
read into one of ``S`` page-locked staging slabs and written back from it, ``S`` requests in flight, through the
tier's own swap file (``lightning_dos.engine.swap_files.SwapFile``: DeepSpeed's async I/O op, one handle per slab,
with bench/run.py's ``AIO`` settings). Each pass is set beside the drive's floor as bench/run.py sets a step beside
it: the drive measured right before and right after the pass, the floor for the pass's bytes at the mean of the two
(``bench.run.drive_floor``). The slab counts take turns pass by pass, so a drive that drifts meets each of them.

A pass over its floor is what no engine that moves records this way can beat on this drive: where every slab count
stays above 1.25, an update's distance from the floor is the drive's, not the engine's.

    python bench/drive_pattern.py --path /local_nvme                  # 16 records of 19 MB, 4, 8 and 16 slabs
    python bench/drive_pattern.py --path /local_nvme --record-elements 5000000 --records 32 --slabs 4,8 --passes 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.run import AIO, GB, drive_floor, drive_rates  # noqa: E402
from lightning_dos.engine.swap_files import SwapFile  # noqa: E402
from lightning_dos.host import disk  # noqa: E402

#: The medium bench preset's sub-group (bench/run.py: 25.5M parameters in 16 sub-groups): 19.1 MB of fp32 Adam state.
RECORD_ELEMENTS = 1_592_640
#: The drive is measured with at least this many bytes (bench/run.py's least), at most 1 GiB.
LEAST_MEASURE_BYTES = 64 << 20


def one_pass(swap: SwapFile) -> float:
    """Read every record into the slabs and write each back from its slab, as many in flight as there are slabs;
    seconds until the last write landed."""
    slots, records = len(swap.slabs), len(swap.numels)
    doing: list[tuple[str, int] | None] = [None] * slots  # each slab's request: ("read" | "write", record)
    started = time.perf_counter()
    for slot in range(min(slots, records)):
        swap.read(slot, slot)
        doing[slot] = ("read", slot)
    following, written, slot = min(slots, records), 0, 0
    while written < records:
        if doing[slot] is not None:
            kind, record = doing[slot]
            swap.wait(slot)  # the slabs' requests were queued in this order: the oldest first
            if kind == "read":
                swap.write(slot, record)
                doing[slot] = ("write", record)
            else:
                written += 1
                doing[slot] = None
                if following < records:
                    swap.read(slot, following)
                    doing[slot] = ("read", following)
                    following += 1
        slot = (slot + 1) % slots
    return time.perf_counter() - started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="a directory on the drive (the nvme_path to judge)")
    parser.add_argument("--records", type=int, default=16, help="records per pass (sub-groups kept on the drive)")
    parser.add_argument(
        "--record-elements",
        type=int,
        default=RECORD_ELEMENTS,
        help=f"elements per record (a sub-group; default {RECORD_ELEMENTS}, 12 bytes each)",
    )
    parser.add_argument("--slabs", default="4,8,16", help="comma-separated staging slab counts to compare")
    parser.add_argument("--passes", type=int, default=6, help="passes per slab count")
    parser.add_argument("--out", type=Path, help="JSON output (default: bench/out/drive-pattern-<time>.json)")
    args = parser.parse_args(argv)
    try:
        args.slabs = [int(value) for value in args.slabs.split(",")]
    except ValueError:
        parser.error(f"--slabs takes comma-separated integers, e.g. 4,8,16; got {args.slabs!r}")
    for name in ("records", "record_elements", "passes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if any(slabs < 1 for slabs in args.slabs):
        parser.error(f"--slabs must each be at least 1, got {args.slabs}")
    args.out = args.out or ROOT / "bench" / "out" / f"drive-pattern-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    where = Path(args.path) / f".drive-pattern-{uuid.uuid4().hex[:8]}"
    disk.check_nvme_path(args.path, 12 * args.record_elements * args.records * 2)
    aio = disk.load_aio()
    where.mkdir()
    swaps: dict[int, SwapFile] = {}
    try:
        for slabs in args.slabs:  # one swap file each, of the same records, written once before any pass
            (where / str(slabs)).mkdir()
            swap = swaps[slabs] = SwapFile(
                where / str(slabs), 0, [args.record_elements] * args.records, torch.float32, torch.float32, 2,
                slabs, aio, block_size=AIO["block_size"], queue_depth=AIO["queue_depth"],
                threads=AIO["intra_op_parallelism"],
            )  # fmt: skip
            state = torch.randn(args.record_elements)
            for record in range(args.records):
                swap.store(record, state, (state, state))
        moved = sum(swap.record_bytes(n) for n in next(iter(swaps.values())).numels)  # each way, per pass
        measure_bytes = min(1 << 30, max(LEAST_MEASURE_BYTES, -(-moved // 4096) * 4096))
        passes: dict[int, list[dict[str, float]]] = {slabs: [] for slabs in args.slabs}
        before = drive_rates(str(where), measure_bytes)
        for k in range(args.passes):
            turn = args.slabs[k % len(args.slabs) :] + args.slabs[: k % len(args.slabs)]
            for slabs in turn:
                seconds = one_pass(swaps[slabs])
                after = drive_rates(str(where), measure_bytes)
                floor = drive_floor(before, after, moved, moved)
                passes[slabs].append({"pass_s": seconds, **floor, "over_floor": seconds / floor["floor_s"]})
                before = after
    finally:
        for swap in swaps.values():
            swap.close()
        for folder in sorted(where.glob("*"), reverse=True):
            folder.rmdir()
        where.rmdir()
    record_mb = next(iter(swaps.values())).record_bytes(args.record_elements) / 1e6
    print(
        f"# {args.records} records of {record_mb:.1f} MB read and written back per pass under {args.path}, "
        f"{args.passes} passes per slab count, AIO {AIO['block_size']} B blocks, {AIO['queue_depth']} in flight, "
        f"{AIO['intra_op_parallelism']} threads per request\n"
    )
    print(table(passes, record_mb))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "aio": AIO, "passes": passes}))
    print(f"\nJSON: {args.out}")
    return 0


def table(passes: dict[int, list[dict[str, float]]], record_mb: float) -> str:
    lines = [
        "| slabs | in flight MB | pass s (median) | GB/s moved | drive read / write / both GB/s | floor s (median) "
        "| pass / floor, each pass | median | within 1.25x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for slabs, rows in passes.items():
        seconds = statistics.median(row["pass_s"] for row in rows)
        ratios = [row["over_floor"] for row in rows]
        rates = "/".join(f"{statistics.median(row[key] for row in rows) / GB:.2f}" for key in
                         ("read_bps", "write_bps", "mixed_bps"))  # fmt: skip
        moved = 2 * rows[0]["read_bytes"]
        lines.append(
            f"| {slabs} | {slabs * record_mb:.0f} | {seconds:.3f} | {moved / seconds / GB:.2f} | {rates} "
            f"| {statistics.median(row['floor_s'] for row in rows):.3f} | {' '.join(f'{r:.2f}' for r in ratios)} "
            f"| {statistics.median(ratios):.2f} | {sum(r <= 1.25 for r in ratios)} of {len(ratios)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
