"""What the ranks of a job agree on before they plan, so that every rank runs the same plan.

Each step waits for the slowest rank (the next forward needs every rank's updated partition), so a rank
whose plan is faster than another's gains nothing, and a plan chosen from one rank's figures can be too
slow, or too large, for another. The engine stays free of any framework: the collective is a
:data:`ReduceMin` callable that the framework injects (the strategy runs it on the process group that
Lightning and DeepSpeed set up).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import fields, replace

from lightning_dos.model.perfmodel import HardwareRates

#: Element-wise minimum of a list of numbers over every rank of the job. Every rank calls it at the same
#: point with a list of the same length and gets the same list back; like any collective it returns on no
#: rank before every rank has called it. None where there is a single process.
ReduceMin = Callable[[list[float]], list[float]]

_RATE_FIELDS = tuple(f.name for f in fields(HardwareRates) if f.name != "shared_cpu")


def min_rates(rates: HardwareRates, reduce_min: ReduceMin) -> HardwareRates:
    """Every rate's minimum over the ranks: the pace of the slowest rank, which gates each step.

    ``shared_cpu`` is left as it is: it says what kind of device the ranks have, the same on all of them.
    """
    low = reduce_min([float(getattr(rates, name)) for name in _RATE_FIELDS])
    return replace(rates, **dict(zip(_RATE_FIELDS, low, strict=True)))


def agreed_plan_inputs(
    sizes: Sequence[int], budget_bytes: int | None, rates: HardwareRates, reduce_min: ReduceMin
) -> tuple[list[int], int | None, HardwareRates]:
    """The planning inputs every rank uses: the largest size of each sub-group, the smallest device budget
    and the slowest rates over the ranks.

    The plan is a deterministic function of these (and of settings every rank shares), so equal inputs give
    equal plans on every rank without sending a plan around. Reducing the inputs, rather than broadcasting
    rank 0's plan, also keeps the plan inside every rank's memory: ZeRO-3 partitions can differ slightly
    between ranks (padding), and so do the device memory free and the rates each rank has measured since.

    Raises:
        RuntimeError: the ranks hold different numbers of sub-groups (on every rank alike, so none hangs).
    """
    n = len(sizes)
    low, minus_high = reduce_min([float(n), -float(n)])
    if low != -minus_high:
        raise RuntimeError(
            f"the ranks hold between {int(low)} and {int(-minus_high)} optimizer sub-groups, so gpu_fraction='auto' "
            "cannot choose one plan for all of them; use a fixed gpu_fraction (a number or 'stride:K') instead"
        )
    budget = math.inf if budget_bytes is None else float(budget_bytes)
    rate_values = [float(getattr(rates, name)) for name in _RATE_FIELDS]
    # One collective for everything: sizes negated, so that their minimum is the largest size.
    reduced = reduce_min([*(-float(s) for s in sizes), budget, *rate_values])
    agreed_sizes = [int(-v) for v in reduced[:n]]
    agreed_budget = None if math.isinf(reduced[n]) else int(reduced[n])
    agreed_rates = replace(rates, **dict(zip(_RATE_FIELDS, reduced[n + 1 :], strict=True)))
    return agreed_sizes, agreed_budget, agreed_rates
