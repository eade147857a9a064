"""``lightning-dos calibrate`` and ``lightning-dos plan``: measure a machine, and predict each offload scheme on it.

lightning-dos calibrate --out my-node.yaml
lightning-dos calibrate --out my-node.yaml --nvme-path /local_nvme   # the drive too, for plan's NVMe rows
lightning-dos plan --params 20e9 --gpus-per-node 4 --profile paper-h100x4
lightning-dos plan --recipe recipes/gpt-7b.yaml --profile my-node.yaml --forward-s 0.4 --backward-s 0.9 --json
lightning-dos plan --params 20e9 --optimizer lion --master-dtype bf16 --state-dtype bf16
lightning-dos plan --params 70e9 --nvme-read-gbs 25 --nvme-write-gbs 10 --host-budget 0,0.25,0.5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lightning_dos.commands.nvme_rows import (
    DEFAULT_HOST_BUDGETS,
    NvmeCase,
    add_nvme_options,
    disk_of,
    host_budgets,
    nvme_rows,
    print_nvme,
)
from lightning_dos.commands.options import (
    add_footprint_options,
    add_model_options,
    footprint_label,
    footprint_of,
    footprint_summary,
    recipe_parameters,
    speculation_option,
    sub_group_size_of,
)
from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.iteration import Speculation
from lightning_dos.model.overlap import MODES
from lightning_dos.model.perfmodel import HardwareRates, floor, planning_budget, predict, rates_for
from lightning_dos.model.plan import Place, Plan, split_into_sub_groups, stride_plan
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.planning.profiles import load_profile, save_profile

TWINFLOW_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5)
STRIDES = (2, 3, 4)


def stock_update_s(elements: float, rates: HardwareRates, lp_bytes: int, *, footprint: Footprint = ADAM_FP32) -> float:
    """Stock ZeRO-3 offload: for each sub-group, the CPU update, then a CPU cast and a blocking upload; no
    overlap. The update's rate is the profile's scaled to ``footprint`` (``perfmodel.rates_for``), as DeepSpeed's
    CPU optimizers too stream their state from memory."""
    rates = rates_for(rates, footprint)
    return elements * (rates.host_s_per_element + lp_bytes / rates.h2d_bps)


def twinflow_update_s(
    elements: float, gpu_share: float, rates: HardwareRates, lp_bytes: int, *, footprint: Footprint = ADAM_FP32
) -> float:
    """TwinFlow: a fixed share stays on the GPU (its gradients too), updated there, serially with the host
    sub-groups."""
    device_eps = rates_for(rates, footprint).device_adam_eps
    gpu = gpu_share * elements / device_eps if device_eps > 0 else math.inf
    return stock_update_s((1 - gpu_share) * elements, rates, lp_bytes, footprint=footprint) + gpu


def has_accelerator(rates: HardwareRates) -> bool:
    """Whether a profile describes an accelerator (not the CPU standing in for one)."""
    return rates.device_adam_eps > 0 and not rates.shared_cpu


def device_kind(rates: HardwareRates, meta: dict[str, Any]) -> str:
    """What the profile's ranks run on, for titles: ``GPU`` or ``CPU (no accelerator)``."""
    if not has_accelerator(rates):
        return "CPU (no accelerator)"
    device = str(meta.get("device", "cuda"))
    return "GPU" if device.startswith("cuda") else device


def plan_rows(
    params: int,
    gpus: int,
    rates: HardwareRates,
    meta: dict[str, Any],
    args: argparse.Namespace,
    footprint: Footprint = ADAM_FP32,
) -> dict:
    """Every scheme's predicted update for a model of ``params`` on ``gpus`` ranks.

    Without ``args.budget`` the rows are what runs by default: "ours (auto)" streams within the profile's
    memory free after backward (less the strategy's 10% margin) and holds nothing between updates, and the
    schemes that keep state resident through forward and backward (TwinFlow) are left out. With
    ``args.budget`` (device bytes spare at the forward/backward peak, the strategy's ``gpu_memory_budget``)
    resident state is planned and compared too, and must fit that budget beside the update's buffers.
    TwinFlow and the paper's strides need an accelerator; with a CPU-only profile only stock offload and ours
    are shown. The floor is searched at every shown scheme's device share too, and "ours (auto)" searches a
    superset of the placements shown, so within the device budget no row is below the floor and none is
    better than ours. Every byte count (streamed, held, resident uploads) and update rate is ``footprint``'s,
    the optimizer's rule and dtypes, for stock offload and TwinFlow as for ours.
    """
    fp = footprint
    per_rank = params // gpus
    size = sub_group_size_of(args.sub_group_size, per_rank)
    # Cut as the engine cuts a rank's partition: near-equal pieces of at most `size` elements.
    sizes = [sg.numel for sg in split_into_sub_groups([per_rank], [0], size)]
    count = len(sizes)
    lp = args.lp_bytes
    # As the strategy decides: an explicit budget holds resident state and the update's buffers; without one
    # only the update's buffers, in the memory free after backward.
    budget, resident_ok = planning_budget(args.budget, meta.get("device_free_bytes"))
    accelerator = has_accelerator(rates)
    # (scheme, update seconds, device bytes it holds during the update, streamed share, resident share)
    rows: list[tuple[str, float, float, float, float]] = [
        ("stock ZeRO-3 offload", stock_update_s(per_rank, rates, lp, footprint=fp), 0, 0.0, 0.0)
    ]
    # TwinFlow's placement run by this engine (its GPU share resident, gradients uploaded from host memory).
    twinflow_as_ours: dict[str, float] = {}
    # TwinFlow holds its GPU share through forward and backward: shown only inside an explicit budget.
    for g in TWINFLOW_RATIOS if accelerator and resident_ok else ():
        # DeepSpeed keeps the first int(g * n) whole sub-groups on the GPU: master weights, states and gradient,
        # all run. Their share of the elements is what they hold (near-equal cuts are not exactly equal).
        kept = int(g * count)
        share = sum(sizes[:kept]) / per_rank
        resident = Plan(tuple(Place.RESIDENT if i < kept else Place.HOST for i in range(count)))
        twinflow_as_ours[f"TwinFlow ratio {g:.1f}"] = predict(sizes, resident, rates, lp, footprint=fp).time_s
        rows.append(
            (
                f"TwinFlow ratio {g:.1f}",
                twinflow_update_s(per_rank, share, rates, lp, footprint=fp),
                fp.device * share * per_rank,
                0.0,
                share,
            )
        )
    for k in STRIDES if accelerator else ():
        plan = stride_plan(count, k)
        stride = predict(sizes, plan, rates, lp, footprint=fp)
        rows.append((f"paper stride {k}", stride.time_s, stride.peak_device_bytes, plan.device_share(sizes), 0.0))
    chosen = auto_plan(sizes, rates, lp, budget, allow_resident=resident_ok, footprint=fp)
    ours_plan, ours = chosen.update_plan, chosen.update
    ours_shares = (
        sum(sizes[i] for i in ours_plan.streamed_indices) / sum(sizes),
        sum(sizes[i] for i in ours_plan.resident_indices) / sum(sizes),
    )
    rows.append(("ours (auto)", ours.time_s, ours.peak_device_bytes, *ours_shares))

    def fits(held: float) -> bool:
        return budget is None or held <= budget

    shown = [(r, q) for _, _, held, r, q in rows if fits(held)]
    # TwinFlow's resident share keeps its gradients on the GPU: the floor must allow that too. Resident state
    # only within an explicit budget, as everywhere.
    resident_room = budget if resident_ok else None
    r_star, t_floor = floor(per_rank, rates, lp, resident_room, shares=shown, resident_up_bytes=0, footprint=fp)
    fwd_bwd = (args.forward_s or 0.0) + (args.backward_s or 0.0)
    table = [
        {
            "scheme": name,
            "update_s": t,
            "update_params_per_s": params / t,
            "iteration_s": fwd_bwd + t if args.forward_s is not None or args.backward_s is not None else None,
            "vs_floor": t / t_floor,
            "device_gb": held / 1e9,
            # Held through forward and backward as well (resident state); the rest is freed after the update.
            "held_gb": fp.device * q * per_rank / 1e9,
            "fits_budget": fits(held),
            **({"as_ours_s": twinflow_as_ours[name]} if name in twinflow_as_ours else {}),
        }
        for name, t, held, _, q in rows
    ]
    overlapped = None
    if args.forward_s is not None and args.backward_s is not None and accelerator:
        speculation = speculation_option(args, fp)
        # The iteration depends on the order the next forward needs the sub-groups in: a recipe's model's own.
        from lightning_dos.commands.recipe_order import model_layout

        layout, order = model_layout(args, params, gpus, size)
        overlapped = _overlapped_iterations(
            layout, rates, lp, budget, resident_ok, args.forward_s, args.backward_s, fp, speculation, order
        )
    disk = disk_of(args, meta)
    nvme = None
    if disk is not None:
        budgets = host_budgets(getattr(args, "host_budget", DEFAULT_HOST_BUDGETS))
        nvme = nvme_rows(NvmeCase(sizes, ours_plan, rates, disk, budgets, gpus, lp, fp))
    return {
        "nvme": nvme,
        "overlapped": overlapped,
        "params": params,
        "gpus": gpus,
        "device": device_kind(rates, meta),
        **footprint_summary(args, fp),
        "precision": footprint_label(args),
        "sub_group_size": size,
        "sub_groups_per_rank": count,
        "budget_gb": None if budget is None else budget / 1e9,
        # "forward/backward peak": an explicit --budget, spare at that peak (resident state allowed in it);
        # "update only": the profile's free memory after backward less 10%, streaming buffers only.
        "budget_kind": "forward/backward peak" if resident_ok else "update only",
        "ours": {
            "device_share": ours_plan.device_share(sizes),
            "device_buffers": ours_plan.device_buffers,
            "resident": len(ours_plan.resident_indices),
            "streamed": len(ours_plan.streamed_indices),
        },
        "floor": {"r_star": r_star, "update_s": t_floor, "update_params_per_s": params / t_floor},
        "rows": table,
    }


def _overlapped_iterations(
    sizes: list[int],
    rates: HardwareRates,
    lp: int,
    budget: int | None,
    resident_ok: bool,
    forward_s: float,
    backward_s: float,
    fp: Footprint,
    speculation: Speculation | None = None,
    order: tuple[int, ...] = (),
) -> dict[str, dict[str, float | int]]:
    """Ours, per overlap mode: the predicted iteration and the streamed count of the plan the strategy runs once it
    has timed forward and backward (``off``: the update's own best after forward and backward), the sub-groups in
    ``order`` (as the next forward needs them; empty: index order); with ``speculation`` (``--commit-rate``),
    ``auto``'s at its commit rate."""
    out = {}
    for mode in MODES:
        chosen = auto_plan(
            sizes, rates, lp, budget, allow_resident=resident_ok, footprint=fp, phases=(forward_s, backward_s),
            overlap=mode, speculation=speculation, order=order,
        )  # fmt: skip
        out[mode] = {"iteration_s": chosen.iteration_s, "streamed": len(chosen.plan.streamed_indices)}
    return out


def _print_plan(result: dict) -> None:
    from lightning_dos.host.console import trimmed

    with trimmed() as console:  # its width: the terminal's, or COLUMNS, or 80 in a pipe or a log file
        _render_plan(result, console)


def _render_plan(result: dict, console: Any) -> None:
    from rich.table import Table

    budget = result["budget_gb"]
    if budget is None:
        caption = None
    elif result["budget_kind"] == "update only":
        caption = (
            f"device memory per rank for the update: {budget:.1f} GB, the profile's free memory after backward less "
            "10% ('over': does not fit); nothing is held between updates."
        )
    else:
        caption = (
            f"device memory budget per rank: {budget:.1f} GB spare at the forward/backward peak, for resident state "
            "and the update's buffers together ('over': does not fit)."
        )
    caption = " ".join(
        filter(None, [caption, "GPU GB: held during the update; held GB: of it, held through forward and backward."])
    )
    table = Table(
        title=f"{result['params'] / 1e9:.2f}B params over {result['gpus']} rank(s), {result['device']}, "
        f"{result['precision']}: {result['sub_groups_per_rank']} sub-group(s) of {result['sub_group_size']:,} "
        "elements per rank",
        caption=caption,
    )
    # The default profile is the paper's node, not this machine: say which one the figures are for.
    console.print(f"PREDICTED (not measured) for profile {result['profile']}", markup=False)
    # Two-line headers and no iteration column without forward/backward times: the table fits 80 columns.
    timed = any(row["iteration_s"] is not None for row in result["rows"])
    table.add_column("scheme", overflow="fold")
    for column in (
        "update\ns",
        "B params\nper s",
        *(("iteration\ns",) if timed else ()),
        "x\nfloor",
        "GPU\nGB",
        "held\nGB",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for row in result["rows"]:
        iteration = "-" if row["iteration_s"] is None else f"{row['iteration_s']:.3f}"
        held = f"{row['device_gb']:.2f}" + ("" if row["fits_budget"] else " over")
        table.add_row(
            row["scheme"],
            f"{row['update_s']:.3f}",
            f"{row['update_params_per_s'] / 1e9:.2f}",
            *((iteration,) if timed else ()),
            f"{row['vs_floor']:.2f}",
            held,
            f"{row['held_gb']:.2f}",
        )
    f = result["floor"]
    table.add_row(
        "floor T(r*)",
        f"{f['update_s']:.3f}",
        f"{f['update_params_per_s'] / 1e9:.2f}",
        *(("-",) if timed else ()),
        "1.00",
        "-",
        "-",
        end_section=True,
    )
    console.print(table)
    o = result["ours"]
    where = "on the GPU" if result["device"] == "GPU" else "on the device"
    console.print(
        f"ours: {o['device_share']:.0%} of elements {where} ({o['streamed']} streamed through "
        f"{o['device_buffers']} buffer(s), {o['resident']} resident); floor at r* = {f['r_star']:.2f}",
        markup=False,
    )
    if result["overlapped"] is not None:
        it = result["overlapped"]
        console.print(
            "iteration with ours, overlapped as the strategy runs it: "
            + ", ".join(f"{mode} {v['iteration_s']:.3f} s ({v['streamed']} streamed)" for mode, v in it.items()),
            markup=False,
        )
    if result["nvme"] is not None:
        print_nvme(result["nvme"], console)
    if result["device"].startswith("CPU"):
        console.print(
            "TwinFlow and the paper's strides need an accelerator; a CPU-only profile shows stock offload and ours.",
            markup=False,
        )
    elif result["budget_kind"] == "update only":
        console.print(
            "These are the default settings: nothing is kept resident. TwinFlow and resident sub-groups hold their "
            "state through forward and backward; pass --budget BYTES, the device memory spare at the "
            "forward/backward peak (the strategy's gpu_memory_budget), to plan and compare them.",
            markup=False,
        )
    ours_s = next(r["update_s"] for r in result["rows"] if r["scheme"] == "ours (auto)")
    ahead = [r["scheme"] for r in result["rows"] if "as_ours_s" in r and r["fits_budget"] and r["update_s"] < ours_s]
    if ahead:
        console.print(
            f"{', '.join(ahead)}: predicted ahead of ours because TwinFlow keeps its GPU share's gradients on the GPU; "
            f"this engine keeps resident sub-groups' there ({result['bytes_per_element']['resident_up']} bytes "
            "uploaded per resident element) but uploads streamed ones' from host memory.",
            markup=False,
        )


def describe_rates(rates: HardwareRates) -> list[str]:
    """One line per measured rate, with its unit."""
    lines = [
        f"host Adam          {rates.host_adam_eps / 1e9:8.3f} G elements/s",
        f"host cast to 16 b  {rates.host_cast_eps / 1e9:8.3f} G elements/s",
    ]
    if rates.device_adam_eps > 0:
        lines.append(f"device Adam        {rates.device_adam_eps / 1e9:8.3f} G elements/s")
    lines += [
        f"host to device     {rates.h2d_bps / 1e9:8.3f} GB/s alone, {rates.duplex_h2d_bps / 1e9:.3f} GB/s duplex",
        f"device to host     {rates.d2h_bps / 1e9:8.3f} GB/s alone, {rates.duplex_d2h_bps / 1e9:.3f} GB/s duplex",
    ]
    # Contention, as overlap runs them side by side (the model charges these shares on overlapped phases).
    lines += [
        f"copies beside the host update  {rates.overlap_copy_speed:6.0%} of their rate alone",
        f"host update beside training    {rates.overlap_host_speed:6.0%} of its rate alone",
        f"training beside host update    {rates.overlap_launch_speed:6.0%} of its rate alone (launch-bound loop)",
    ]
    if rates.shared_cpu:
        lines.append("(no accelerator: the 'device' is the CPU itself, its copies host memory copies)")
    return lines


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from lightning_dos.planning.calibrate import calibrate

    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(name)
    try:
        footprint = footprint_of(args.optimizer, args.master_dtype, args.state_dtype)
    except ValueError as error:
        print(f"lightning-dos calibrate: error: {error}", file=sys.stderr)
        return 2
    extra = {}
    if args.nvme_path is not None:
        from lightning_dos.errors import DOSConfigError
        from lightning_dos.host.disk import ALIGNMENT, check_nvme_path, load_aio, measure_disk

        try:  # before the minutes of the other measurements: a bad directory or no libaio is said at once
            if args.nvme_bytes <= 0 or args.nvme_bytes % ALIGNMENT:
                raise DOSConfigError(f"--nvme-bytes {args.nvme_bytes}: give a positive multiple of {ALIGNMENT}")
            check_nvme_path(args.nvme_path, args.nvme_bytes, setting="--nvme-path")
            load_aio(setting="--nvme-path")
        except DOSConfigError as error:
            print(f"lightning-dos calibrate: error: {error}", file=sys.stderr)
            return 2
    rates = calibrate(device, footprint=footprint)
    if args.nvme_path is not None:
        drive = measure_disk(args.nvme_path, args.nvme_bytes)
        extra["nvme"] = {"read_bps": drive.read_bps, "write_bps": drive.write_bps}
    meta = {"device": str(device), "gpus_per_node": max(1, torch.cuda.device_count()), **extra}
    path = save_profile(args.out, rates, **meta)
    print(f"wrote {path}")
    print("\n".join(describe_rates(rates)))
    if "nvme" in extra:
        print(
            f"NVMe drive         {extra['nvme']['read_bps'] / 1e9:8.3f} GB/s read, "
            f"{extra['nvme']['write_bps'] / 1e9:.3f} GB/s write ({args.nvme_path})"
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure this machine's rates and write a profile")
    cal.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when there is one)")
    cal.add_argument("--out", type=Path, default=Path("profile.yaml"), help="profile file (.yaml or .json)")
    add_footprint_options(cal)
    cal.add_argument(
        "--nvme-path",
        help="also measure the NVMe drive under this directory, through DeepSpeed's async I/O op (needs libaio-dev; "
        "built on first use, a few minutes)",
    )
    cal.add_argument(
        "--nvme-bytes",
        type=int,
        default=1 << 30,
        help="bytes written and read back to measure the drive (default 1 GiB; above the drive's own cache is best)",
    )
    plan = sub.add_parser("plan", help="predict the update phase of each offload scheme")
    add_model_options(plan)
    add_nvme_options(plan)
    return parser


def calibrate_main(argv: list[str]) -> int:
    """``lightning-dos calibrate`` with ``argv`` (the arguments after the subcommand); returns the exit status."""
    return main(["calibrate", *argv])


def plan_main(argv: list[str]) -> int:
    """``lightning-dos plan`` with ``argv`` (the arguments after the subcommand); returns the exit status."""
    return main(["plan", *argv])


def main(argv: list[str]) -> int:
    """Run ``calibrate`` or ``plan`` (``argv`` starts with the subcommand); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "calibrate":
        return _calibrate(args)
    try:
        footprint = footprint_of(args.optimizer, args.master_dtype, args.state_dtype)
        rates, meta = load_profile(args.profile)
        params = int(args.params) if args.params is not None else recipe_parameters(args.recipe)
        gpus = args.gpus_per_node or int(meta.get("gpus_per_node", 1))
        # Sized once, for the rank's partition, before any work (plan_rows takes the number as given).
        args.sub_group_size = sub_group_size_of(args.sub_group_size, params // gpus)
        speculation_option(args, footprint)  # a bad --commit-rate is refused before any work
        disk_of(args, meta)  # and bad NVMe figures
        host_budgets(args.host_budget)
    except (FileNotFoundError, ValueError) as error:
        print(f"lightning-dos plan: error: {error}", file=sys.stderr)
        return 2
    args.budget = int(args.budget) if args.budget is not None else None
    result = {"profile": str(args.profile), **plan_rows(params, gpus, rates, meta, args, footprint)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result)
    return 0
