"""Per-step records of a bench run: which steps are steady, and one JSON line per step for bench/fit.py.

A bench measures steady-state steps only. Left out, besides the warm-up: the iteration the planner times forward and
backward in (``gpu_fraction="auto"`` with overlap on a GPU, every
:data:`~lightning_dos.integration.zero3.MEASURE_PHASES_EVERY` steps from the 2nd: its forward first waits for the
whole update in flight, which then counts as forward), and each step whose plan differs from the step before (a
re-plan: that update, and the forward beside it, run a placement the steps around it do not).

With ``lines=True`` (``bench/run.py --steps-jsonl``) the recorder also turns the engine's per-operation spans on for
every step and notes, on the host's clock, when each all-gather of the forward asked for sub-groups of the update in
flight and when it had them (``wait_sub_groups``, the engine's public wait), how long backward's start waited for
the rest of the update (the adapter's ``settle``: the forward phase's last wait), and when the update issued each
sub-group's 16-bit result (``streams.landed``, the hook a race checker notes the same moment by): the need and
landing times the iteration model assumes. Spans cost a few events per sub-group and step, and the planner's rate
estimator refines its base rates from them on every step instead of on traced steps only: a capture says so
(``"spans": true`` in its run line).

Times in a step's line are seconds since its batch started (``on_train_batch_start``, host clock); device spans are
placed by their events' distance from the update's first event, recorded when the update began on the host.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L

#: A backward all-gather's wait is kept in a line only when it blocked this long (seconds): backward re-gathers every
#: module, and after the update it waited for at the start of backward (overlap) those waits return at once.
BLOCKED_S = 5e-5


@dataclasses.dataclass
class _Batch:
    step: int
    began: float
    forward_done: bool = False
    phase_timing: bool = False
    report_number: int | None = None
    report: Any = None
    rates: dict[str, Any] | None = None
    planner_phases: list[float] | None = None
    speculation: dict[str, float] | None = None
    need_order: list[int] | None = None
    #: The step's global gradient norm before clipping, as DeepSpeed computed it (None: not known); a device tensor
    #: until the lines are written, so that reading it never waits for the device between two steps.
    grad_norm: Any = None
    #: (phase, began, ended, sub-groups) of each all-gather's wait on the update in flight, host clock.
    waits: list[tuple[str, float, float, list[int]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Update:
    began: float
    #: (host clock, sub-group) of each 16-bit result issued.
    landed: list[tuple[float, int]] = dataclasses.field(default_factory=list)


def _us(seconds: float) -> float:
    """Seconds to the microsecond: what a host clock resolves, in a third of the characters."""
    return round(seconds, 6)


def _rates(scheduler: Any) -> dict[str, Any] | None:
    """The rates the planner's prediction of this step came from: calibrated, refined from spans (base), the
    correction (measured over predicted-from-base update loop) and the two together (used)."""
    estimator = getattr(scheduler, "estimator", None)
    if estimator is None:
        return None
    return {
        "calibrated": estimator.calibrated.to_dict(),
        "base": estimator.base.to_dict(),
        "correction": estimator.correction,
        "used": estimator.rates.to_dict(),
    }


def _plan(plan: Any) -> dict[str, Any]:
    return {
        "places": [int(p) for p in plan.places],
        "device_buffers": plan.device_buffers,
        "after_backward": sorted(plan.after_backward),
        "order": list(getattr(plan, "order", ())),
    }


class StepRecorder(L.Callback):
    """Marks each step steady or not; with ``lines``, records what :meth:`lines` writes (see the module docstring).

    Args:
        warmup: steps before the first measured one.
        lines: record spans, waits and landings for the per-step JSON lines.
    """

    def __init__(self, warmup: int, lines: bool = False) -> None:
        self.warmup, self.lines_wanted = warmup, lines
        self._batches: dict[int, _Batch] = {}
        self._open: _Batch | None = None
        self._updates: dict[int, _Update] = {}
        self._engine: Any = None
        self._scheduler: Any = None
        self._adapter: Any = None

    # -- Lightning hooks ------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self._engine = engine = getattr(strategy, "dos_engine", None)
        self._scheduler = getattr(strategy, "dos_scheduler", None)
        self._adapter = getattr(strategy, "dos_adapter", None)
        if engine is None or not self.lines_wanted:
            return
        engine.record_timing(True)
        wait, landed, start = engine.wait_sub_groups, engine.streams.landed, engine.streams.start_timeline

        def wait_sub_groups(indices: Sequence[int], stream: object = None) -> None:
            began = time.perf_counter()
            wait(indices, stream)
            batch = self._open
            if batch is not None:
                phase = "backward" if batch.forward_done else "forward"
                batch.waits.append((phase, began, time.perf_counter(), list(indices)))

        def on_landed(sub_group: int) -> None:
            update = self._updates.get(engine.steps_taken)
            if update is not None:
                update.landed.append((time.perf_counter(), sub_group))
            landed(sub_group)

        def start_timeline(enabled: bool) -> None:
            # Called once per update, on the thread that runs it, after the engine counted the step.
            self._updates[engine.steps_taken] = _Update(time.perf_counter())
            start(enabled)

        adapter = self._adapter
        settle = adapter.settle if adapter is not None else None

        def settle_first() -> None:
            # Backward waits for the whole update in flight first (it writes the gradients the update reads): the
            # rest of the forward's wait, counted in the forward phase (Lightning's on_before_backward comes after).
            began = time.perf_counter()
            settle()
            batch = self._open
            if batch is not None and not batch.forward_done:
                batch.waits.append(("settle", began, time.perf_counter(), []))

        # Instance attributes over the bound methods: the gathers, the engine and the strategy look them up at each
        # call.
        engine.wait_sub_groups, engine.streams.landed = wait_sub_groups, on_landed
        engine.streams.start_timeline = start_timeline
        if adapter is not None:
            adapter.settle = settle_first

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._open = self._batches[trainer.global_step] = _Batch(trainer.global_step, time.perf_counter())

    def on_before_backward(self, *args: Any) -> None:
        if self._open is not None:
            self._open.forward_done = True

    def on_before_optimizer_step(self, *args: Any) -> None:
        batch = self._open
        if batch is None or self._engine is None:
            return
        batch.report_number = self._engine.reports_issued + 1
        # The planner's timed iteration: set by the adapter as its forward began, handed over by the step (read here,
        # between the two). A public property would be better than the adapter's own attribute.
        batch.phase_timing = getattr(self._adapter, "_phases", None) is not None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        batch, self._open = self._open, None
        deepspeed_engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if batch is not None and deepspeed_engine is not None:
            batch.grad_norm = deepspeed_engine.get_global_grad_norm()
        if batch is not None and self._scheduler is not None:
            # The plan and prediction of this step are made by now (before backward under overlap="auto", in the step
            # otherwise), from what the estimator holds until the next step's plan observes this one's report.
            scheduler = self._scheduler
            batch.rates = _rates(scheduler)
            batch.planner_phases = list(scheduler.phases) if scheduler.phases is not None else None
            speculation = scheduler.speculation() if scheduler.speculation is not None else None
            batch.speculation = dataclasses.asdict(speculation) if speculation is not None else None
        if batch is not None and self._engine is not None:
            order = getattr(self._engine, "need_order", None)
            batch.need_order = list(order) if order is not None else None
        self._collect_reports()

    def on_train_end(self, *args: Any) -> None:
        self._collect_reports()

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        engine = self._engine  # kept: the lines are written after the fit, from the engine's sizes
        if engine is not None and self.lines_wanted:
            for owner, name in ((engine, "wait_sub_groups"), (engine.streams, "landed"),
                                (engine.streams, "start_timeline"), (self._adapter, "settle")):  # fmt: skip
                vars(owner).pop(name, None)

    def _collect_reports(self) -> None:
        """Take each step's report while the engine still keeps it (its last few)."""
        if self._engine is None:
            return
        for batch in self._batches.values():
            if batch.report is None and batch.report_number is not None:
                batch.report = self._engine.report_number(batch.report_number)

    # -- what the bench reads --------------------------------------------------------------------------

    def flags(self, step: int) -> dict[str, bool]:
        """Whether ``step`` is warm-up, the planner's timed iteration, a plan switch or a skipped step, and steady
        (none of them)."""
        batch = self._batches.get(step)
        report = batch.report if batch is not None else None
        before = self._batches.get(step - 1)
        previous = before.report if before is not None else None
        switch = report is not None and previous is not None and _plan(report.plan) != _plan(previous.plan)
        flags = {
            "warmup": step < self.warmup,
            "phase_timing": bool(batch and batch.phase_timing),
            "plan_switch": switch,
            "skipped": bool(report is not None and report.skipped),
        }
        return {**flags, "steady": not any(flags.values())}

    def steady(self, rows: Sequence[dict[str, float]], measured: int) -> tuple[list[dict[str, float]], list[int]]:
        """The monitor's rows (one per step, in step order) of the steady steps among the first ``measured``, and
        their steps; every measured row when none is steady (a run too short to have any)."""
        steps = [step for step in range(self.warmup, min(measured, len(rows))) if self.flags(step)["steady"]]
        if not steps:
            steps = list(range(self.warmup, min(measured, len(rows))))
        return [rows[step] for step in steps], steps

    def predictions(self, steps: Sequence[int]) -> dict[str, float | None]:
        """Medians over ``steps`` of what the planner predicted before each: its engine's update loop and, once it
        has measured forward and backward, the whole iteration."""
        reports = [self._batches[s].report for s in steps if s in self._batches and self._batches[s].report]
        loop = [r.predicted_s for r in reports if r.predicted_s is not None]
        iteration = [r.predicted_iteration_s for r in reports if r.predicted_iteration_s is not None]
        return {
            "predicted_update_loop_s": statistics.median(loop) if loop else None,
            "predicted_iteration_s": statistics.median(iteration) if iteration else None,
        }

    def lines(self, rows: Sequence[dict[str, float]], run: dict[str, Any]) -> list[dict[str, Any]]:
        """The run's line (``run``, with the engine's sub-group sizes, 16-bit bytes and footprint) and one line per
        step: its flags, every ``dos/*`` metric the monitor resolved (``rows``, one per step), the plan executed, the
        planner's predictions, the rates it used, forward and backward as it knows them, and need and landing times
        (see the module docstring)."""
        engine = self._engine
        if engine is not None:
            footprint = engine.footprint
            run = {
                **run, "sizes": list(engine.sizes), "lp_bytes": engine.lp_bytes,
                "footprint": {"rule": footprint.rule.name, "master": footprint.master, "state": footprint.state,
                              "grads_on_device": footprint.grads_on_device},
            }  # fmt: skip
        out = [{"kind": "run", **run, "spans": self.lines_wanted and engine is not None}]
        for step, row in enumerate(rows):
            batch = self._batches.get(step)
            line: dict[str, Any] = {"kind": "step", "system": run["system"], "clip": run["clip"], "step": step}
            line.update(self.flags(step))
            line["metrics"] = dict(row)
            line["phases"] = {k: row[f"dos/{k}"] for k in ("forward_s", "backward_s", "update_s", "step_s") if
                              f"dos/{k}" in row}  # fmt: skip
            if batch is not None:
                line["grad_norm"] = float(batch.grad_norm) if batch.grad_norm is not None else None
                line.update(self._engine_line(batch))
            out.append(line)
        return out

    def _engine_line(self, batch: _Batch) -> dict[str, Any]:
        report, t0 = batch.report, batch.began
        line: dict[str, Any] = {
            "rates": batch.rates, "planner_phases": batch.planner_phases, "speculation": batch.speculation,
            "need_order": batch.need_order,
            "waits": [[phase, _us(a - t0), _us(b - t0), indices] for phase, a, b, indices in batch.waits
                      if phase != "backward" or b - a >= BLOCKED_S],
        }  # fmt: skip
        if report is None:
            return line
        line["plan"] = _plan(report.plan)
        line["predicted"] = {"update_loop_s": report.predicted_s, "iteration_s": report.predicted_iteration_s}
        line["engine"] = {"update_s": report.update_s, "speculated": report.speculated, "committed": report.committed,
                          "fallback_host": list(report.fallback_host)}  # fmt: skip
        update = self._updates.get(report.step)
        if update is not None:
            landed: list[float | None] = [None] * len(report.plan.places)
            for at, index in update.landed:
                landed[index] = _us(at - t0)
            origin = update.began - t0
            line["update_began_s"] = _us(origin)
            line["landed_s"] = landed
            line["spans"] = [
                [s.lane, s.sub_group, _us(origin + s.start_s), _us(origin + s.end_s), s.nbytes] for s in report.spans
            ]
        return line


def write_lines(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    """Append ``lines`` to the JSON-lines file at ``path`` (its folder made), one object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for line in lines:
            handle.write(json.dumps(line, separators=(",", ":")) + "\n")


def _cell(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.3f}"


def prediction_table(results: Sequence[Any]) -> str:
    """Measured beside predicted for each of ``results`` (bench/run.py's ``Result``), each column naming what it
    predicts, over the steady steps."""
    lines = [
        "| system | steady steps | update loop s | predicted update loop s | update s | predicted update s | iter s "
        "| predicted iter s |",
        "|" + "---|" * 8,
    ]
    for r in results:
        e = r.extra
        lines.append(
            f"| {r.system} | {len(e.get('steady_steps', ()))} | {_cell(e.get('engine_update_s'))} "
            f"| {_cell(e.get('predicted_update_loop_s'))} | {_cell(r.update_s)} "
            f"| {_cell(e.get('predicted_update_phase_s'))} "
            f"| {_cell(r.step_s)} | {_cell(e.get('predicted_iteration_s'))} |"
        )
    lines.append(
        "\nPredicted by the planner before each step, from its corrected rates: the update loop is the engine's own "
        "(dos/engine_update_s), the update the phase the trainer waits for after backward, the iteration the whole "
        "step with the update overlapped as its mode runs it (once the planner has timed forward and backward). "
        "Medians over the steady steps: after the warm-up, neither the planner's timed iteration (its forward "
        "waits for the whole update) nor a step whose plan differs from the one before."
    )
    return "\n".join(lines)
