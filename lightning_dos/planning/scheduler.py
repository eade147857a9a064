"""The ratio scheduler: turns a ``gpu_fraction`` setting into each step's plan and prediction.

- A number or ``"stride:K"``: a fixed plan, the same every step.
- ``"auto"``: the performance model chooses the plan that minimises the predicted update time within
  the device memory budget, from rates calibrated at start-up and refined from every step's report;
  when prediction and measurement drift apart it plans again. With no accelerator everything stays on
  the host (calibration there takes a fraction of a second and only feeds the prediction).
  When the update overlaps the next forward (and, under ``overlap="auto"``, backward), what counts is the whole
  iteration, not the update alone: once the framework has measured forward and backward
  (:meth:`PlacementScheduler.observe_phases`), "auto" runs (:func:`~lightning_dos.model.auto_plan.auto_plan`, which
  ``plan`` and ``simulate`` show too) the update's own best plan, or the placement
  by arrival around its resident sub-groups (the sub-groups the next forward needs first on the device, the ones
  whose gradients backward makes final first on the host) in no more device memory, whichever predicts the
  shorter iteration.

With several ranks (a ``reduce_min`` given), "auto" plans together: every rank plans at the same steps from
the same inputs (:func:`~lightning_dos.planning.agree.agreed_plan_inputs`), so all run the same plan. Drift seen
by any rank is agreed on every :data:`DRIFT_CHECK_EVERY` steps rather than acted on alone: a re-plan is a
collective, which every rank must enter at the same step. The framework calls the scheduler on its training
thread, never from an autograd hook, at a point every rank reaches in the same order.

The device budget a plan is made in is the memory free *at the update* (backward's activations gone, the update's
buffers not yet allocated), which the update may only shrink: the framework samples it there and hands it over
(:meth:`PlacementScheduler.observe_budget`) when it plans elsewhere (under ``overlap="auto"``, before backward).

Every mode gets a prediction when rates are known, so the monitor can put it beside the measurement: of the engine's
update loop, and of the update phase the trainer waits for (:meth:`PlacementScheduler.update_phase_predicted_s`: the
loop under ``overlap="off"``, none of it otherwise, and the step's own work around it as measured so far).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_dos.engine.loop import InterleavedUpdate
from lightning_dos.model.auto_plan import auto_plan
from lightning_dos.model.iteration import Speculation
from lightning_dos.model.nvme import DiskRates, OrderChoice, choose_files_order, files_update
from lightning_dos.model.overlap import OFF, check_overlap
from lightning_dos.model.perfmodel import HardwareRates, predict
from lightning_dos.model.plan import FractionSpec, Plan, all_host
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_phase import own_time_s, update_phase_s
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.planning.agree import ReduceMin, agreed_plan_inputs
from lightning_dos.planning.estimator import OwnTimeEstimator, RateEstimator

#: How often "auto" re-plans even without drift, so slowly changing rates are followed.
REPLAN_EVERY = 50
#: With several ranks, how often (in steps) they agree whether any of them has seen drift.
DRIFT_CHECK_EVERY = 10
#: How many steps back an update phase's prediction is kept for the monitor (it reads a step's once its report is in).
PHASE_PREDICTIONS_KEPT = 64


class PlacementScheduler:
    """Chooses the plan of every step.

    Args:
        spec: the parsed ``gpu_fraction``.
        engine: the engine whose sub-groups are placed.
        calibrate: measures this machine's rates (called once, lazily, only when a model is needed); with
            several ranks, rates already agreed between them (the slowest of each).
        reduce_min: element-wise minimum over the ranks (:data:`~lightning_dos.planning.agree.ReduceMin`), so
            that ``"auto"`` chooses the same plan on every rank; None for a single process.
        overlap: how the framework runs the update beside forward and backward, one of
            :data:`~lightning_dos.model.overlap.MODES`: ``"off"`` (after backward, alone: the update's own best
            plan is the iteration's), ``"forward"`` (beside the next forward), ``"auto"`` (beside the next
            forward, and host sub-groups during backward).
        drive: the NVMe drive's rates (measured at start-up) when the engine keeps sub-groups in files: each update
            is predicted with their reads and writes (:func:`~lightning_dos.model.nvme.files_update`), and their
            order (alternating or forwards) chosen from the model
            (:func:`~lightning_dos.model.nvme.choose_files_order`).
    """

    def __init__(
        self,
        spec: FractionSpec,
        engine: InterleavedUpdate,
        calibrate: Callable[[torch.device], HardwareRates],
        reduce_min: ReduceMin | None = None,
        overlap: str = "off",
        drive: DiskRates | None = None,
    ) -> None:
        self.overlap = check_overlap(overlap)
        self.drive = drive
        #: (forward, backward) seconds per iteration the plan is made for, agreed by the ranks; None until measured.
        self.phases: tuple[float, float] | None = None
        self._new_phases: tuple[float, float] | None = None
        #: The predicted iteration (``overlap``'s composition) of the plan in force, once the phases are known.
        self.iteration_predicted_s: float | None = None
        self.spec = spec
        self.engine = engine
        self._calibrate = calibrate
        self._reduce_min = reduce_min
        self._drifted = False  # seen here, not yet agreed with the other ranks
        #: The device budget handed over by :meth:`observe_budget` (a 1-tuple; None: sample the device when planning).
        self._budget: tuple[int | None] | None = None
        #: The (agreed) device budget the plan in force was made in; None: no limit, or no plan made yet.
        self.budget_bytes: int | None = None
        self.estimator: RateEstimator | None = None
        self._plan: Plan | None = None
        self._planned_at = 0
        self._seen_step = 0
        #: Under overlap="auto" with gradient clipping, the speculation the iteration is planned for (its commit
        #: rate as observed so far): the strategy installs it; None: the updates begun during backward are exact.
        self.speculation: Callable[[], Speculation | None] | None = None
        #: With an NVMe tier, the order of its file-backed sub-groups the model chose for the last step (None: none).
        self.files_order: OrderChoice | None = None
        #: Predicted and measured update times of recent steps, for the monitor and tests.
        self.history: list[tuple[float | None, float]] = []
        #: The prediction from the estimator's base rates (uncorrected) of each step planned and not yet reported.
        self._base_predicted: dict[int, float] = {}
        #: The update phase's own work (DeepSpeed's step around the engine's loop), from the phases measured so far.
        self.own_time = OwnTimeEstimator()
        #: The same, of steps whose updates begun during backward were redone (clipped).
        self.own_time_redone = OwnTimeEstimator()
        #: The update phase predicted for each recent step planned (:meth:`update_phase_predicted_s`).
        self._phase_predicted: dict[int, float] = {}

    @property
    def has_accelerator(self) -> bool:
        return self.engine.device.type != "cpu"

    @property
    def footprint(self) -> Footprint:
        """The engine's rule and dtypes, whose bytes and rates the model counts (Adam in fp32 for an engine that
        does not say)."""
        return getattr(self.engine, "footprint", ADAM_FP32)

    @property
    def rates(self) -> HardwareRates | None:
        return self.estimator.rates if self.estimator is not None else None

    @property
    def wants_phases(self) -> bool:
        """Whether the plan depends on forward and backward times (so the framework should measure them)."""
        return self.spec.mode == "auto" and self.has_accelerator and self.overlap != OFF

    def observe_phases(self, forward_s: float, backward_s: float) -> None:
        """Forward and backward seconds of an iteration the framework measured with no update in flight (each
        summed over the iteration's micro-batches). The next step plans again with them; every rank must
        observe at the same step (they plan together), so a rank that could not measure passes zeros: the ranks
        plan with the largest times any of them measured."""
        self._new_phases = (max(0.0, float(forward_s)), max(0.0, float(backward_s)))

    def observe_budget(self, budget: int | None) -> None:
        """Device bytes the update may use (:meth:`~lightning_dos.engine.loop.InterleavedUpdate.device_budget`),
        sampled by the framework where the device holds what it holds during the update; re-plans use it from now
        on instead of sampling the device where they run (None: no limit)."""
        self._budget = (budget,)

    def _ensure_rates(self) -> HardwareRates:
        if self.estimator is None:
            self.estimator = RateEstimator(self._calibrate(self.engine.device), footprint=self.footprint)
        # The engine reports peaks from the calibration itself; the live estimate follows contention.
        self.engine.use_rates(self.estimator.calibrated)
        return self.estimator.rates

    def __call__(self, step: int) -> tuple[Plan, float | None]:
        self._observe_last_report()
        n = len(self.engine.sub_groups)
        # The order the next forward needs the sub-groups in, once recorded (the same on every rank: same model).
        order = self.engine.need_order
        if self.spec.mode != "auto":
            self._plan = (self._plan or self.spec.plan(n, sizes=self.engine.sizes)).in_order(order)
        elif not self.has_accelerator:
            # No accelerator: the host is the only place worth using; no search is needed.
            self._plan = (self._plan or all_host(n)).in_order(order)
        elif (
            self._plan is None
            or self._plan.order != order
            or self._new_phases is not None
            or step - self._planned_at >= REPLAN_EVERY
            or self._any_rank_drifted(step)
        ):
            # Every condition is the same on every rank (steps, skipped ones included, advance together), so
            # all ranks enter the re-plan's collectives at the same step.
            self._replan(step)
        rates = self._ensure_rates()
        estimator, engine = self.estimator, self.engine
        assert estimator is not None  # made by _ensure_rates
        # The prediction is made from the base rates and then corrected, and the base one kept for this step's
        # report: the correction is learnt against base predictions only, so it cannot compound.
        files = getattr(engine, "files", None)
        if files is not None and self.drive is not None:
            # The tier's reads and writes too, through the engine's staging slabs, in the order the model finds
            # fastest (the iteration's, once the phases are known and the next forward runs beside the update).
            kwargs = {"lp_bytes": engine.lp_bytes, "slots": len(files.swap.slabs), "footprint": self.footprint}
            args = (engine.sizes, self._plan, rates, self.drive, files.indices)
            self.files_order = choose_files_order(*args, phases=self.phases, overlap=self.overlap, **kwargs)
            engine.take_files_in(self.files_order.order)
            base_args = (engine.sizes, self._plan, estimator.base, self.drive, files.indices)
            order, backwards = engine.files_order, engine.files_backwards(step)
            base_s = files_update(*base_args, order=order, backwards=backwards, **kwargs).time_s
        else:
            base_args = (engine.sizes, self._plan, estimator.base, engine.lp_bytes, engine.lp_downloads)
            base_s = predict(*base_args, footprint=self.footprint).time_s
        self._base_predicted[step] = base_s
        predicted = estimator.corrected(base_s)
        self._predict_update_phase(step, predicted)
        return self._plan, predicted

    def _predict_update_phase(self, step: int, engine_update_s: float) -> None:
        """Keep the engine loop's part of ``step``'s update phase, predicted now, before it runs."""
        for old in [s for s in self._phase_predicted if s <= step - PHASE_PREDICTIONS_KEPT]:
            del self._phase_predicted[old]
        self._phase_predicted[step] = update_phase_s(self.overlap, engine_update_s, 0.0)

    def update_phase_predicted_s(self, step: int, redone: bool = False) -> float | None:
        """The update phase (``DOSMonitor``'s ``dos/update_s``: from backward's end to the batch's end) predicted for
        ``step`` before it ran: under ``overlap="off"`` the engine's update loop as the model predicted it when the
        step was planned (:func:`~lightning_dos.model.update_phase.update_phase_s`), and the step's own work as
        measured over the steps before (:class:`~lightning_dos.planning.estimator.OwnTimeEstimator`) in its regime:
        ``redone``, a step whose updates begun during backward are redone (it was clipped: known when backward ends,
        as the phase begins), whose own work runs beside more of the update on the same cores, or any other. None for
        a step not planned here, or before any phase was measured."""
        loop = self._phase_predicted.get(step)
        ways = (self.own_time_redone, self.own_time) if redone else (self.own_time, self.own_time_redone)
        own = next((way.value for way in ways if way.value is not None), None)
        return None if loop is None or own is None else loop + own

    def observe_update_phase(self, phase_s: float, engine_update_s: float, redone: bool = False) -> None:
        """One step's update phase as measured (``DOSMonitor`` hands it over) and its engine's loop
        (``StepReport.update_s``): what the phase held beyond that loop is the step's own work, which later steps'
        predictions in the same regime (``redone``: see :meth:`update_phase_predicted_s`) count."""
        way = self.own_time_redone if redone else self.own_time
        way.observe(own_time_s(self.overlap, phase_s, engine_update_s))

    def _any_rank_drifted(self, step: int) -> bool:
        if self._reduce_min is None or step % DRIFT_CHECK_EVERY:
            return False
        return self._reduce_min([0.0 if self._drifted else 1.0])[0] == 0.0

    def _replan(self, step: int) -> None:
        rates = self._ensure_rates()
        budget = self._budget[0] if self._budget is not None else self.engine.device_budget()
        sizes = list(self.engine.sizes)
        if self._reduce_min is not None:
            # The same inputs on every rank, hence the same plan (choose_plan is deterministic).
            sizes, budget, rates = agreed_plan_inputs(sizes, budget, rates, self._reduce_min)
        self.budget_bytes = budget
        self._drifted = False
        phases, self._new_phases = self._new_phases, None
        if phases is not None and self._reduce_min is not None:
            # The slowest rank's phases (the next step waits for every rank): negated, their minimum is the largest.
            phases = tuple(-t for t in self._reduce_min([-phases[0], -phases[1]]))
        if phases is not None and min(phases) > 0:
            self.phases = phases
        chosen = auto_plan(
            sizes,
            rates,
            self.engine.lp_bytes,
            budget,
            # Resident state stays on the device through forward and backward too, so it is only planned inside a
            # budget the user set; memory that is free at update time (activations gone) is for staging alone.
            allow_resident=self.engine.gpu_memory_budget is not None,
            lp_on_host=self.engine.lp_downloads,
            footprint=self.footprint,
            phases=self.phases,
            overlap=self.overlap,
            speculation=self.speculation() if self.speculation is not None else None,
            order=self.engine.need_order,
        )
        #: The plan that minimises the update alone (the one run with overlap off, or before the phases are known).
        self.update_plan = chosen.update_plan
        self._plan = chosen.plan
        if chosen.iteration_s is not None:
            self.iteration_predicted_s = chosen.iteration_s
        self._planned_at = step

    def _observe_last_report(self) -> None:
        report: StepReport | None = self.engine.last_report
        if report is None or report.step == self._seen_step or report.skipped:
            return
        self._seen_step = report.step
        self.history.append((report.predicted_s, report.update_s))
        base_s = self._base_predicted.pop(report.step, None)
        for step in [s for s in self._base_predicted if s < report.step]:  # planned again, or never reported
            del self._base_predicted[step]
        if self.estimator is None:
            return
        self.estimator.observe(report)
        # An update begun during backward shares the CPU with it (and may be redone): a regime of its own, which
        # holds for stretches of steps (it stops after a run of clipped steps and is tried again later).
        regime = report.speculated > 0
        if base_s is not None and self.estimator.observe_update(base_s, report.update_s, regime):
            if self.spec.mode == "auto" and self.has_accelerator:
                if self._reduce_min is None:
                    self._replan(report.step + 1)
                else:
                    self._drifted = True  # a re-plan is collective: the ranks agree on it at a check step
