"""The plan ``gpu_fraction="auto"`` runs, computed once for every caller: the strategy's scheduler, ``lightning-dos
plan`` and ``lightning-dos simulate`` all ask here, so what they show is what the strategy would run.

First the plan that minimises the update alone within the device budget (:func:`~lightning_dos.model.perfmodel.
choose_plan`: streaming only by default, resident sub-groups too within an explicit ``gpu_memory_budget``); then,
once forward and backward have been timed, the placement whose predicted iteration under the overlap mode is
shortest (:func:`~lightning_dos.model.iteration_plan.shortest_iteration_plan`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dos.model.iteration import Speculation, mode_iteration_s
from lightning_dos.model.iteration_plan import shortest_iteration_plan
from lightning_dos.model.overlap import AUTO, FORWARD, OFF, Overlap
from lightning_dos.model.perfmodel import HardwareRates, Prediction
from lightning_dos.model.plan import Plan
from lightning_dos.model.plan_search import choose_plan
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.model.update_rules import ADAM_FP32, Footprint


@dataclass(frozen=True)
class AutoPlan:
    """What ``"auto"`` runs, and why.

    Attributes:
        update_plan: the plan that minimises the update alone (what runs before forward and backward are timed).
        update: the performance model's prediction of ``update_plan``'s update.
        plan: the plan that runs: ``update_plan``, or once the phases are known the shortest iteration's.
        iteration_s: the predicted iteration of ``plan`` under the overlap mode; None without phases.
    """

    update_plan: Plan
    update: Prediction
    plan: Plan
    iteration_s: float | None


def auto_plan(
    sizes: Sequence[int],
    rates: HardwareRates,
    lp_bytes: int,
    budget: int | None,
    *,
    allow_resident: bool = False,
    lp_on_host: bool = False,
    footprint: Footprint = ADAM_FP32,
    phases: tuple[float, float] | None = None,
    overlap: Overlap = OFF,
    speculation: Speculation | None = None,
    order: Sequence[int] = (),
) -> AutoPlan:
    """The plan ``gpu_fraction="auto"`` runs for sub-groups of ``sizes``.

    Args:
        sizes: elements of each sub-group of the rank's partition.
        rates: the hardware rates (calibrated, agreed by the ranks, or a profile's).
        lp_bytes: bytes per element of the 16-bit (or fp32) model parameters.
        budget: device bytes the update may use (None: no limit): the memory free at the update by default, an
            explicit ``gpu_memory_budget`` when ``allow_resident``.
        allow_resident: sub-groups may stay on the device between steps (only within an explicit budget).
        lp_on_host: the 16-bit parameters live on the host (parameter offload): the iteration model does not apply.
        footprint: the optimizer's rule and dtypes.
        phases: measured (forward, backward) seconds; None before they are known.
        overlap: what the update overlaps (:mod:`lightning_dos.model.overlap`).
        speculation: gradient clipping under ``auto`` (the updates begun during backward are speculative): the
            placement and its iteration are those of the mean over committed and clipped steps at its commit rate.
        order: the sub-groups in the order the next forward needs them (``Plan.order``; empty: index order): the
            engine works and lands them in it, and the iteration model times the forward and backward by it.
    """
    update_plan, update = _update_best(tuple(sizes), rates, budget, lp_bytes, allow_resident, lp_on_host, footprint)
    update_plan = update_plan.in_order(order)
    if phases is None or min(phases) <= 0 or lp_on_host:
        return AutoPlan(update_plan, update, update_plan, None)
    problem, training = UpdateProblem(sizes, rates, lp_bytes, footprint), TrainingPhases(*phases, overlap)
    # A commit rate of 0 stops speculation (the engine's commit policy): the update then overlaps the next forward.
    searched = FORWARD if overlap == AUTO and speculation is not None and speculation.commit_rate == 0 else overlap
    plan = shortest_iteration_plan(
        problem, update_plan, training.in_mode(searched), speculation=speculation, budget=budget
    )
    predicted = mode_iteration_s(problem, plan, training, speculation=speculation)
    return AutoPlan(update_plan, update, plan, predicted)


@functools.lru_cache(maxsize=16)
def _update_best(
    sizes: tuple[int, ...],
    rates: HardwareRates,
    budget: int | None,
    lp_bytes: int,
    allow_resident: bool,
    lp_on_host: bool,
    footprint: Footprint,
) -> tuple[Plan, Prediction]:
    # The search takes seconds at 50 sub-groups; plan and simulate ask the same question once per overlap mode.
    return choose_plan(
        sizes, rates, budget, lp_bytes, allow_resident=allow_resident, lp_on_host=lp_on_host, footprint=footprint
    )
