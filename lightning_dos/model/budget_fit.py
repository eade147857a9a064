"""Shrinking a plan until its device side fits a memory budget, one trim at a time (pure arithmetic: the engine
calls it with the budget it measured just before an update, :meth:`~lightning_dos.engine.loop.InterleavedUpdate.
fit_to_budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_dos.model.perfmodel import HardwareRates, device_bytes, predict
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import Footprint


def useful_buffers(plan: Plan) -> Plan:
    """``plan`` with no more staging buffers than it streams sub-groups (at least one)."""
    return replace(plan, device_buffers=max(1, min(plan.device_buffers, len(plan.streamed_indices))))


def plan_device_bytes(sizes: Sequence[int], plan: Plan, buffers: int, footprint: Footprint, lp_slot: int) -> int:
    """Device memory ``plan`` needs during the update with ``buffers`` staging buffers: resident state, streaming
    buffers and one sub-group's temporaries (:func:`~lightning_dos.model.perfmodel.device_bytes`)."""
    return device_bytes(sizes, replace(plan, device_buffers=buffers), footprint=footprint, lp_slot=lp_slot)


def fit_to_budget(
    sizes: Sequence[int],
    plan: Plan,
    budget: int | None,
    *,
    footprint: Footprint,
    lp_bytes: int,
    lp_downloads: bool,
    rates: HardwareRates | None,
) -> Plan:
    """Shrink ``plan``'s device side until it fits ``budget`` bytes (None: no limit), one trim at a time.

    Each trim is one of: a streaming buffer fewer, the largest streamed sub-groups to the host, the largest resident
    sub-group to the host. With calibrated ``rates`` the trim the performance model predicts to be fastest is taken
    (one buffer serialises upload, update and download, which can cost more than updating a sub-group on the host);
    without them, buffers go first. ``lp_downloads``: the 16-bit parameters live on the host, so each device
    sub-group's 16-bit result needs a device slot of ``lp_bytes`` per element too."""
    if budget is None or not plan.device_indices:
        return plan
    lp_slot = lp_bytes if lp_downloads else 0
    plan = useful_buffers(plan)

    def predicted_s(candidate: Plan) -> float:
        return predict(sizes, candidate, rates, lp_bytes, lp_downloads, footprint=footprint).time_s

    while plan.device_indices and plan_device_bytes(sizes, plan, plan.device_buffers, footprint, lp_slot) > budget:
        trims = _trims(sizes, plan)
        plan = min(trims, key=predicted_s) if rates is not None and len(trims) > 1 else trims[0]
    return plan


def _trims(sizes: Sequence[int], plan: Plan) -> list[Plan]:
    """The ways to shrink ``plan``'s device memory by one step; each needs strictly less."""
    trims = []
    if plan.device_buffers > 1:  # useful buffers only (see useful_buffers), so one fewer is smaller
        trims.append(replace(plan, device_buffers=plan.device_buffers - 1))
    streamed = plan.streamed_indices
    if streamed:
        largest = max(sizes[i] for i in streamed)
        trims.append(plan.with_host([i for i in streamed if sizes[i] == largest]))
    if plan.resident_indices:
        trims.append(plan.with_host([max(plan.resident_indices, key=lambda i: sizes[i])]))
    return [useful_buffers(t) for t in trims]
