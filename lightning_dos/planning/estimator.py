"""The online rate estimator: refines calibrated hardware rates from the engine's step reports."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import replace

from lightning_dos.model.perfmodel import HardwareRates, adam_equivalent, rates_for
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import ADAM_FP32, Footprint


class RateEstimator:
    """Refines calibrated rates from the engine's step reports, robustly (medians of recent steps).

    Per-lane throughputs come from the spans of timed steps; every step's measured update time also feeds a
    correction factor that tracks contention (data loaders, other ranks) when no spans are recorded.

    Args:
        rates: the calibrated starting point.
        window: how many recent observations each median is taken over.
        drift: relative mismatch between prediction and measurement that counts as drift.
        patience: consecutive drifting steps before a re-plan is suggested.
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
