"""The NVMe tier in ``lightning-dos plan``: ours against stock ZeRO-3 NVMe offload, per host-memory budget.

lightning-dos plan --params 70e9 --nvme-read-gbs 25 --nvme-write-gbs 10 --host-budget 0,0.25,0.5

Predicted by :mod:`lightning_dos.model.nvme` (the performance model) for the engine as it runs the tier, in the
order of the file-backed host sub-groups the planner chooses from the model (alternating between iterations, or
forwards every one: :func:`~lightning_dos.model.nvme.choose_files_order`); ``lightning-dos simulate`` with the
same options replays the engine's schedule of it on the virtual node.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dos.model.nvme import (
    ALTERNATE,
    FORWARD,
    DiskRates,
    choose_files_order,
    files_update,
    nvme_sub_groups,
    staging_slots,
    stock_tiered_update_s,
)
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import Footprint

#: The order column's cells: the file-backed sub-groups alternating between iterations, or forwards in each.
ORDER_CELL = {ALTERNATE: "alt.", FORWARD: "fwd"}
#: ``--host-budget``'s default: no host memory for the state, a quarter of it, half.
DEFAULT_HOST_BUDGETS = "0,0.25,0.5"


def add_nvme_options(parser: argparse.ArgumentParser) -> None:
    """``--nvme-read-gbs``, ``--nvme-write-gbs`` and ``--host-budget``."""
    parser.add_argument(
        "--nvme-read-gbs", type=float, help="the node's NVMe read bandwidth, GB/s (default: the profile's nvme entry)"
    )
    parser.add_argument("--nvme-write-gbs", type=float, help="the node's NVMe write bandwidth, GB/s (with the read's)")
    parser.add_argument(
        "--host-budget",
        default=DEFAULT_HOST_BUDGETS,
        help="with an NVMe drive: host memory for optimizer state, comma-separated; each a share of the state in "
        "[0, 1] or bytes per node (default 0,0.25,0.5)",
    )


def disk_of(args: argparse.Namespace, meta: dict[str, Any]) -> DiskRates | None:
    """The drive ``--nvme-read-gbs``/``--nvme-write-gbs`` describe, else the profile's ``nvme`` entry
    (``read_bps``, ``write_bps``), else None (no NVMe tier to plan)."""
    # Absent from a namespace built by hand (a caller of plan_rows): no drive named.
    read, write = getattr(args, "nvme_read_gbs", None), getattr(args, "nvme_write_gbs", None)
    if (read is None) != (write is None):
        raise ValueError("give both --nvme-read-gbs and --nvme-write-gbs, or neither")
    if read is not None:
        return DiskRates(read * 1e9, write * 1e9)
    entry = meta.get("nvme")
    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) != {"read_bps", "write_bps"}:
        raise ValueError(f"the profile's nvme entry must hold read_bps and write_bps, got {entry!r}")
    return DiskRates(float(entry["read_bps"]), float(entry["write_bps"]))


def host_budgets(text: str) -> list[float]:
    """``--host-budget``'s values: shares in [0, 1] or bytes (> 1)."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--host-budget {text!r}: give comma-separated shares in [0, 1] or bytes") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--host-budget {text!r}: give comma-separated shares in [0, 1] or bytes, none negative")
    return values


@dataclass(frozen=True)
class NvmeCase:
    """What the NVMe rows are computed for, by ``plan`` and by ``simulate`` alike.

    Attributes:
        sizes: one rank's sub-group sizes, in elements.
        plan: their placement, ours.
        rates: the node's rates.
        disk: the node's drive, shared by every rank.
        budgets: the host budgets, one row each: shares of the state in [0, 1] or bytes per node (> 1).
        ranks: ranks sharing the drive.
        lp_bytes: bytes per element of the model's 16-bit weights.
        footprint: the optimizer's rule and dtypes.
    """

    sizes: Sequence[int]
    plan: Plan
    rates: HardwareRates
    disk: DiskRates
    budgets: Sequence[float]
    ranks: int
    lp_bytes: int
    footprint: Footprint


def nvme_rows(case: NvmeCase) -> dict[str, Any]:
    """Per host budget: ours (``case.plan``'s placement, the file-backed host sub-groups in the order the planner
    chooses, ``order``; the update after one that took them the other way, when they alternate, as ``simulate``
    replays it) against stock's pipelined swapper, both on one rank's share of the drive."""
    sizes, plan, rates, footprint = case.sizes, case.plan, case.rates, case.footprint
    per_rank = case.disk.per_rank(case.ranks)
    state = sum(sizes) * footprint.optimizer_state
    stock = stock_tiered_update_s(sizes, rates, per_rank, lp_bytes=case.lp_bytes, footprint=footprint)
    rows = []
    slots = staging_slots(max(sizes) * footprint.optimizer_state)  # the most, for the table's title
    for budget in case.budgets:
        held = budget * state if budget <= 1 else budget / case.ranks
        on_nvme = nvme_sub_groups(sizes, held, footprint)
        row_slots = staging_slots(max(sizes) * footprint.optimizer_state, len(on_nvme))  # as the adapter opens them
        kwargs = {"lp_bytes": case.lp_bytes, "slots": row_slots, "footprint": footprint}
        order = choose_files_order(sizes, plan, rates, per_rank, on_nvme, **kwargs).order
        ours = files_update(sizes, plan, rates, per_rank, on_nvme, order=order, backwards=False, **kwargs)
        rows.append(
            {
                "host_budget": budget,
                "order": order,
                "slots": row_slots,
                "host_state_bytes": min(held, state),
                "host_state_gb": min(held, state) / 1e9,
                "file_share": sum(sizes[i] for i in on_nvme) * footprint.optimizer_state / state if state else 0.0,
                "ours_s": ours.time_s,
                "ours_disk_floor_s": ours.disk_s,
                "ours_read_gb": ours.read_bytes / 1e9,
                "ours_write_gb": ours.write_bytes / 1e9,
                "stock_s": stock.time_s,
                "stock_disk_floor_s": stock.disk_s,
                "ours_vs_stock": stock.time_s / ours.time_s,
            }
        )
    return nvme_result(case.disk, case.ranks, state, rows, slots)


def nvme_result(disk: DiskRates, ranks: int, state: float, rows: list[dict[str, Any]], slots: int) -> dict[str, Any]:
    """The NVMe rows with what they were computed for: the drive, the ranks sharing it, the state per rank, the
    staging slabs."""
    return {
        "read_gbs": disk.read_bps / 1e9,
        "write_gbs": disk.write_bps / 1e9,
        "ranks": ranks,
        "slots": slots,
        "state_gb_per_rank": state / 1e9,
        "rows": rows,
    }


def nvme_title(result: dict[str, Any]) -> str:
    """The NVMe table's title: the drive, the ranks sharing it, the state per rank."""
    return (
        f"NVMe tier: a drive of {result['read_gbs']:.1f} GB/s read, {result['write_gbs']:.1f} GB/s write, "
        f"shared by {result['ranks']} rank(s); {result['state_gb_per_rank']:.1f} GB of optimizer state per rank"
    )


def leading_cells(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """The cells that open a row of either NVMe table (``plan``'s and ``simulate``'s): the host budget, the share of
    the state in files, the order of the file-backed sub-groups and ours' seconds."""
    budget = row["host_budget"]
    return (
        f"{budget:.0%}" if budget <= 1 else f"{budget / 1e9:.0f} GB",
        f"{row['file_share']:.0%}",
        ORDER_CELL[row["order"]],
        f"{row['ours_s']:.2f}",
    )


def print_nvme(result: dict[str, Any], console: Any) -> None:  # noqa: ANN401 - a rich Console
    """The NVMe rows as a table that fits 80 columns."""
    from rich.table import Table

    table = Table(
        title=nvme_title(result),
        caption="predicted (performance model); lightning-dos simulate replays ours. floor: the drive's time for the "
        f"bytes read and written; at most {result['slots']} host staging slabs for each.",
    )
    table.add_column("host\nbudget", justify="right")
    for column in ("in\nfiles", "order", "ours\ns", "x\nfloor", "stock\ns", "x\nfloor", "ours vs\nstock"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in result["rows"]:
        table.add_row(
            *leading_cells(row),
            f"{row['ours_s'] / row['ours_disk_floor_s']:.2f}" if row["ours_disk_floor_s"] else "-",
            f"{row['stock_s']:.2f}",
            f"{row['stock_s'] / row['stock_disk_floor_s']:.2f}",
            f"{row['ours_vs_stock']:.2f}x",
        )
    console.print(table)
