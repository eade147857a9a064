"""``lightning-dos simulate``: the engine's real schedule for a model, timed on a virtual node.

The engine runs one plan at test size on the simulated accelerator under the stream-race checker; the
checker's log of what the engine issued (stream, kind, amount, waits, host waits) is replayed through a
discrete-event model of the node (:mod:`lightning_dos.sim.replay`) with sizes scaled to the real model.
The figures are simulated, not measured.

lightning-dos simulate --params 20e9 --profile paper-h100x4
lightning-dos simulate --recipe recipes/gpt-13b.yaml --gpu-fraction stride:2 --trace sim.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_dos.engine.kernels import AdamHyper
from lightning_dos.engine.loop import InterleavedAdam, StepInputs
from lightning_dos.engine.perfmodel import (
    DEVICE_BYTES,
    HardwareRates,
    Prediction,
    choose_plan,
    planning_budget,
    predict,
)
from lightning_dos.engine.plan import Plan, parse_gpu_fraction, split_into_sub_groups
from lightning_dos.sim.replay import ReplayResult, replay, write_perfetto
from lightning_dos.sim.sanitizer import StreamSanitizer

#: Elements per sub-group in the test-sized run that is logged (the replay scales it to the real size).
SIM_ELEMENTS = 64


@dataclass
class Simulation:
    """One plan's replayed update beside the performance model's prediction.

    Attributes:
        plan: the placement replayed.
        sizes: the real sub-group sizes.
        replayed: the virtual node's account of the engine's logged schedule.
        predicted: :func:`~lightning_dos.engine.perfmodel.predict` for the same plan.
        races: stream races the checker found while the schedule was logged (should be none).
    """

    plan: Plan
    sizes: list[int]
    replayed: ReplayResult
    predicted: Prediction
    races: int

    @property
    def ratio(self) -> float:
        """Replayed over predicted update time."""
        return self.replayed.time_s / self.predicted.time_s


def engine_log(
    sizes: Sequence[int], plan: Plan, lp_bytes: int, sim_elements: int = SIM_ELEMENTS
) -> tuple[list, float, int]:
    """Run ``plan`` at test size under the checker; return the log of a steady-state step, the scale from
    test size to ``sizes``, and the number of races found."""
    scale = max(sizes) / sim_elements
    small = [max(1, round(n / scale)) for n in sizes]
    checker = StreamSanitizer()
    engine = InterleavedAdam(
        small,
        [0] * len(small),
        max(small),
        torch.device("cpu"),
        torch.bfloat16 if lp_bytes == 2 else torch.float32,
        streams=checker.streams(),
    )
    checker.watch(engine)
    hyper = [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]
    grads = [torch.zeros(n) for n in small]
    lp = [torch.zeros(n, dtype=engine.lp_dtype) for n in small]
    for step in (1, 2):  # the first step brings resident state up; the second is the steady state replayed
        checker.log.clear()
        engine.step(plan, StepInputs(grads, lp, hyper * len(small), [step] * len(small)))
    return list(checker.log), scale, len(checker.races)


def simulate(sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int) -> Simulation:
    """Replay the engine's schedule for ``plan`` over sub-groups of ``sizes`` on the node ``rates`` describes."""
    log, scale, races = engine_log(sizes, plan, lp_bytes)
    return Simulation(plan, list(sizes), replay(log, rates, scale), predict(sizes, plan, rates, lp_bytes), races)


def sub_group_sizes(params: int, gpus: int, sub_group_size: int) -> list[int]:
    """Per-rank sub-group sizes, cut as ``lightning-dos plan`` and the engine cut them."""
    per_rank = params // gpus
    return [sg.numel for sg in split_into_sub_groups([per_rank], [0], sub_group_size)]


def auto_plan(
    sizes: Sequence[int], rates: HardwareRates, lp_bytes: int, budget: int | None, allow_resident: bool = False
) -> Plan:
    """The plan ``gpu_fraction="auto"`` chooses within ``budget`` device bytes (None: no limit), as the strategy
    and ``lightning-dos plan`` choose it: streaming only by default (``budget`` then being the memory free after
    backward, less 10%), resident sub-groups too with ``allow_resident`` (``budget`` then being an explicit
    ``gpu_memory_budget``, memory spare at the forward/backward peak)."""
    return _auto_plan(tuple(sizes), rates, lp_bytes, budget, allow_resident)


@functools.lru_cache(maxsize=16)
def _auto_plan(
    sizes: tuple[int, ...], rates: HardwareRates, lp_bytes: int, budget: int | None, allow_resident: bool
) -> Plan:
    # The search takes seconds at 50 sub-groups; the same question is asked again by tests and repeated runs.
    return choose_plan(sizes, rates, budget, lp_bytes, allow_resident=allow_resident)[0]


def _description() -> str:
    """The module's docstring for ``--help``: paragraphs and example lines wrapped to 80 columns."""
    text = (__doc__ or "").replace(":mod:", "").strip()
    example = functools.partial(textwrap.fill, width=80, break_on_hyphens=False, subsequent_indent="    ")
    return "\n\n".join(
        "\n".join(map(example, part.splitlines()))
        if part.startswith("lightning-dos ")
        else textwrap.fill(" ".join(part.split()), 80)
        for part in text.split("\n\n")
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dos simulate", description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="model parameters, e.g. 20e9")
    model.add_argument("--recipe", help="a recipe YAML (its model's parameters are counted)")
    parser.add_argument("--profile", default="paper-h100x4", help="a named profile or a profile file")
    parser.add_argument("--gpu-fraction", default="auto", help="'auto', a number in [0, 1], or 'stride:K'")
    parser.add_argument(
        "--gpus-per-node", type=int, help="ranks the model is partitioned over (default: the profile's)"
    )
    parser.add_argument("--sub-group-size", type=float, default=1e8, help="elements per sub-group")
    parser.add_argument("--lp-bytes", type=int, default=2, choices=(2, 4), help="bytes per model parameter")
    parser.add_argument(
        "--budget",
        type=float,
        help="device bytes per rank spare at the forward/backward peak, as the strategy's gpu_memory_budget "
        "('auto' may then keep sub-groups resident in it). Default: what the strategy does without one, nothing "
        "resident and the update's buffers in the profile's free memory after backward, less 10%%",
    )
    parser.add_argument(
        "--trace", type=Path, default=Path("runs/simulate/trace.json"), help="Perfetto trace to write (JSON)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _fail(message: str) -> int:
    print(f"lightning-dos simulate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """Run ``lightning-dos simulate`` (``argv`` without the subcommand); returns the exit status."""
    from lightning_dos.planner import recipe_parameters
    from lightning_dos.profiles import load_profile

    args = _parser().parse_args(argv)
    try:
        rates, meta = load_profile(args.profile)
        spec = parse_gpu_fraction(args.gpu_fraction)
    except (FileNotFoundError, ValueError) as error:
        return _fail(str(error))
    if rates.device_adam_eps <= 0 or rates.shared_cpu:
        return _fail(f"profile {args.profile!r} has no accelerator to simulate (device_adam_eps is 0 or shared_cpu)")
    if args.sub_group_size <= 0:
        return _fail("--sub-group-size must be positive")
    params = int(args.params) if args.params is not None else recipe_parameters(args.recipe)
    if params <= 0:
        return _fail("--params must be positive")
    gpus = args.gpus_per_node or int(meta.get("gpus_per_node", 1))
    budget, resident_ok = planning_budget(
        int(args.budget) if args.budget is not None else None, meta.get("device_free_bytes")
    )
    sizes = sub_group_sizes(params, gpus, int(args.sub_group_size))
    if spec.mode == "auto":
        plan = auto_plan(sizes, rates, args.lp_bytes, budget, allow_resident=resident_ok)
    else:
        plan = spec.plan(len(sizes))
    result = simulate(sizes, plan, rates, args.lp_bytes)
    trace = write_perfetto(args.trace, result.replayed, f"{params / 1e9:.1f}B on {args.profile}")
    summary = _summary(result, params, gpus, args.profile, trace)
    summary["budget_gb"] = None if budget is None else budget / 1e9
    summary["budget_kind"] = "forward/backward peak" if resident_ok else "update only"
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print(summary)
    return 0


def _summary(result: Simulation, params: int, gpus: int, profile: str, trace: Path) -> dict[str, Any]:
    r, p = result.replayed, result.predicted
    return {
        "simulated": True,
        "params": params,
        "gpus": gpus,
        "profile": profile,
        "sub_groups_per_rank": len(result.sizes),
        "plan": {
            "streamed": len(result.plan.streamed_indices),
            "resident": len(result.plan.resident_indices),
            "host": len(result.plan.host_indices),
            "device_buffers": result.plan.device_buffers,
        },
        # Device bytes during the update (predicted), and of them those held through forward and backward.
        "update_device_bytes": p.peak_device_bytes,
        "held_between_updates_bytes": DEVICE_BYTES * sum(result.sizes[i] for i in result.plan.resident_indices),
        "update_s": r.time_s,
        "predicted_s": p.time_s,
        "replay_over_prediction": result.ratio,
        "busy_share": r.busy_share(),
        "h2d_bytes": r.h2d_bytes,
        "d2h_bytes": r.d2h_bytes,
        "races": result.races,
        "trace": str(trace),
    }


def _print(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)  # wraps at the terminal's width, or COLUMNS, or 80 in a pipe or a log file
    plan = s["plan"]
    budget = s.get("budget_gb")
    if budget is not None and s.get("budget_kind") == "update only":
        memory = (
            f"default settings: nothing resident, the update's buffers within {budget:.1f} GB "
            "(free after backward, less 10%)"
        )
    elif budget is not None:
        memory = f"--budget {budget:.1f} GB spare at the forward/backward peak: resident state and the update's buffers"
    else:
        memory = "no device memory limit"
    console.print(
        f"SIMULATED (not measured): {s['params'] / 1e9:.1f}B params on {s['gpus']} rank(s), profile {s['profile']}\n"
        f"per rank: {s['sub_groups_per_rank']} sub-groups, {plan['streamed']} streamed through "
        f"{plan['device_buffers']} buffer(s), {plan['resident']} resident, {plan['host']} on the host\n"
        f"device memory: {memory}",
        markup=False,
    )
    table = Table(title="the engine's schedule on a virtual node")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("update s (engine schedule replayed)", f"{s['update_s']:.3f}")
    table.add_row("update s (perfmodel.predict)", f"{s['predicted_s']:.3f}")
    table.add_row("replay / prediction", f"{s['replay_over_prediction']:.3f}")
    for lane, share in s["busy_share"].items():
        table.add_row(f"busy share: {lane}", f"{share:.0%}")
    table.add_row("GB host->device", f"{s['h2d_bytes'] / 1e9:.2f}")
    table.add_row("GB device->host", f"{s['d2h_bytes'] / 1e9:.2f}")
    table.add_row("GB on the GPU during the update", f"{s['update_device_bytes'] / 1e9:.2f}")
    table.add_row("GB held through forward and backward", f"{s['held_between_updates_bytes'] / 1e9:.2f}")
    table.add_row("stream races found", str(s["races"]))
    console.print(table)
    console.print(f"trace: {s['trace']} (open in https://ui.perfetto.dev)", markup=False)
