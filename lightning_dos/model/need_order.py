"""The order the next forward needs the sub-groups in, from what the first forward and backward touched.

ZeRO-3 gathers a module's parameters as the forward reaches it. A parameter's gradient becomes final when backward
reaches its first use in the forward (backward runs the forward in reverse), so a sub-group is needed first, and
made final last, at the first module that uses any of its parameters. The engine's sub-groups follow DeepSpeed's
flat partitions, which follow the optimizer's param groups, not the forward: a GPT's no-decay group (embeddings,
every LayerNorm and bias) is packed last, yet the forward needs it at its first module and in every block, and
backward makes it final at its very end. Updated in index order, that sub-group lands last and the next forward's
first gather waits for the whole update (issue 52).

Pure arithmetic: the framework records which sub-groups each module of the first forward reads (and, in backward,
the order they became final); :func:`need_order` turns that into the order the engine updates and lands them in
and the iteration model times (``Plan.order``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def need_order(count: int, gathers: Iterable[Iterable[int]], final: Sequence[int] = ()) -> tuple[int, ...]:
    """The ``count`` sub-groups in the order the next forward needs them.

    Args:
        count: how many sub-groups there are.
        gathers: the sub-groups each of the first forward's gathers (modules) read, in the forward's order.
        final: sub-groups in the order backward made them final (may be partial or empty).

    A sub-group comes at the first gather that reads it; those first read by the same gather by the order backward
    made them final (earlier first: they can be updated first), then by index; sub-groups no gather read (no
    parameter of theirs takes part in the forward) come last, likewise."""
    first: dict[int, int] = {}
    for position, sub_groups in enumerate(gathers):
        for index in sub_groups:
            if not 0 <= index < count:
                raise ValueError(f"sub-group {index} is not one of the {count}")
            first.setdefault(index, position)
    finality = {index: rank for rank, index in enumerate(final)}

    def key(index: int) -> tuple[float, int, int]:
        return first.get(index, math.inf), finality.get(index, count), index

    return tuple(sorted(range(count), key=key))
