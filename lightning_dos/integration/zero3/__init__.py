"""The ZeRO-3 adapter: the one place that touches DeepSpeed's private ZeRO-3 optimizer attributes.

DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3.step`` runs a prologue (partition parameters, overflow
check, gradient norm, loss-scale update), then updates sub-groups one after another on the CPU with a
blocking cast and copy each, then an epilogue. The adapter keeps DeepSpeed's prologue and epilogue
and replaces the loop in between with the engine. It also moves the fp32 master weights and the optimizer's
state into the engine's pinned slabs, as views that DeepSpeed's own checkpointing still finds in
their usual places, so a DeepSpeed checkpoint holds the engine's state and reloads into it.

Everything here is checked at start-up (``compat.py``): a DeepSpeed release that renamed any of it fails with an
error naming the version, before the first step. Its jobs, each a module: ``adapter.py`` (the adapter and its
step), ``gathers.py`` (the next forward's all-gathers), ``backward.py`` (backward's hooks and phases),
``state_access.py`` (DeepSpeed's state as views of the engine's slabs), ``kept_files.py`` (the NVMe tier's state
read after fit), ``evaluation.py`` (weights for evaluation).
"""

from lightning_dos.integration.zero3.adapter import Planner, ZeRO3Adapter
from lightning_dos.integration.zero3.backward import MEASURE_PHASES_EVERY
from lightning_dos.integration.zero3.compat import (
    OPTIONAL_ATTRIBUTES,
    REQUIRED_ATTRIBUTES,
    TESTED_DEEPSPEED,
    DeepSpeedIncompatibleError,
    backward_overlap_blocker,
    check_zero3_optimizer,
    engine_device,
    speculation_reason,
)
from lightning_dos.integration.zero3.evaluation import load_zero3_weights_for_evaluation

__all__ = [
    "MEASURE_PHASES_EVERY",
    "OPTIONAL_ATTRIBUTES",
    "REQUIRED_ATTRIBUTES",
    "TESTED_DEEPSPEED",
    "DeepSpeedIncompatibleError",
    "Planner",
    "ZeRO3Adapter",
    "backward_overlap_blocker",
    "speculation_reason",
    "check_zero3_optimizer",
    "engine_device",
    "load_zero3_weights_for_evaluation",
]
