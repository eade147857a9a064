"""``lightning-dos calibrate`` and ``lightning-dos plan``: measure a machine, and predict each offload scheme on it.

lightning-dos calibrate --out my-node.yaml
lightning-dos plan --params 20e9 --gpus-per-node 4 --profile paper-h100x4
lightning-dos plan --recipe recipes/gpt-7b.yaml --profile my-node.yaml --forward-s 0.4 --backward-s 0.9 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_dos.engine.calibrate import calibrate
from lightning_dos.engine.perfmodel import HardwareRates, choose_plan, floor, predict
from lightning_dos.engine.plan import stride_plan
from lightning_dos.profiles import load_profile, save_profile

TWINFLOW_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5)
STRIDES = (2, 3, 4)


def stock_update_s(elements: float, rates: HardwareRates, lp_bytes: int) -> float:
    """Stock ZeRO-3 offload: for each sub-group, CPU Adam, then a CPU cast and a blocking upload; no overlap."""
    return elements * (1 / rates.host_adam_eps + 1 / rates.host_cast_eps + lp_bytes / rates.h2d_bps)


def twinflow_update_s(elements: float, gpu_share: float, rates: HardwareRates, lp_bytes: int) -> float:
    """TwinFlow: a fixed share stays on the GPU, updated there, serially with the host sub-groups."""
    gpu = gpu_share * elements / rates.device_adam_eps if rates.device_adam_eps > 0 else math.inf
    return stock_update_s((1 - gpu_share) * elements, rates, lp_bytes) + gpu


def recipe_parameters(path: str) -> int:
    """Parameters of the model a recipe YAML describes."""
    model = (yaml.safe_load(Path(path).read_text()) or {}).get("model", {})
    args = model.get("init_args", model)
    from lightning_dos.recipes.gpt import GPT

    return GPT.count_parameters(
        int(args.get("n_layer", 4)),
        int(args.get("n_embd", 128)),
        int(args.get("vocab_size", 256)),
        int(args.get("block_size", 128)),
        bool(args.get("tie_embeddings", True)),
    )


def plan_rows(params: int, gpus: int, rates: HardwareRates, meta: dict[str, Any], args: argparse.Namespace) -> dict:
    """Every scheme's predicted update for a model of ``params`` on ``gpus`` ranks."""
    per_rank = params / gpus
    count = max(1, math.ceil(per_rank / args.sub_group_size))
    sizes = [int(per_rank // count)] * count
    lp = args.lp_bytes
    budget = args.budget if args.budget is not None else meta.get("device_free_bytes")
    # (scheme, update seconds, device bytes it holds during the update)
    rows: list[tuple[str, float, float]] = [("stock ZeRO-3 offload", stock_update_s(per_rank, rates, lp), 0)]
    rows += [
        # TwinFlow keeps fp32 param, moments and gradient of its share on the GPU for the whole run.
        (f"TwinFlow ratio {g:.1f}", twinflow_update_s(per_rank, g, rates, lp), 16 * g * per_rank)
        for g in TWINFLOW_RATIOS
    ]
    for k in STRIDES:
        stride = predict(sizes, stride_plan(count, k), rates, lp)
        rows.append((f"paper stride {k}", stride.time_s, stride.peak_device_bytes))
    ours_plan, ours = choose_plan(sizes, rates, budget, lp, allow_resident=True)
    rows.append(("ours (auto)", ours.time_s, ours.peak_device_bytes))
    r_star, t_floor = floor(int(per_rank), rates, lp, budget)
    fwd_bwd = (args.forward_s or 0.0) + (args.backward_s or 0.0)
    table = [
        {
            "scheme": name,
            "update_s": t,
            "update_params_per_s": params / t,
            "iteration_s": fwd_bwd + t if args.forward_s is not None or args.backward_s is not None else None,
            "vs_floor": t / t_floor,
            "device_gb": held / 1e9,
            "fits_budget": budget is None or held <= budget,
        }
        for name, t, held in rows
    ]
    return {
        "params": params,
        "gpus": gpus,
        "sub_groups_per_rank": count,
        "ours": {
            "device_share": ours_plan.device_share(sizes),
            "device_buffers": ours_plan.device_buffers,
            "resident": len(ours_plan.resident_indices),
            "streamed": len(ours_plan.streamed_indices),
        },
        "floor": {"r_star": r_star, "update_s": t_floor, "update_params_per_s": params / t_floor},
        "rows": table,
    }


def _print_plan(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{result['params'] / 1e9:.1f}B params on {result['gpus']} GPU(s), "
        f"{result['sub_groups_per_rank']} sub-groups per rank"
    )
    for column in ("scheme", "update s", "B params/s", "iteration s", "x floor", "GPU GB"):
        table.add_column(column, justify="left" if column == "scheme" else "right")
    for row in result["rows"]:
        iteration = "" if row["iteration_s"] is None else f"{row['iteration_s']:.3f}"
        table.add_row(
            row["scheme"],
            f"{row['update_s']:.3f}",
            f"{row['update_params_per_s'] / 1e9:.2f}",
            iteration,
            f"{row['vs_floor']:.2f}",
        )
    f = result["floor"]
    table.add_row(
        "floor T(r*)", f"{f['update_s']:.3f}", f"{f['update_params_per_s'] / 1e9:.2f}", "", "1.00", end_section=True
    )
    Console().print(table)
    o = result["ours"]
    print(
        f"ours: {o['device_share']:.0%} of elements on the GPU ({o['streamed']} streamed through "
        f"{o['device_buffers']} buffer(s), {o['resident']} resident); floor at r* = {f['r_star']:.2f}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure this machine's rates and write a profile")
    cal.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    cal.add_argument("--out", type=Path, default=Path("profile.yaml"), help="profile file (.yaml or .json)")
    plan = sub.add_parser("plan", help="predict the update phase of each offload scheme")
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="model parameters, e.g. 7e9")
    model.add_argument("--recipe", help="a recipe YAML (its model's parameters are counted)")
    plan.add_argument("--gpus-per-node", type=int, help="ranks the model is partitioned over (default: the profile's)")
    plan.add_argument("--profile", default="paper-h100x4", help="a named profile or a profile file")
    plan.add_argument("--sub-group-size", type=float, default=1e8, help="elements per sub-group")
    plan.add_argument("--lp-bytes", type=int, default=2, choices=(2, 4), help="bytes per model parameter")
    plan.add_argument("--budget", type=float, help="device bytes for the update (default: the profile's free memory)")
    plan.add_argument("--forward-s", type=float, help="forward time, to predict the iteration")
    plan.add_argument("--backward-s", type=float, help="backward time, to predict the iteration")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: list[str]) -> int:
    """Run ``calibrate`` or ``plan`` (``argv`` starts with the subcommand); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "calibrate":
        device = torch.device(args.device)
        rates = calibrate(device)
        path = save_profile(args.out, rates, device=str(device), gpus_per_node=max(1, torch.cuda.device_count()))
        print(f"wrote {path}: {json.dumps(rates.to_dict())}")
        return 0
    try:
        rates, meta = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as error:
        print(f"lightning-dos plan: error: {error}", file=sys.stderr)
        return 2
    if args.sub_group_size <= 0:
        print("lightning-dos plan: error: --sub-group-size must be positive", file=sys.stderr)
        return 2
    args.sub_group_size = int(args.sub_group_size)
    args.budget = int(args.budget) if args.budget is not None else None
    params = int(args.params) if args.params is not None else recipe_parameters(args.recipe)
    gpus = args.gpus_per_node or int(meta.get("gpus_per_node", 1))
    result = plan_rows(params, gpus, rates, meta, args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result)
    return 0
