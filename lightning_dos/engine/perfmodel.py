"""The performance model: predicts the update phase of a plan, and chooses the plan that minimises it.

It mirrors what the engine does (:mod:`lightning_dos.engine.loop`), per rank:

- host sub-group of n elements: CPU Adam and cast (``n / host_adam_eps + n / host_cast_eps``), then an
  upload of ``lp_bytes * n`` on its own stream;
- streamed sub-group: upload 16n bytes (param, moments, gradient), device Adam, download 12n bytes, through
  ``device_buffers`` staging slots (a slot is reused once its download is done);
- resident sub-group: upload 4n bytes (gradient) and device Adam; 16n bytes of device memory all the time.

Device work is queued first and runs while the CPU works through the host sub-groups; the update ends when
the last of them finishes. When the plan streams, both PCIe directions are busy at once and each runs at its
duplex rate; the link as a whole needs at least its bytes' worth of time, at the duplex rates while both
directions have bytes left and the solo rate after (:func:`link_seconds`). On a CPU "device" (no accelerator)
host and device work share the same cores, so they add up.

Knows nothing of Lightning or DeepSpeed.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

from lightning_dos.engine.plan import Place, Plan, all_host
from lightning_dos.engine.report import StepReport

STREAMED_UP, STREAMED_DOWN, RESIDENT_UP, DEVICE_BYTES = 16, 12, 4, 16


@dataclass(frozen=True)
class HardwareRates:
    """What one rank's hardware does per second.

    Attributes:
        host_adam_eps: host Adam throughput, elements/s (with the threads this rank gets).
        host_cast_eps: host fp32 -> 16-bit cast throughput, elements/s.
        device_adam_eps: device Adam throughput, elements/s; 0 means there is no accelerator.
        h2d_bps: pinned host-to-device bandwidth alone, bytes/s.
        d2h_bps: pinned device-to-host bandwidth alone, bytes/s.
        duplex_h2d_bps: host-to-device bandwidth while device-to-host runs too, bytes/s.
        duplex_d2h_bps: device-to-host bandwidth while host-to-device runs too, bytes/s.
        shared_cpu: True when the "device" is the CPU itself, so host and device work do not overlap.
    """

    host_adam_eps: float
    host_cast_eps: float
    device_adam_eps: float
    h2d_bps: float
    d2h_bps: float
    duplex_h2d_bps: float
    duplex_d2h_bps: float
    shared_cpu: bool = False

    def to_dict(self) -> dict[str, float | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HardwareRates:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown hardware rate(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**{k: (bool(v) if k == "shared_cpu" else float(v)) for k, v in data.items()})

    def scaled(self, factor: float) -> HardwareRates:
        """Every rate times ``factor`` (a machine that is uniformly slower or faster)."""
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.name != "shared_cpu"})


@dataclass(frozen=True)
class Prediction:
    """The model's account of one update phase.

    Attributes:
        time_s: predicted update time, fill and drain included.
        peak_device_bytes: device memory the plan needs (resident state plus staging buffers).
        h2d_bytes: bytes uploaded.
        d2h_bytes: bytes downloaded.
        host_s: time the CPU is busy.
        device_s: time the device pipeline takes, transfers included.
    """

    time_s: float
    peak_device_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    host_s: float
    device_s: float


def device_bytes(sizes: Sequence[int], plan: Plan) -> int:
    """Device memory ``plan`` needs during the update (as the engine allocates it)."""
    streamed = [sizes[i] for i in plan.streamed_indices]
    resident = sum(sizes[i] for i in plan.resident_indices)
    buffers = min(plan.device_buffers, len(streamed))
    return DEVICE_BYTES * (resident + buffers * max(streamed, default=0))


def link_seconds(h2d_bytes: float, d2h_bytes: float, rates: HardwareRates) -> float:
    """Least time the link needs to carry these bytes: both directions at their duplex rates while both have
    bytes left, then the rest at the solo rate of the direction that still has some.

    (Charging every byte at the duplex rate, as this model once did, overstates plans whose uploads outlast
    their downloads by up to 15%: the replay of the engine's schedule on a virtual node showed it.)"""
    if d2h_bytes <= 0:
        return h2d_bytes / rates.h2d_bps
    if h2d_bytes <= 0:
        return d2h_bytes / rates.d2h_bps
    both = min(h2d_bytes / rates.duplex_h2d_bps, d2h_bytes / rates.duplex_d2h_bps)
    h2d_left = h2d_bytes - both * rates.duplex_h2d_bps
    d2h_left = d2h_bytes - both * rates.duplex_d2h_bps
    return both + max(0.0, h2d_left) / rates.h2d_bps + max(0.0, d2h_left) / rates.d2h_bps


def predict(
    sizes: Sequence[int], plan: Plan, rates: HardwareRates, lp_bytes: int, lp_on_host: bool = False
) -> Prediction:
    """Predict the update phase of ``plan`` over sub-groups of ``sizes`` elements.

    ``lp_on_host``: the 16-bit parameters live in host memory (parameter offload), so host sub-groups upload
    nothing and device sub-groups download their 16-bit result as well."""
    streaming = bool(plan.streamed_indices)
    up = rates.duplex_h2d_bps if streaming else rates.h2d_bps
    down = rates.duplex_d2h_bps if streaming else rates.d2h_bps
    h2d_free = compute_free = d2h_free = 0.0
    h2d_bytes = d2h_bytes = 0
    lp_down = lp_bytes if lp_on_host else 0
    for i in plan.resident_indices:  # the engine queues resident work first
        h2d_free += RESIDENT_UP * sizes[i] / up
        compute_free = max(compute_free, h2d_free) + sizes[i] / rates.device_adam_eps
        h2d_bytes += RESIDENT_UP * sizes[i]
        if lp_down:
            d2h_free = max(d2h_free, compute_free) + lp_down * sizes[i] / down
            d2h_bytes += lp_down * sizes[i]
    slots_free = [0.0] * max(1, plan.device_buffers)
    for j, i in enumerate(plan.streamed_indices):
        n, slot = sizes[i], j % len(slots_free)
        h2d_free = max(h2d_free, slots_free[slot]) + STREAMED_UP * n / up
        compute_free = max(compute_free, h2d_free) + n / rates.device_adam_eps
        d2h_free = slots_free[slot] = max(d2h_free, compute_free) + (STREAMED_DOWN + lp_down) * n / down
        h2d_bytes += STREAMED_UP * n
        d2h_bytes += (STREAMED_DOWN + lp_down) * n
    device_s = max(h2d_free, compute_free, d2h_free)
    host_s, lp_free = 0.0, 0.0
    per_element = 1.0 / rates.host_adam_eps + 1.0 / rates.host_cast_eps
    for i in plan.host_indices:
        host_s += sizes[i] * per_element
        if not rates.shared_cpu and not lp_on_host:  # a 16-bit upload follows each host sub-group
            lp_free = max(lp_free, host_s) + lp_bytes * sizes[i] / up
            h2d_bytes += lp_bytes * sizes[i]
    if rates.shared_cpu:
        time_s = device_s + host_s
    else:
        # Host uploads and device uploads share the link: it needs at least all the bytes' worth of time.
        time_s = max(device_s, host_s, lp_free, link_seconds(h2d_bytes, d2h_bytes, rates))
    return Prediction(time_s, device_bytes(sizes, plan), h2d_bytes, d2h_bytes, host_s, device_s)


def _spread(n: int, chosen: int, among: Sequence[int]) -> list[int]:
    """``chosen`` of the indices ``among``, spread evenly (as even_plan does)."""
    if chosen <= 0:
        return []
    m = len(among)
    return [among[min(m - 1, (j + 1) * m // chosen - 1)] for j in range(chosen)]


#: Up to this many placements the search is exhaustive (exact for any sub-group sizes).
EXHAUSTIVE_LIMIT = 2187


def candidate_plans(n: int, sizes: Sequence[int], allow_resident: bool, max_buffers: int):  # noqa: ANN201
    """Plans worth considering.

    Few sub-groups: every placement. Otherwise the structure that matters when sizes are (nearly) equal,
    as the engine cuts them: the r largest (or smallest) sub-groups resident, then k of the rest streamed,
    spread evenly or taken largest- or smallest-first, each with 1..max_buffers staging buffers."""
    places_per_group = (Place.HOST, Place.DEVICE, Place.RESIDENT) if allow_resident else (Place.HOST, Place.DEVICE)
    if len(places_per_group) ** n <= EXHAUSTIVE_LIMIT:
        for combo in itertools.product(places_per_group, repeat=n):
            streamed = combo.count(Place.DEVICE)
            for buffers in range(1, (max_buffers if streamed > 1 else 1) + 1):
                yield Plan(combo, buffers)
        return
    largest = sorted(range(n), key=lambda i: (-sizes[i], i))
    orders = [largest, largest[::-1]]
    seen: set[tuple] = set()
    for resident_order in orders:
        for r in range(n + 1 if allow_resident else 1):
            resident = set(resident_order[:r])
            rest = [i for i in range(n) if i not in resident]
            for k in range(len(rest) + 1):
                choices = [_spread(n, k, rest)] + [[i for i in order if i in set(rest)][:k] for order in orders]
                for chosen in choices:
                    streamed = set(chosen)
                    places = tuple(
                        Place.RESIDENT if i in resident else Place.DEVICE if i in streamed else Place.HOST
                        for i in range(n)
                    )
                    if places in seen:
                        continue
                    seen.add(places)
                    for buffers in range(1, (max_buffers if k > 1 else 1) + 1):
                        yield Plan(places, buffers)


def choose_plan(
    sizes: Sequence[int],
    rates: HardwareRates,
    budget_bytes: int | None,
    lp_bytes: int,
    allow_resident: bool = False,
    max_buffers: int = 4,
    lp_on_host: bool = False,
) -> tuple[Plan, Prediction]:
    """The plan with the least predicted update time whose device memory fits ``budget_bytes`` (None: no limit).

    With no accelerator (``device_adam_eps == 0``) everything stays on the host and nothing is searched.
    """
    n = len(sizes)
    host = all_host(n)
    if n == 0 or rates.device_adam_eps <= 0 or rates.shared_cpu:
        return host, predict(sizes, host, rates, lp_bytes, lp_on_host) if rates.host_adam_eps > 0 else Prediction(
            0, 0, 0, 0, 0, 0
        )
    best_plan, best = host, predict(sizes, host, rates, lp_bytes, lp_on_host)
    for plan in candidate_plans(n, sizes, allow_resident, max_buffers):
        if budget_bytes is not None and device_bytes(sizes, plan) > budget_bytes:
            continue
        guess = predict(sizes, plan, rates, lp_bytes, lp_on_host)
        if guess.time_s < best.time_s - 1e-12:
            best_plan, best = plan, guess
    return best_plan, best


def floor(
    total_elements: int,
    rates: HardwareRates,
    lp_bytes: int,
    budget_bytes: int | None = None,
    points: int = 201,
    shares: Sequence[tuple[float, float]] = (),
    resident_up_bytes: int = RESIDENT_UP,
) -> tuple[float, float]:
    """The first-order floor of the update phase (reference notes), with the engine's byte counts.

    A share r of the elements streams (16 bytes up, 12 down), a share q stays resident (4 bytes up; at most
    what ``budget_bytes`` holds, none without a budget, as in the reference), the rest is updated on the host:
    T(r, q) = max((1-r-q)N/U_host, link(N(16r + 4q + lp(1-r-q)) up, 12rN down), (r+q)N/U_dev), with the link's
    time as :func:`link_seconds` gives it, searched on a grid plus the exact ``shares`` (r, q) given (those of
    schemes the floor is compared with, so that it is below each of them wherever their own prediction is
    above T at their share). ``resident_up_bytes``: bytes a resident element uploads (0 for a scheme whose
    gradients stay on the device, as TwinFlow's do). With no accelerator (a CPU "device") there is no upload
    and no device: T = N/U_host.
    Returns the device share r + q at the minimum, and the minimum.
    """
    n = float(total_elements)
    host = 1.0 / rates.host_adam_eps + 1.0 / rates.host_cast_eps
    if rates.shared_cpu:  # the parameters live on the CPU too: the cast writes them, nothing is uploaded
        return (0.0, n * host)
    best = (0.0, n * max(host, lp_bytes / rates.h2d_bps))
    if rates.device_adam_eps <= 0 or n == 0:
        return best

    def t_of(r: float, q: float) -> float:
        up_bytes = n * (STREAMED_UP * r + resident_up_bytes * q + lp_bytes * (1 - r - q))
        return max(
            n * (1 - r - q) * host,
            link_seconds(up_bytes, n * STREAMED_DOWN * r, rates),
            n * (r + q) / rates.device_adam_eps,
        )

    q_max = min(1.0, budget_bytes / (DEVICE_BYTES * n)) if budget_bytes else 0.0
    grid = [
        ((1 - q) * ri / (points - 1), q)
        for q in (q_max * qi / max(1, points - 1) for qi in range(points if q_max > 0 else 1))
        for ri in range(points)
    ]
    for r, q in [*grid, *shares]:
        t = t_of(r, q)
        if t < best[1]:
            best = (r + q, t)
    return best


class RateEstimator:
    """Refines calibrated rates from the engine's step reports, robustly (medians of recent steps).

    Per-lane throughputs come from the spans of timed steps; every step's measured update time also feeds a
    correction factor that tracks contention (data loaders, other ranks) when no spans are recorded.

    Args:
        rates: the calibrated starting point.
        window: how many recent observations each median is taken over.
        drift: relative mismatch between prediction and measurement that counts as drift.
        patience: consecutive drifting steps before a re-plan is suggested.
    """

    def __init__(self, rates: HardwareRates, window: int = 20, drift: float = 0.2, patience: int = 3) -> None:
        self.calibrated = rates
        self.rates = rates
        self.drift, self.patience = drift, patience
        self._lanes: dict[str, deque[float]] = {}
        self._window = window
        self._factor: deque[float] = deque(maxlen=window)
        self._streak = 0

    def observe(self, report: StepReport) -> None:
        """Take one step's spans into account (skipped steps and steps without spans are ignored)."""
        if report.skipped or not report.spans:
            return
        for span in report.spans:
            if span.duration_s <= 0:
                continue
            per_second = span.nbytes / span.duration_s
            self._lanes.setdefault(span.lane, deque(maxlen=self._window)).append(per_second)
        rates = self.rates
        med = {lane: statistics.median(v) for lane, v in self._lanes.items() if v}
        if "host_adam" in med:  # nbytes is 4 per element; the span covers Adam and the cast
            per_element = 4.0 / med["host_adam"]
            cast_share = (1.0 / rates.host_cast_eps) / (1.0 / rates.host_adam_eps + 1.0 / rates.host_cast_eps)
            rates = replace(
                rates,
                host_adam_eps=1.0 / (per_element * (1 - cast_share)),
                host_cast_eps=1.0 / (per_element * cast_share),
            )
        if "device_adam" in med:
            rates = replace(rates, device_adam_eps=med["device_adam"] / 4.0)
        if "upload" in med:
            rates = replace(rates, duplex_h2d_bps=med["upload"])
        if "download" in med:
            rates = replace(rates, duplex_d2h_bps=med["download"])
        self.rates = rates

    def observe_update(self, predicted_s: float, measured_s: float) -> bool:
        """Compare a prediction with its measurement; True when they have drifted apart long enough that
        the caller should plan again (the rates are corrected by the observed ratio meanwhile)."""
        if predicted_s <= 0 or measured_s <= 0:
            return False
        self._factor.append(predicted_s / measured_s)
        if abs(measured_s - predicted_s) / measured_s <= self.drift:
            self._streak = 0
            return False
        self._streak += 1
        if self._streak < self.patience:
            return False
        self._streak = 0
        self.rates = self.rates.scaled(statistics.median(self._factor))
        return True
