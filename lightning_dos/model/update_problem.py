"""What the iteration model, the planner and the simulator are asked about, as two values instead of seven arguments.

An :class:`UpdateProblem` is the optimizer update to place and time, whatever the placement: the rank's sub-groups,
the node they run on, the bytes of the 16-bit parameters and the optimizer's footprint. :class:`TrainingPhases` is the
iteration around it: forward and backward alone, and how the update overlaps them. Every function that times,
searches or replays a whole iteration takes the two (:func:`~lightning_dos.model.iteration.mode_iteration_s`,
:func:`~lightning_dos.model.iteration_plan.shortest_iteration_plan`, the simulator's ``replay_iteration``), so what one
caller timed is what the next searches and replays. Pure values: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dos.model.overlap import MODES
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.update_rules import ADAM_FP32, Footprint


@dataclass(frozen=True)
class UpdateProblem:
    """One rank's optimizer update, before it is placed.

    Attributes:
        sizes: elements of each sub-group of the rank's partition, in index order (kept as a tuple, whatever
            sequence is given: a problem is a value, equal to and hashed like any other of the same update).
        rates: what the node's hardware does per second (calibrated, agreed by the ranks, or a profile's).
        lp_bytes: bytes per element of the 16-bit (or fp32) model parameters the update writes back.
        footprint: the optimizer's rule and dtypes: bytes moved and held per element, update rates as
            :func:`~lightning_dos.model.perfmodel.rates_for` scales them.
    """

    sizes: Sequence[int]
    rates: HardwareRates
    lp_bytes: int
    footprint: Footprint = ADAM_FP32

    def __post_init__(self) -> None:
        # Callers hold sizes as lists (a recipe's partition, a JSON run): frozen means the copy is taken once, here.
        object.__setattr__(self, "sizes", tuple(self.sizes))


@dataclass(frozen=True)
class TrainingPhases:
    """The training thread's work around the update, and how the update overlaps it.

    Attributes:
        forward_s: one forward alone, seconds (measured, or given to ``plan`` and ``simulate``).
        backward_s: one backward alone, seconds.
        mode: the overlap mode, one of :data:`~lightning_dos.model.overlap.MODES` (``off``: the update after
            backward; ``forward``: beside the next forward; ``auto``: begun during backward as well).
    """

    forward_s: float
    backward_s: float
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def in_mode(self, mode: str) -> TrainingPhases:
        """The same forward and backward, the update overlapping them as ``mode`` does."""
        return TrainingPhases(self.forward_s, self.backward_s, mode)
