"""The NVMe tier in ``lightning-dos simulate``: ours replayed on the virtual node, per host-memory budget, beside the
performance model and stock ZeRO-3 NVMe offload.

lightning-dos simulate --params 70e9 --nvme-read-gbs 25 --nvme-write-gbs 10 --host-budget 0,0.25,0.5

For each budget the engine runs at test size with the sub-groups past the budget on the simulated drive
(:class:`~lightning_dos.sim.simdrive.SimSwapFile`: the staging slabs' requests race-checked and logged), and its
third step (the file-backed sub-groups in the order the planner chooses: forwards, after a step that took them
backwards when they alternate) is replayed with the drive's reads and writes on one queue at one rank's share of
its rates. Stock is the performance model's
(:func:`~lightning_dos.model.nvme.stock_tiered_update_s`): DeepSpeed's swapper is not ours to replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dos.commands.nvme_rows import NvmeCase, leading_cells, nvme_rows, nvme_title
from lightning_dos.model.nvme import (
    ALTERNATE,
    DiskRates,
    nvme_sub_groups,
    tiered_plan,
)
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import Footprint
from lightning_dos.sim.logged_step import SIM_ELEMENTS, steady_step
from lightning_dos.sim.replay import ReplayResult, replay, write_perfetto
from lightning_dos.sim.sanitizer import StreamSanitizer


def replay_tiered(
    sizes: Sequence[int],
    plan: Plan,
    rates: HardwareRates,
    disk: DiskRates,
    on_nvme: Sequence[int],
    lp_bytes: int,
    footprint: Footprint,
    order: str = ALTERNATE,
) -> tuple[ReplayResult, int]:
    """The engine's steady-state update of ``plan`` with ``on_nvme`` (a tail of the sub-groups) on the simulated
    drive, taken in ``order``, replayed on the node ``rates`` and ``disk`` (one rank's share) describe; and the
    races found."""
    scale = max(sizes) / SIM_ELEMENTS
    checker = StreamSanitizer()
    first = on_nvme[0] if on_nvme else None
    log = steady_step(checker, sizes, plan, lp_bytes, scale, footprint, files_from=first, files_order=order)
    return replay(log, rates, scale, footprint=footprint, disk=disk), len(checker.races)


def nvme_simulation(case: NvmeCase, trace: Path | None = None) -> dict[str, Any]:
    """:func:`~lightning_dos.commands.nvme_rows.nvme_rows` (ours and stock predicted, per host budget, on one rank's
    share of ``case.disk``) with ours replayed: ``ours_s`` and its bytes are the replay's, ``ours_predicted_s`` the
    model's. With ``trace``, each budget's replay is written beside it as a Perfetto trace
    (``<trace stem>-nvme-<budget><suffix>``: the drive's reads and writes in lanes of their own)."""
    result = nvme_rows(case)
    sizes, footprint = case.sizes, case.footprint
    per_rank = case.disk.per_rank(case.ranks)
    for row in result["rows"]:
        on_nvme = nvme_sub_groups(sizes, row["host_state_bytes"], footprint)
        tiered = tiered_plan(case.plan, on_nvme)
        run, races = replay_tiered(sizes, tiered, case.rates, per_rank, on_nvme, case.lp_bytes, footprint, row["order"])
        row_trace = None
        if trace is not None:
            budget = row["host_budget"]
            row_trace = str(trace.with_name(f"{trace.stem}-nvme-{budget:g}{trace.suffix}"))
            write_perfetto(row_trace, run, f"the update with a host budget of {budget:g} and the rest on NVMe")
        row.update(
            ours_predicted_s=row["ours_s"],
            ours_predicted_read_gb=row["ours_read_gb"],
            ours_s=run.time_s,
            replay_over_prediction=run.time_s / row["ours_s"],
            ours_read_gb=run.read_bytes / 1e9,
            ours_write_gb=run.write_bytes / 1e9,
            ours_disk_floor_s=per_rank.floor_s(run.read_bytes, run.write_bytes),
            drive_busy_share=run.busy_share().get("drive", 0.0),
            ours_vs_stock=row["stock_s"] / run.time_s,
            races=races,
            trace=row_trace,
        )
    return result


def print_nvme_simulation(result: dict[str, Any], console: Any) -> None:  # noqa: ANN401 - a rich Console
    """The replayed NVMe rows as a table that fits 80 columns."""
    from rich.table import Table

    races = sum(row["races"] for row in result["rows"])
    table = Table(
        title=nvme_title(result),
        caption="ours: the engine's schedule replayed (SIMULATED), beside the model; stock: the model of "
        "DeepSpeed's pipelined swapper. floor: the drive's time for the bytes; "
        f"at most {result['slots']} staging slabs; stream races found: {races}.",
    )
    columns = ("host\nbudget", "in\nfiles", "order", "ours\ns", "model\ns", "replay/\nmodel", "x\nfloor", "stock\ns")
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("vs\nstock", justify="right", no_wrap=True)
    for row in result["rows"]:
        floor = row["ours_disk_floor_s"]
        table.add_row(
            *leading_cells(row),
            f"{row['ours_predicted_s']:.2f}",
            f"{row['replay_over_prediction']:.3f}",
            f"{row['ours_s'] / floor:.2f}" if floor else "-",
            f"{row['stock_s']:.2f}",
            f"{row['ours_vs_stock']:.2f}x",
        )
    console.print(table)
