"""One step's context: what every part of the engine needs for the step under way, built once and handed to each.

The step (``loop.py``) builds a :class:`StepContext` when it begins and passes it to the part it calls: the resident
set, the streamed lane, the host lane, backward's early updates and the recovery. None of them keeps it: what they
do to the step is recorded in it (its report, its progress), and the next step builds a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_dos.engine.atomic import UpdateProgress
from lightning_dos.engine.homes import SlabHomes
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.pool import BufferPool
from lightning_dos.engine.streams import Streams
from lightning_dos.model.plan import Plan, SubGroup
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import Footprint, UpdateRule

#: A test seam: called as ``hook(point, sub_group)`` at named points inside the update (a sub-group's gradient
#: unscaled, its state updated, its download begun, it is done; a resident sub-group's flush home; a speculation).
PointHook = Callable[[str, int], None]


@dataclass
class StepContext:
    """The step under way.

    Attributes:
        plan: where each sub-group is updated (the step replaces it as it fits the plan to the device).
        inputs: what the framework handed the step (its gradient factor may change when backward ends).
        progress: how far each sub-group got (what a recovery reads).
        report: what the step did, filled in as it goes.
        streams: the streams its asynchronous work is issued through.
        homes: where each sub-group's state is (:mod:`~lightning_dos.engine.homes`).
        device_update: the update of a sub-group placed on the device (``kernels.apply_update`` on an accelerator;
            the host's compiled kernel when the device is the host's own CPU).
        on_point: the engine's test seam (None costs nothing).
        timing: whether the step records a span per operation.
    """

    plan: Plan
    inputs: StepInputs
    progress: UpdateProgress
    report: StepReport
    streams: Streams
    homes: SlabHomes
    device_update: Callable[..., None]
    on_point: PointHook | None = None
    timing: bool = False

    def use_plan(self, plan: Plan) -> None:
        """The step now places sub-groups as ``plan`` says (it fitted it to the device, or moved some home)."""
        self.plan = plan
        self.progress.places = plan.places

    def reached(self, point: str, index: int, device_views: tuple[torch.Tensor, ...] | None = None) -> None:
        """Record a sub-group's progress through the update (and call the test seam)."""
        self.progress.reached(point, index, device_views)
        if self.on_point is not None:
            self.on_point(point, index)

    def reached_together(self, points: tuple[str, ...], index: int) -> None:
        """Record several points one operation passed at once, then call the test seam for each: an interruption at
        any of them finds the sub-group's true progress."""
        for point in points:
            self.progress.reached(point, index, None)
        if self.on_point is not None:
            for point in points:
                self.on_point(point, index)


@dataclass(frozen=True)
class UpdateSetup:
    """What the engine's parts share and nothing changes after the engine is built.

    Attributes:
        pool: the engine's buffers (host slabs, staging, resident state).
        streams: the streams all asynchronous work is issued through.
        sub_groups: the engine's sub-groups, by index.
        footprint: bytes per element held and moved, for the rule and dtypes.
        lp_bytes: bytes of one 16-bit (or fp32) model parameter.
        rule: the optimizer's update rule.
        device: the accelerator device.
        lp_downloads: device sub-groups' 16-bit results come down to host-resident 16-bit parameters (DeepSpeed
            offloads parameters).
    """

    pool: BufferPool
    streams: Streams
    sub_groups: Sequence[SubGroup]
    footprint: Footprint
    lp_bytes: int
    rule: UpdateRule
    device: torch.device
    lp_downloads: bool
