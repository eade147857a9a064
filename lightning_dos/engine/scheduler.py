"""The ratio scheduler: turns a ``gpu_fraction`` setting into each step's plan and prediction.

- A number or ``"stride:K"``: a fixed plan, the same every step.
- ``"auto"``: the performance model chooses the plan that minimises the predicted update time within
  the device memory budget, from rates calibrated at start-up and refined from every step's report;
  when prediction and measurement drift apart it plans again. With no accelerator everything stays on
  the host (calibration there takes a fraction of a second and only feeds the prediction).

Every mode gets a prediction when rates are known, so the monitor can put it beside the measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_dos.engine.loop import InterleavedAdam
from lightning_dos.engine.perfmodel import HardwareRates, RateEstimator, choose_plan, predict
from lightning_dos.engine.plan import FractionSpec, Plan, all_host
from lightning_dos.engine.report import StepReport

#: How often "auto" re-plans even without drift, so slowly changing rates are followed.
REPLAN_EVERY = 50


class PlacementScheduler:
    """Chooses the plan of every step.

    Args:
        spec: the parsed ``gpu_fraction``.
        engine: the engine whose sub-groups are placed.
        calibrate: measures this machine's rates (called once, lazily, only when a model is needed).
    """

    def __init__(
        self,
        spec: FractionSpec,
        engine: InterleavedAdam,
        calibrate: Callable[[torch.device], HardwareRates],
    ) -> None:
        self.spec = spec
        self.engine = engine
        self._calibrate = calibrate
        self.estimator: RateEstimator | None = None
        self._plan: Plan | None = None
        self._planned_at = 0
        self._seen_step = 0
        #: Predicted and measured update times of recent steps, for the monitor and tests.
        self.history: list[tuple[float | None, float]] = []

    @property
    def has_accelerator(self) -> bool:
        return self.engine.device.type != "cpu"

    @property
    def rates(self) -> HardwareRates | None:
        return self.estimator.rates if self.estimator is not None else None

    def _ensure_rates(self) -> HardwareRates:
        if self.estimator is None:
            self.estimator = RateEstimator(self._calibrate(self.engine.device))
        # The engine reports peaks from the calibration itself; the live estimate follows contention.
        self.engine.rates = self.estimator.calibrated
        return self.estimator.rates

    def __call__(self, step: int) -> tuple[Plan, float | None]:
        self._observe_last_report()
        n = len(self.engine.sub_groups)
        if self.spec.mode != "auto":
            self._plan = self._plan or self.spec.plan(n, sizes=self.engine.sizes)
        elif not self.has_accelerator:
            # No accelerator: the host is the only place worth using; no search is needed.
            self._plan = self._plan or all_host(n)
        elif self._plan is None or step - self._planned_at >= REPLAN_EVERY:
            self._replan(step)
        rates = self._ensure_rates()
        engine = self.engine
        return self._plan, predict(engine.sizes, self._plan, rates, engine.lp_bytes, engine.lp_downloads).time_s

    def _replan(self, step: int) -> None:
        rates = self._ensure_rates()
        budget = self.engine.device_budget()
        # Resident state stays on the device through forward and backward too, so it is only planned inside a
        # budget the user set; memory that is free at update time (activations gone) is for staging alone.
        resident_ok = self.engine.gpu_memory_budget is not None
        self._plan, _ = choose_plan(
            self.engine.sizes,
            rates,
            budget,
            self.engine.lp_bytes,
            allow_resident=resident_ok,
            lp_on_host=self.engine.lp_downloads,
        )
        self._planned_at = step

    def _observe_last_report(self) -> None:
        report: StepReport | None = self.engine.last_report
        if report is None or report.step == self._seen_step or report.skipped:
            return
        self._seen_step = report.step
        self.history.append((report.predicted_s, report.update_s))
        if self.estimator is None:
            return
        self.estimator.observe(report)
        if report.predicted_s is not None and self.estimator.observe_update(report.predicted_s, report.update_s):
            if self.spec.mode == "auto" and self.has_accelerator:
                self._replan(report.step + 1)
