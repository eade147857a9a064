"""The online rate estimator: refines calibrated hardware rates from the engine's step reports."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import replace

from lightning_dos.model.perfmodel import HardwareRates, adam_equivalent, rates_for
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import ADAM_FP32, Footprint

#: The range the correction (measured over predicted update time) is kept in: a step this far off the model is a
#: stall or a fault, not the machine's speed, and one such step must not push every later prediction out of scale.
CORRECTION_RANGE = (1e-2, 1e2)


class _Correction:
    """Measured over predicted-from-base update time for one regime: the median of a window of recent steps."""

    def __init__(self, window: int, drift: float, patience: int, start: float) -> None:
        self.drift, self.patience = drift, patience
        #: The correction in force (``start`` until a step is observed).
        self.value = start
        # The logarithms of the ratios, so that a step twice as slow and one twice as fast weigh the same.
        self._log_ratios: deque[float] = deque(maxlen=window)
        self._streak = 0  # consecutive steps off the correction by more than drift, signed by their side

    def observe(self, ratio: float) -> None:
        low, high = CORRECTION_RANGE
        log_ratio = math.log(min(high, max(low, ratio)))
        off = log_ratio - math.log(self.value)
        side = 1 if off > 0 else -1
        if abs(off) <= math.log1p(self.drift):
            self._streak = 0
        elif self._streak * side > 0:
            self._streak += side
        else:
            self._streak = side
        self._log_ratios.append(log_ratio)
        if abs(self._streak) >= self.patience:
            # A change of regime nothing announced (another job started, say): keep only the steps that show it.
            for _ in range(len(self._log_ratios) - self.patience):
                self._log_ratios.popleft()
            self._streak = 0
        self.value = min(high, max(low, math.exp(self._median())))  # exp(log(x)) may round just outside

    def _median(self) -> float:
        """The window's median, always one of its values: of the middle two of an even count, the one nearer the
        correction in force (their mean would let one outlier in a window of two move the correction halfway)."""
        ordered = sorted(self._log_ratios)
        middle = len(ordered) // 2
        if len(ordered) % 2:
            return ordered[middle]
        now = math.log(self.value)
        return min(ordered[middle - 1], ordered[middle], key=lambda value: abs(value - now))


class RateEstimator:
    """Refines calibrated rates from the engine's step reports, robustly (medians of recent steps).

    Two things are kept apart, so that corrections cannot compound:

    - the *base* rates: the calibration, with the per-lane throughputs of timed steps' spans put in;
    - a multiplicative *correction* of the update time, for what the spans do not show (contention from data
      loaders, other ranks and backward, overheads between operations, steps without spans): the median, over the
      last ``window`` steps, of each step's measured update time over its prediction *from the base rates* (never
      from already corrected rates, whose error would then be corrected again), kept in :data:`CORRECTION_RANGE`.

    :attr:`rates` are the base rates slowed down (or sped up) by the correction: the model's times are inversely
    proportional to every rate, so a prediction from them is the base one times the correction
    (:meth:`corrected`). When ``patience`` steps in a row are off the correction by more than ``drift``, all on the
    same side, the machine has changed: the older steps leave the window, so the correction follows the new regime
    at once instead of after half a window. A regime the caller knows of (``regime`` of :meth:`observe_update`:
    whether the update began during backward, where it shares the CPU with backward) has a correction of its own,
    in force from the first step of that regime on. Zero, negative and non-finite measurements are ignored.

    Args:
        rates: the calibrated starting point.
        window: how many recent observations each median is taken over.
        drift: relative mismatch between prediction and measurement that counts as drift.
        patience: consecutive drifting steps (on the same side) that count as a regime change.
        footprint: the engine's rule and dtypes: the update throughputs its spans show are that rule's, and are
            kept in Adam-with-fp32-state units as every :class:`HardwareRates` keeps them (:func:`adam_equivalent`);
            its update spans (``host_adam``, ``device_adam``) carry ``footprint.master`` bytes per element.
    """

    def __init__(
        self,
        rates: HardwareRates,
        window: int = 20,
        drift: float = 0.2,
        patience: int = 3,
        *,
        footprint: Footprint = ADAM_FP32,
    ) -> None:
        self.footprint = footprint
        self.calibrated = rates
        #: The calibration refined from spans, without the correction.
        self.base = rates
        self.drift, self.patience = drift, patience
        self._lanes: dict[str, deque[float]] = {}
        self.window = window
        self._corrections: dict[Hashable, _Correction] = {}
        self._regime: Hashable = None  # that of the last step observed, taken to hold for the next
        self._planned = 1.0  # the correction when a re-plan was last suggested
        self._observed = 0  # measurements taken (a re-plan is suggested only from ``patience`` on)

    @property
    def correction(self) -> float:
        """Measured over predicted-from-:attr:`base` update time, in the regime of the last step observed."""
        current = self._corrections.get(self._regime)
        return current.value if current is not None else 1.0

    @property
    def rates(self) -> HardwareRates:
        """The base rates with the correction applied: what plans and predictions are made from."""
        correction = self.correction
        return self.base if correction == 1.0 else self.base.scaled(1.0 / correction)

    def corrected(self, base_predicted_s: float) -> float:
        """A prediction made from :attr:`base`, corrected (what the same prediction from :attr:`rates` gives)."""
        return base_predicted_s * self.correction

    def observe(self, report: StepReport) -> None:
        """Take one step's spans into account (skipped steps and steps without spans are ignored)."""
        if report.skipped or not report.spans:
            return
        for span in report.spans:
            if span.duration_s <= 0:
                continue
            per_second = span.nbytes / span.duration_s
            self._lanes.setdefault(span.lane, deque(maxlen=self.window)).append(per_second)
        rates = self.base
        # The spans time this engine's rule: compare and update them in its own throughputs.
        own = rates_for(rates, self.footprint)
        med = {lane: statistics.median(v) for lane, v in self._lanes.items() if v}
        # The engine's update spans count the master weights' bytes per element (4, or 2 under bf16 master weights).
        span_bytes = float(self.footprint.master)
        if "host_adam" in med:  # the span covers the update and the cast
            per_element = span_bytes / med["host_adam"]
            cast_share = (1.0 / own.host_cast_eps) / own.host_s_per_element
            host = adam_equivalent(replace(own, host_adam_eps=1.0 / (per_element * (1 - cast_share))), self.footprint)
            rates = replace(rates, host_adam_eps=host.host_adam_eps, host_cast_eps=1.0 / (per_element * cast_share))
        if "device_adam" in med:
            device = adam_equivalent(replace(own, device_adam_eps=med["device_adam"] / span_bytes), self.footprint)
            rates = replace(rates, device_adam_eps=device.device_adam_eps)
        if "upload" in med:
            rates = replace(rates, duplex_h2d_bps=med["upload"])
        if "download" in med:
            rates = replace(rates, duplex_d2h_bps=med["download"])
        self.base = rates

    def observe_update(self, base_predicted_s: float, measured_s: float, regime: Hashable = None) -> bool:
        """Take one step's measured update time into the correction of its ``regime``, beside its prediction from
        :attr:`base` (not the corrected one). True when the correction has moved by more than ``drift`` since it
        last said so (or since the start): the caller should plan again with the new :attr:`rates`."""
        if not (math.isfinite(base_predicted_s) and math.isfinite(measured_s)):
            return False
        if base_predicted_s <= 0 or measured_s <= 0:
            return False
        if regime not in self._corrections:
            # A new regime starts from the correction in force, until its first step replaces it.
            self._corrections[regime] = _Correction(self.window, self.drift, self.patience, self.correction)
        self._regime = regime
        self._corrections[regime].observe(measured_s / base_predicted_s)
        self._observed += 1
        # Not on the first measurements: the first steps are the least typical (allocations, first builds), and a
        # plan changed at once would differ from the one the next step began during backward with.
        if self._observed < self.patience:
            return False
        if abs(math.log(self.correction / self._planned)) <= math.log1p(self.drift):
            return False
        self._planned = self.correction
        return True


class OwnTimeEstimator:
    """The update phase's own work (DeepSpeed's step around the engine's loop, Lightning's bookkeeping of the step):
    the median of the last ``window`` measurements (:func:`~lightning_dos.model.update_phase.own_time_s`).

    The performance model has no term for this work (the framework's Python, not the hardware's rates), so it is
    measured; a median, because one step stalled by another process on the same cores must not move the prediction of
    the next ones. Negative and non-finite measurements are ignored; zero is a measurement (a fast step).

    Args:
        window: how many recent measurements the median is taken over.
    """

    def __init__(self, window: int = 40) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._seconds: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float | None:
        """The median of the measurements in the window; None before the first."""
        return statistics.median(self._seconds) if self._seconds else None

    def observe(self, seconds: float) -> None:
        """Take one step's own time into the window."""
        if math.isfinite(seconds) and seconds >= 0:
            self._seconds.append(float(seconds))
