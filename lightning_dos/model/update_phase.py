"""The update phase as the trainer waits for it: the step's own work, and the engine's update loop where the step
waits for that loop.

Between the end of backward and the end of the batch (what ``DOSMonitor`` logs as ``dos/update_s``) the trainer runs
DeepSpeed's step: its prologue (the overflow check, the gradient norm), the engine's update loop, its epilogue, then
Lightning's bookkeeping of the step. Under ``overlap="off"`` the step returns once the engine's loop is over, so the
phase holds the whole loop. Under ``"forward"`` and ``"auto"`` the step returns once the loop is started on the
engine's thread (or, begun during backward, told to go on), so the phase holds none of it: what the update adds to the
iteration then shows in the next forward, whose gathers wait for sub-groups still being updated, and before the next
backward, which waits for the rest (:func:`~lightning_dos.model.iteration.iteration_s` predicts both).

The step's own work is DeepSpeed's and Lightning's, not the optimizer's: the performance model has no term for it
(it depends on the framework's Python, not on the hardware's rates), so it is measured
(:class:`~lightning_dos.planning.estimator.OwnTimeEstimator`). Pure arithmetic.
"""

from __future__ import annotations

from lightning_dos.model.overlap import check_overlap, overlaps_forward


def _loop_in_phase(overlap: str) -> bool:
    """Whether the update phase holds the engine's update loop (``"off"`` only; ValueError for no mode)."""
    return not overlaps_forward(check_overlap(overlap))


def update_phase_s(overlap: str, engine_update_s: float, own_s: float) -> float:
    """The update phase's predicted length: the step's own work (``own_s``, DeepSpeed's and Lightning's) and, under
    ``overlap="off"``, the engine's update loop (``engine_update_s``, the performance model's prediction of it)."""
    return own_s + (engine_update_s if _loop_in_phase(overlap) else 0.0)


def own_time_s(overlap: str, phase_s: float, engine_update_s: float) -> float:
    """What a measured update phase says the step's own work took: the phase less the engine's measured loop where
    the phase holds it (never below zero: the loop's clock and the phase's are not the same clock on a GPU)."""
    return max(0.0, phase_s - (engine_update_s if _loop_in_phase(overlap) else 0.0))
