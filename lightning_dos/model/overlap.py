"""What the update overlaps: one vocabulary for the strategy's ``overlap`` setting, what the adapter runs, what the
scheduler plans for, what the iteration model times and what the simulator replays.

- ``"off"``: forward, backward, then the update alone; the step returns once it is over.
- ``"forward"``: the step returns while the update runs beside the next forward, whose all-gathers wait only for the
  sub-groups holding their parameters.
- ``"auto"``: ``"forward"``, and the update begins during backward: each host sub-group is updated as soon as
  backward has made its gradient final. As a setting, it runs as ``"forward"`` where the update needs the whole
  gradient first (gradient clipping, fp16 loss scaling: the strategy says so once, naming the cause).
"""

from __future__ import annotations

from typing import Literal

OFF, FORWARD, AUTO = "off", "forward", "auto"
#: Every mode, in the order tables list them.
MODES = (OFF, FORWARD, AUTO)
Overlap = Literal["off", "forward", "auto"]


def check_overlap(value: object) -> Overlap:
    """``value`` if it is one of :data:`MODES`; else ValueError naming the setting and the valid values."""
    if value not in MODES:
        raise ValueError(f"overlap must be one of {', '.join(MODES)}, got {value!r}")
    return value  # type: ignore[return-value]


def overlaps_forward(mode: Overlap) -> bool:
    """Whether the update runs beside the next forward (the step returns before it is over)."""
    return mode != OFF


def begins_in_backward(mode: Overlap) -> bool:
    """Whether host sub-groups are updated during backward, as their gradients become final."""
    return mode == AUTO
