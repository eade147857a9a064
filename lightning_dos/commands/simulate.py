"""``lightning-dos simulate``: the engine's real schedule for a model, timed on a virtual node.

The engine runs one plan at test size on the simulated accelerator under the stream-race checker; the
checker's log of what the engine issued (stream, kind, amount, waits, host waits) is replayed through a
discrete-event model of the node (:mod:`lightning_dos.sim.replay`) with sizes scaled to the real model.
The figures are simulated, not measured.

lightning-dos simulate --params 20e9 --profile paper-h100x4
lightning-dos simulate --recipe recipes/gpt-13b.yaml --gpu-fraction stride:2 --trace sim.json
lightning-dos simulate --params 20e9 --master-dtype bf16 --state-dtype bf16
lightning-dos simulate --params 20e9 --forward-s 0.5 --backward-s 1.0
lightning-dos simulate --params 70e9 --nvme-read-gbs 25 --nvme-write-gbs 10 --host-budget 0,0.25,0.5

With --forward-s and --backward-s (seconds per iteration and rank) the whole iteration is timed too, for each
overlap mode: "off" (forward, backward, then the update), "forward" (the next forward beside the update, each
layer after its sub-groups landed), "auto" (the same, and host sub-groups updated during backward as their
gradients become final), and stock ZeRO-3 offload; "forward" and "auto" with the placement that minimises their
own iteration. Each is replayed whole on the virtual node (backward's layers and DeepSpeed's gradient copies,
the engine's update as it issues it, the next forward's layers after the engine's waits) and predicted by the
performance model; --trace also writes each mode's iteration as a trace of its own.

With an NVMe drive (--nvme-read-gbs and --nvme-write-gbs, or the profile's nvme entry) the update is replayed
again for each --host-budget with the state past the budget on a simulated drive (its reads and writes in the
trace's nvme lanes, its staging slabs race-checked), beside the model's prediction and stock ZeRO-3 NVMe offload's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.iteration import Speculation, iteration_floor, mode_iteration_s
from lightning_dos.model.overlap import AUTO, FORWARD, MODES
from lightning_dos.model.perfmodel import (
    HardwareRates,
    Prediction,
    planning_budget,
    predict,
)
from lightning_dos.model.plan import Place, Plan, parse_gpu_fraction, split_into_sub_groups
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.sim.logged_step import (
    SIM_ELEMENTS,
    copy_bytes,
    engine_log,
    rescale_copies,
    sizes_at_test_scale,
    steady_step,
)
from lightning_dos.sim.replay import ReplayResult, replay, write_perfetto
from lightning_dos.sim.sanitizer import LoggedOp
from lightning_dos.sim.timed_iteration import TimedIteration


@dataclass
class Simulation:
    """One plan's replayed update beside the performance model's prediction.

    Attributes:
        plan: the placement replayed.
        sizes: the real sub-group sizes.
        replayed: the virtual node's account of the engine's logged schedule.
        predicted: :func:`~lightning_dos.model.perfmodel.predict` for the same plan.
        races: stream races the checker found while the schedule was logged (should be none).
        footprint: the optimizer's rule and dtypes simulated.
    """

    plan: Plan
    sizes: list[int]
    replayed: ReplayResult
    predicted: Prediction
    races: int
    footprint: Footprint = ADAM_FP32

    @property
    def ratio(self) -> float:
        """Replayed over predicted update time."""
        return self.replayed.time_s / self.predicted.time_s


def replay_iteration(
    problem: UpdateProblem, plan: Plan, phases: TrainingPhases, clipped: bool | None = None
) -> tuple[ReplayResult, int]:
    """One steady-state iteration of ``problem``'s update under overlap ``phases.mode`` (``off``, ``forward`` or
    ``auto``: the update begun during backward; with ``clipped`` not None, speculatively, the step clipped or not)
    replayed whole on the node ``problem.rates`` describes: backward, the engine's update of ``plan`` as it issues it,
    and the next forward (:class:`~lightning_dos.sim.timed_iteration.TimedIteration`); return the replay, its time
    from the start of backward to the end of the next forward and the update, and the races found."""
    sizes, rates, lp_bytes, footprint = problem.sizes, problem.rates, problem.lp_bytes, problem.footprint
    scale = max(sizes) / SIM_ELEMENTS
    expected = copy_bytes(plan, sizes_at_test_scale(sizes, scale), footprint, lp_bytes, lp_downloads=False)

    def replayed(log: list[LoggedOp]) -> ReplayResult:
        return replay(rescale_copies(log, expected)[0], rates, scale, footprint=footprint)

    host = {i for i, place in enumerate(plan.places) if place == Place.HOST}
    checker = TimedIteration(sizes, scale, phases.forward_s, phases.backward_s, lp_bytes, host, replayed)
    log = steady_step(checker, sizes, plan, lp_bytes, scale, footprint, overlap=phases.mode, clipped=clipped)
    return replay(log, rates, scale, footprint=footprint), len(checker.races)


def simulate(
    sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int, *, footprint: Footprint = ADAM_FP32
) -> Simulation:
    """Replay the engine's schedule for ``plan`` over sub-groups of ``sizes`` on the node ``rates`` describes,
    for the optimizer rule and dtypes of ``footprint``."""
    log, scale, races = engine_log(sizes, plan, lp_bytes, footprint=footprint)
    replayed = replay(log, rates, scale, footprint=footprint)
    predicted = predict(sizes, plan, rates, lp_bytes, footprint=footprint)
    return Simulation(plan, list(sizes), replayed, predicted, races, footprint)


def whole_iteration(
    result: Simulation,
    rates: HardwareRates,
    lp_bytes: int,
    forward_s: float,
    backward_s: float,
    *,
    speculation: Speculation | None = None,
    trace: Path | None = None,
    resident_room: int = 0,
    plan_for: Callable[[str], Plan] | None = None,
) -> dict[str, Any]:
    """Iteration seconds per overlap mode for ``result``'s sub-groups and optimizer (its sizes and footprint),
    replayed whole (:func:`replay_iteration`: backward, the engine's update as it issues it and the next forward on
    the virtual node's streams) and predicted (the performance model). ``off`` runs ``result``'s plan (the update's
    best); ``forward`` and ``auto`` the plan the strategy runs in that mode once it has measured forward and
    backward, ``plan_for(mode)`` (None: ``result``'s plan in every mode, as a fixed ``gpu_fraction`` runs); ``stock``
    is stock ZeRO-3 offload's update after forward and backward. With ``trace``, each mode's replay is written beside
    it as a Perfetto trace (``<trace stem>-iteration-<mode><suffix>``, its path in the mode's ``iteration_plans``
    entry). ``iteration_floor_s`` is what no placement or schedule could beat
    (:func:`~lightning_dos.model.iteration.iteration_floor`, resident state up to ``resident_room`` bytes, a
    speculative update's write-allocate charged). With ``speculation`` (gradient clipping), ``auto`` is replayed
    committed and clipped and the two are weighed by its commit rate (at 0 the engine stops speculating:
    ``forward``'s replay); ``speculation_bytes`` is the host memory its spare slots take (one per host sub-group it
    may update during backward)."""
    from lightning_dos.commands.plan import stock_update_s

    sizes, footprint = result.sizes, result.footprint
    problem = UpdateProblem(sizes, rates, lp_bytes, footprint)
    replayed, predicted, plans = {}, {}, {}
    for mode in MODES:
        plan = result.plan if plan_for is None else plan_for(mode)
        phases = TrainingPhases(forward_s, backward_s, mode)
        run, races = replay_iteration(problem, plan, phases)
        replayed[mode] = run.time_s
        if mode == AUTO and speculation is not None:
            rate, run = speculation.commit_rate, None
            if rate == 0.0:  # the commit policy stops speculating: "auto"'s plan runs as "forward" runs
                run, races = replay_iteration(problem, plan, phases.in_mode(FORWARD))
                replayed[mode] = run.time_s
            else:
                committed, races = replay_iteration(problem, plan, phases, clipped=False)
                redone, more = replay_iteration(problem, plan, phases, clipped=True) if rate < 1 else (None, 0)
                replayed[mode] = rate * committed.time_s + (1 - rate) * (redone.time_s if redone else 0.0)
                races, run = races + more, committed
        predicted[mode] = mode_iteration_s(problem, plan, phases, speculation=speculation)
        streamed = plan.streamed_indices
        plans[mode] = {
            "streamed": len(streamed),
            "streamed_first": bool(streamed) and streamed[0] == plan.sequence[0],
            "after_backward": len(plan.after_backward) if mode == "auto" else 0,
            "races": races,
        }
        if trace is not None and run is not None:
            plans[mode]["trace"] = str(trace.with_name(f"{trace.stem}-iteration-{mode}{trace.suffix}"))
            title = f"one iteration, overlap={mode}, forward {forward_s:g} s + backward {backward_s:g} s"
            write_perfetto(plans[mode]["trace"], run, title)
    stock = forward_s + backward_s + stock_update_s(sum(sizes), rates, lp_bytes, footprint=footprint)
    speculative = {}
    if speculation is not None:
        auto_plan_run = result.plan if plan_for is None else plan_for(AUTO)
        slots = len(set(auto_plan_run.host_indices) - auto_plan_run.after_backward)
        speculative = {
            "commit_rate": speculation.commit_rate,
            "speculation_bytes": slots * max(sizes) * (footprint.optimizer_state + lp_bytes),
        }
    return {
        **speculative,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "forward_backward_s": forward_s + backward_s,
        "iteration_s": {**replayed, "stock": stock},
        "iteration_predicted_s": {**predicted, "stock": stock},
        "iteration_floor_s": iteration_floor(
            problem,
            forward_s,
            backward_s,
            resident_room=resident_room,
            speculation=speculation,
            order=result.plan.order,
        ),
        "iteration_plans": plans,
    }


def sub_group_sizes(params: int, gpus: int, sub_group_size: int) -> list[int]:
    """Per-rank sub-group sizes, cut as ``lightning-dos plan`` and the engine cut them."""
    per_rank = params // gpus
    return [sg.numel for sg in split_into_sub_groups([per_rank], [0], sub_group_size)]


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
    from lightning_dos.commands.options import add_model_options

    parser = argparse.ArgumentParser(
        prog="lightning-dos simulate", description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from lightning_dos.commands.nvme_rows import add_nvme_options

    add_model_options(parser)
    add_nvme_options(parser)
    parser.add_argument("--gpu-fraction", default="auto", help="'auto', a number in [0, 1], or 'stride:K'")
    parser.add_argument(
        "--trace", type=Path, default=Path("runs/simulate/trace.json"), help="Perfetto trace to write (JSON)"
    )
    return parser


def _fail(message: str) -> int:
    print(f"lightning-dos simulate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """Run ``lightning-dos simulate`` (``argv`` without the subcommand); returns the exit status."""
    from lightning_dos.commands import options
    from lightning_dos.commands.nvme_rows import disk_of, host_budgets
    from lightning_dos.commands.recipe_order import model_layout
    from lightning_dos.commands.simulate_table import print_summary
    from lightning_dos.planning.profiles import load_profile

    args = _parser().parse_args(argv)
    try:
        footprint = options.footprint_of(args.optimizer, args.master_dtype, args.state_dtype)
        rates, meta = load_profile(args.profile)
        spec = parse_gpu_fraction(args.gpu_fraction)
    except (FileNotFoundError, ValueError) as error:
        return _fail(str(error))
    if rates.device_adam_eps <= 0 or rates.shared_cpu:
        return _fail(f"profile {args.profile!r} has no accelerator to simulate (device_adam_eps is 0 or shared_cpu)")
    params = int(args.params) if args.params is not None else options.recipe_parameters(args.recipe)
    if params <= 0:
        return _fail("--params must be positive")
    gpus = args.gpus_per_node or int(meta.get("gpus_per_node", 1))
    try:
        sub_group_size = options.sub_group_size_of(args.sub_group_size, params // gpus)
        speculation = options.speculation_option(args, footprint)
        disk = disk_of(args, meta)
        budgets = host_budgets(args.host_budget)
    except ValueError as error:
        return _fail(str(error))
    phases = (args.forward_s, args.backward_s)
    if (phases[0] is None) != (phases[1] is None):
        return _fail("--forward-s and --backward-s go together: give both, or neither")
    if phases[0] is not None and not all(math.isfinite(t) and t > 0 for t in phases):
        return _fail(f"--forward-s and --backward-s must be positive seconds, got {phases[0]} and {phases[1]}")
    budget, resident_ok = planning_budget(
        int(args.budget) if args.budget is not None else None, meta.get("device_free_bytes")
    )
    sizes, order = model_layout(args, params, gpus, sub_group_size)

    def plan_for(mode: str | None = None) -> Plan:
        """What the strategy runs: "auto"'s plan (in ``mode``, once forward and backward are timed), else the fixed
        plan of ``--gpu-fraction``; either in the order the recipe's forward needs the sub-groups."""
        if spec.mode != "auto":
            return spec.plan(len(sizes)).in_order(order)
        chosen = auto_plan(
            sizes, rates, args.lp_bytes, budget, allow_resident=resident_ok, footprint=footprint,
            phases=None if mode is None else (args.forward_s, args.backward_s), overlap=mode or "off",
            speculation=speculation if mode == AUTO else None, order=order,
        )  # fmt: skip
        return chosen.plan

    plan = plan_for()
    result = simulate(sizes, plan, rates, args.lp_bytes, footprint=footprint)
    trace = write_perfetto(args.trace, result.replayed, f"{params / 1e9:.1f}B on {args.profile}")
    summary = _summary(result, params, gpus, args.profile, trace)
    summary.update(options.footprint_summary(args, footprint), precision=options.footprint_label(args))
    summary["need_order"] = list(order) or None  # None: index order (no model to record)
    summary["budget_gb"] = None if budget is None else budget / 1e9
    summary["budget_kind"] = "forward/backward peak" if resident_ok else "update only"
    if args.forward_s is not None:
        summary.update(
            whole_iteration(
                result,
                rates,
                args.lp_bytes,
                args.forward_s,
                args.backward_s,
                trace=trace,
                resident_room=budget if resident_ok and budget else 0,
                plan_for=plan_for,
                speculation=speculation,
            )
        )
    summary["nvme"] = None
    if disk is not None:
        from lightning_dos.commands.nvme_rows import NvmeCase
        from lightning_dos.commands.simulate_nvme import nvme_simulation

        case = NvmeCase(sizes, plan, rates, disk, budgets, gpus, args.lp_bytes, footprint)
        summary["nvme"] = nvme_simulation(case, trace=args.trace)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
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
        "held_between_updates_bytes": result.footprint.device
        * sum(result.sizes[i] for i in result.plan.resident_indices),
        "update_s": r.time_s,
        "predicted_s": p.time_s,
        "replay_over_prediction": result.ratio,
        "busy_share": r.busy_share(),
        "h2d_bytes": r.h2d_bytes,
        "d2h_bytes": r.d2h_bytes,
        "races": result.races,
        "trace": str(trace),
    }
