"""``DOSMonitor``: per-step phase times, memory per phase and the engine's PCIe traffic, logged and traced.

Every training batch is cut into phases at Lightning's hooks (see the DeepSpeed hook order in the
strategy's docs): *forward* from ``on_train_batch_start`` to ``on_before_backward``, *backward* from
there to ``on_before_optimizer_step`` (which includes DeepSpeed's gradient partitioning to the host,
done inside ``engine.backward``), *update* from there to ``on_train_batch_end`` (DeepSpeed's step with
the Deep Optimizer States engine inside), and *step* the whole batch.

On a GPU the boundaries are CUDA events on the current stream and are read one step late, when they
have completed anyway, so the monitor adds no synchronisation, except once per logged step (every
``log_every_n_steps``), whose events it waits for so that its metrics share the step's row in the logs;
on CPU they are ``time.perf_counter``.
Memory is sampled at the same boundaries: the CUDA caching allocator's counters on a GPU, host RSS
from ``/proc`` (or psutil) on CPU.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dos.integration.callbacks.memory_probe import CudaMemory, HostMemory, MemSample, memory_probe
from lightning_dos.integration.metrics import GB, SUMMARY, engine_peak, step_metrics
from lightning_dos.integration.phases import DeviceClock
from lightning_dos.integration.trace import TracedStep, write_trace
from lightning_dos.model.step_report import StepReport
from lightning_dos.planning.calibrate import copy_bandwidth

PHASES = ("forward", "backward", "update")
#: Steps kept for the end-of-fit summary's medians (the most recent ones; bounded for long runs).
SUMMARY_WINDOW = 10_000


# -- one training batch ---------------------------------------------------------------------------


@dataclass
class _Record:
    """Marks and memory samples of one training batch, until its events can be read."""

    step: int
    marks: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, MemSample] = field(default_factory=dict)
    report: StepReport | None = None
    #: The engine's number for this batch's step report (None: the batch took no optimizer step); the report may
    #: come after the batch ends, when the update overlaps what follows the step.
    report_number: int | None = None
    #: Learning rate of each param group as the batch started (the rates its update used).
    learning_rates: dict[str, float] = field(default_factory=dict)


def _phase_bounds(marks: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(phase, from boundary, to boundary)`` for the phases this batch has marks for."""
    fwd, bwd = "forward_end" in marks, "backward_end" in marks
    if fwd and bwd:
        return [
            ("forward", "start", "forward_end"),
            ("backward", "forward_end", "backward_end"),
            ("update", "backward_end", "end"),
        ]
    if fwd:  # no optimizer step in this batch (accumulating without DeepSpeed): backward runs to the end
        return [("forward", "start", "forward_end"), ("backward", "forward_end", "end")]
    if bwd:  # manual optimisation without a backward hook
        return [("update", "backward_end", "end")]
    return []


def _memory_metrics(record: _Record) -> dict[str, float]:
    """Peak and lowest allocated, and peak reserved, memory of each phase (GB)."""
    row: dict[str, float] = {}
    for phase, a, b in _phase_bounds(record.memory):
        start, end = record.memory[a], record.memory[b]
        row[f"dos/mem_peak_{phase}_gb"] = max(start.allocated, end.allocated, end.peak_allocated) / GB
        # The lowest point is sampled at the boundaries only: allocators expose no running minimum.
        row[f"dos/mem_low_{phase}_gb"] = min(start.allocated, end.allocated) / GB
        row[f"dos/mem_reserved_peak_{phase}_gb"] = max(start.reserved, end.reserved, end.peak_reserved) / GB
    return row


def _engine(trainer: pl.Trainer) -> Any:
    """The Deep Optimizer States engine, when the trainer runs that strategy and has set it up."""
    return getattr(trainer.strategy, "dos_engine", None)


class DOSMonitor(Callback):
    """Logs per-step phase times, memory per phase and PCIe traffic; traces chosen steps; sums up the run.

    Metrics (to every logger of the trainer, at the step they belong to): ``dos/{forward,backward,
    update,step}_s``; for each phase ``dos/mem_peak_<phase>_gb``, ``dos/mem_low_<phase>_gb`` and
    ``dos/mem_reserved_peak_<phase>_gb`` (GB = 1e9 bytes; on CPU, host RSS: anonymous RSS as
    *allocated*, total RSS as *reserved*); and with the Deep Optimizer States strategy, from the
    engine's report of the step: ``dos/h2d_gb``, ``dos/d2h_gb``, ``dos/h2d_gbps``, ``dos/d2h_gbps``
    (bytes over the engine's update time), ``dos/pcie_util`` (both directions' achieved rate over the
    sum of their calibrated peaks), ``dos/gpu_fraction`` (share of elements updated on the device),
    ``dos/engine_update_s`` (the engine's own update loop: inside the update phase under ``overlap="off"``, on beside
    the next forward otherwise), ``dos/engine_update_predicted_s`` (the performance model's prediction of that loop,
    when it made one), ``dos/update_predicted_s`` (the prediction of ``dos/update_s``, made when the step was planned:
    the loop's under ``overlap="off"``, and the step's own work around it as measured over the steps before; from the
    strategy's scheduler, which this monitor hands each measured update phase),
    ``dos/iteration_predicted_s`` (the whole iteration's prediction, overlap included, beside ``dos/step_s``,
    once ``gpu_fraction="auto"`` has timed forward and backward on an accelerator),
    ``dos/pinned_gb`` (host memory really pinned; 0 without CUDA), ``dos/fallback_subgroups`` (sub-groups the
    plan put on the device that ran on the host for lack of device memory), ``dos/speculated`` (host sub-groups
    updated during backward before the step's fate was known: ``overlap="auto"``),
    ``dos/committed`` (1 when those updates were kept, 0 when the step was clipped and they were redone, or
    skipped), ``dos/commit_s`` (the seconds committing the kept ones took after backward) and
    ``dos/commit_rate`` (the share of such steps committed so far), and ``dos/host_threads``, torch's
    intra-op threads on this rank. Beside them, the learning rate each param group's update of the step used
    (``lr-AdamW/pg1``, ... as Lightning's ``LearningRateMonitor`` names it). When the monitor logs at the trainer's
    ``log_every_n_steps`` (the default), a step's metrics go through ``LightningModule.log``, so each logged
    step is one row with the module's own metrics (one row per step in ``metrics.csv``). When the update overlaps
    what follows the step (the strategy's ``overlap``), its report comes after the batch ends: a logged step waits
    for its update (so its row is whole), other steps are resolved once theirs is over (for the summary).

    Args:
        trace_dir: folder for a Chrome trace (``dos-trace-rank<R>.json``) of the ``trace_steps``;
            None writes no trace.
        trace_steps: the steps to trace, as the trainer's ``global_step`` when they start. The engine
            records its per-operation spans only during these steps, so other steps pay nothing for
            them. Early steps (but after the first, which warms caches up) are representative.
        log_every_n_steps: log every n-th step; None follows the trainer's ``log_every_n_steps``.
        summary: print a table of the run's medians at the end of ``fit`` (global rank 0).
        peak_gbps: the link's peak rate per direction in GB/s (PCIe is full duplex: 2x this both ways),
            the denominator of ``dos/pcie_util``. None uses the engine's calibrated
            ``peak_bandwidth()`` once it has one, and until then a copy micro-benchmark (64 MB, pinned
            on CUDA) run once when fitting starts, so the utilisation is always finite.
    """

    def __init__(
        self,
        trace_dir: str | Path | None = None,
        trace_steps: Sequence[int] = (3,),
        log_every_n_steps: int | None = None,
        summary: bool = True,
        peak_gbps: float | None = None,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be None or >= 0, got {log_every_n_steps}")
        if peak_gbps is not None and not (math.isfinite(peak_gbps) and peak_gbps > 0):
            raise ValueError(f"peak_gbps must be None or a positive number, got {peak_gbps}")
        self.peak_gbps = peak_gbps
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.trace_steps = frozenset(int(s) for s in trace_steps)
        self.log_every_n_steps = log_every_n_steps
        self.summary = summary
        #: Path of the trace once written.
        self.trace_path: Path | None = None
        #: Resolved metrics of the most recent steps (what the summary's medians are taken over).
        self.history: deque[dict[str, float]] = deque(maxlen=SUMMARY_WINDOW)
        self._reset()

    def _reset(self) -> None:
        self._clock = DeviceClock(torch.device("cpu"))
        self._memory: CudaMemory | HostMemory | None = None
        self._every = 1
        self._open: _Record | None = None
        self._pending: deque[_Record] = deque()
        self._timing_before: bool | None = None
        #: Fallback peak (bytes/s per direction): ``peak_gbps`` or the fit-start micro-benchmark.
        self._peak: tuple[float, float] | None = None
        self._engine: Any = None
        #: The strategy's scheduler (``dos_scheduler``): it predicts each update phase and takes the measured ones.
        self._scheduler: Any = None
        #: Highest peak the engine's ``peak_bandwidth()`` has reported this fit (bytes/s per direction).
        self._engine_best: tuple[float, float] | None = None
        self._traced: list[TracedStep] = []
        self._trace_origin: Any = None
        #: Steps whose updates were begun speculatively during backward: [redone, committed].
        self._speculative_steps = [0, 0]

    # -- Lightning hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self.history.clear()
        self.trace_path = None
        device = trainer.strategy.root_device
        self._clock = DeviceClock(device)
        self._memory = memory_probe(device)
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        self._every = int(every)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine = _engine(trainer)
        self._scheduler = getattr(trainer.strategy, "dos_scheduler", None)
        if self.peak_gbps is not None:
            self._peak = (self.peak_gbps * GB, self.peak_gbps * GB)
        elif engine is not None and engine_peak(engine) is None:
            # Before the first step, so the copies time an idle link and disturb no measured step.
            self._peak = copy_bandwidth(engine.device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        record = _Record(step=trainer.global_step)
        if self._logs(record.step):
            record.learning_rates = learning_rates(trainer)
        engine = _engine(trainer)
        if engine is not None and self.trace_dir is not None and record.step in self.trace_steps:
            # Spans cost events and bookkeeping: ask for them only on the steps that are drawn.
            self._timing_before = engine.timing
            engine.record_timing(True)
        self._boundary(record, "start")
        self._open = record

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._open is not None and "forward_end" not in self._open.marks:
            self._boundary(self._open, "forward_end")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Everything after on_after_backward up to here (Lightning's closure bookkeeping) counts as backward.
        if self._open is not None and "backward_end" not in self._open.marks:
            self._boundary(self._open, "backward_end")
        engine = _engine(trainer)
        if self._open is not None and engine is not None:
            # The previous step's report is issued (backward waited for its update); this step's comes next.
            self._open.report_number = engine.reports_issued + 1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record, self._open = self._open, None
        if record is None:
            return
        self._boundary(record, "end")
        engine = _engine(trainer)
        if engine is not None:
            self._engine = engine
            self._scheduler = getattr(trainer.strategy, "dos_scheduler", None)
            if self._timing_before is not None:
                engine.record_timing(self._timing_before)
                self._timing_before = None
        self._pending.append(record)
        logged_step = self._logs(record.step)
        adapter = getattr(trainer.strategy, "dos_adapter", None)
        if logged_step and adapter is not None and not self._has_report(record):
            # An overlapped update issues its report once over: a logged step waits for it, so that its row (one per
            # step, with the module's own metrics) holds the step's engine metrics. Steps not logged do not wait.
            adapter.finish_update()
        # A step that is logged is resolved now (on a GPU one wait for its events, at the log interval only), so
        # its metrics go out in the same row as the LightningModule's own (loss, ...) through Lightning's logging.
        self._drain(trainer, wait=logged_step, current=(record, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = _engine(trainer)
        if engine is not None and self._timing_before is not None:  # a traced batch that never ended
            engine.record_timing(self._timing_before)
            self._timing_before = None
        # Loggers are finalised after this hook: read the last step's events now (one sync, at the end).
        self._drain(trainer, wait=True, final=True)
        self._write_trace(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.summary and trainer.is_global_zero and self.history:
            from rich.console import Console

            from lightning_dos.host.console import trimmed

            on_accelerator = trainer.strategy.root_device.type != "cpu"
            with trimmed(Console()) as console:  # no spaces after the centred title
                console.print(summary_table(self.history, on_accelerator=on_accelerator))

    # -- internals -------------------------------------------------------------------------------

    def _boundary(self, record: _Record, name: str) -> None:
        record.marks[name] = self._clock.mark()
        if self._memory is not None:
            record.memory[name] = self._memory.read()

    def _logs(self, step: int) -> bool:
        return self._every > 0 and (step + 1) % self._every == 0

    def _drain(
        self,
        trainer: pl.Trainer,
        wait: bool,
        current: tuple[_Record, pl.LightningModule] | None = None,
        final: bool = False,
    ) -> None:
        """Resolve, log and trace every pending batch whose last event has completed (all when ``wait``) and whose
        step report is in (an overlapped update issues it once over; ``final``: resolve without one if none came).

        ``current`` is the batch whose ``on_train_batch_end`` is running and its module: when its row is logged,
        it goes through ``LightningModule.log`` (one row per step with the module's metrics, plus the learning
        rates); rows resolved later than their own batch go straight to the loggers.
        """
        if wait and self._pending:  # events complete in order on the stream: waiting for the last one is enough
            self._clock.wait(self._pending[-1].marks["end"])
        while self._pending:
            record = self._pending[0]
            if not self._clock.ready(record.marks["end"]) or not (self._has_report(record) or final):
                break
            self._pending.popleft()
            row = self._resolve(record)
            self.history.append(row)
            if self._logs(record.step):
                if current is not None and current[0] is record and self._every == trainer.log_every_n_steps:
                    module = current[1]
                    module.log_dict({**row, **record.learning_rates}, on_step=True, on_epoch=False, batch_size=1)
                else:
                    for logger in trainer.loggers:
                        logger.log_metrics(row, step=record.step)
            if self.trace_dir is not None and record.step in self.trace_steps:
                self._add_traced(record, row)
                if {t.step for t in self._traced} >= self.trace_steps:
                    self._write_trace(trainer)

    def _has_report(self, record: _Record) -> bool:
        """Whether the batch's step report is in (an update overlapping what follows the step issues it later)."""
        if record.report is None and record.report_number is not None and self._engine is not None:
            record.report = self._engine.report_number(record.report_number)
        return record.report is not None or record.report_number is None

    def _seconds_since_start(self, record: _Record, boundary: str) -> float:
        return self._clock.seconds(record.marks["start"], record.marks[boundary])

    def _resolve(self, record: _Record) -> dict[str, float]:
        """The metrics of one batch whose events have all completed."""
        row = {
            f"dos/{phase}_s": self._clock.seconds(record.marks[a], record.marks[b])
            for phase, a, b in _phase_bounds(record.marks)
        }
        if "forward_end" in record.marks:
            row.setdefault("dos/update_s", 0.0)  # a batch without an optimizer step updates nothing
        row["dos/step_s"] = self._seconds_since_start(record, "end")
        # The intra-op threads host Adam and the casts run with (the strategy's host_threads sets them).
        row["dos/host_threads"] = float(torch.get_num_threads())
        row.update(_memory_metrics(record))
        if record.report is not None:
            row.update(self._report_metrics(record.report, row.get("dos/update_s", 0.0)))
            row.update(self._update_phase_predicted(record.report, row.get("dos/update_s")))
        return row

    def _update_phase_predicted(self, report: StepReport, measured_s: float | None) -> dict[str, float]:
        """The scheduler's prediction of this step's update phase, made before the step; then the phase measured is
        handed to the scheduler for the steps after it (in step order: the monitor resolves its steps in order)."""
        scheduler, row = self._scheduler, {}
        if scheduler is None or not hasattr(scheduler, "update_phase_predicted_s"):
            return row
        # Whether the updates begun during backward are redone (the step was clipped) is known as the phase begins.
        redone = report.speculated > 0 and report.committed is False
        predicted = scheduler.update_phase_predicted_s(report.step, redone)
        if predicted is not None and math.isfinite(predicted):
            row["dos/update_predicted_s"] = float(predicted)
        if measured_s is not None and not report.skipped:
            scheduler.observe_update_phase(measured_s, report.update_s, redone)
        return row

    def _report_metrics(self, report: StepReport, measured_update_s: float) -> dict[str, float]:
        if report.committed is not None:
            self._speculative_steps[report.committed] += 1
        # Rates over the engine's own update loop, where the transfers happen; DeepSpeed's prologue
        # (norms, overflow check) in the measured update phase would dilute them.
        seconds = report.update_s if report.update_s > 0 else measured_update_s
        return step_metrics(report, seconds, sum(self._peak_bps()), self._speculative_steps)

    def _peak_bps(self) -> tuple[float, float]:
        """Peak H2D and D2H rates (bytes/s): ``peak_gbps``, else the engine's calibration (it may arrive
        mid-run, so it is asked every time), else the fit-start measurement (taken now if there was none)."""
        if self.peak_gbps is None and self._engine is not None:
            calibrated = engine_peak(self._engine)
            if calibrated is not None:
                # The engine's rates are refined online (scaled down by overheads and contention on small
                # transfers); a peak never falls, so keep the highest seen per direction.
                best = self._engine_best or (0.0, 0.0)
                self._engine_best = (max(best[0], calibrated[0]), max(best[1], calibrated[1]))
            if self._engine_best is not None:
                return self._engine_best
        if self._peak is None:  # the engine appeared only after fit start: measure now
            device = self._engine.device if self._engine is not None else torch.device("cpu")
            self._peak = copy_bandwidth(device)
        return self._peak

    def _add_traced(self, record: _Record, row: dict[str, float]) -> None:
        if self._trace_origin is None:
            self._trace_origin = record.marks["start"]
        phases = [
            (phase, self._seconds_since_start(record, a), self._seconds_since_start(record, b))
            for phase, a, b in _phase_bounds(record.marks)
        ]
        offset = row["dos/step_s"]
        if record.report is not None:
            # The report's clock starts with the engine's update loop, which ends just before the batch
            # does (only DeepSpeed's short epilogue follows): place the loop so that it ends there.
            offset -= record.report.update_s
            if "backward_end" in record.marks:
                offset = max(offset, self._seconds_since_start(record, "backward_end"))
        start = self._clock.seconds(self._trace_origin, record.marks["start"])
        self._traced.append(TracedStep(record.step, start, phases, record.report, offset))

    def _write_trace(self, trainer: pl.Trainer) -> None:
        if self.trace_dir is None or not self._traced or self.trace_path is not None:
            return
        rank = trainer.global_rank
        self.trace_path = write_trace(self.trace_dir / f"dos-trace-rank{rank}.json", self._traced, rank)


def learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    """The current learning rate of every param group, named as Lightning's ``LearningRateMonitor`` names them:
    ``lr-<Optimizer>`` for a single group, ``lr-<Optimizer>/pg<N>`` (from 1) for several."""
    rates: dict[str, float] = {}
    for optimizer in trainer.optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer wraps the user's
        name = f"lr-{type(inner).__name__}"
        groups = optimizer.param_groups
        for i, group in enumerate(groups):
            if "lr" in group:
                rates[name if len(groups) == 1 else f"{name}/pg{i + 1}"] = float(group["lr"])
    return rates


def summary_table(history: Sequence[dict[str, float]], on_accelerator: bool = True) -> Any:
    """A rich table of the medians of ``history`` (rows of :class:`DOSMonitor` metrics).

    Args:
        history: one metrics dict per step.
        on_accelerator: whether the run had an accelerator. Without one, the PCIe rows and the device share
            are left out when they are zero at every step (nothing crossed a bus; they would read as a
            measurement of one), as ``lightning-dos report`` leaves out their panels.
    """
    from rich.table import Table

    table = Table(title=f"Deep Optimizer States: medians over {len(history)} steps")
    table.add_column("")
    table.add_column("median", justify="right")
    table.add_column("of step", justify="right")
    medians = {}
    for metric in SUMMARY:
        values = [row[metric.name] for row in history if metric.name in row]
        if not values or (not on_accelerator and metric.device and not any(values)):
            continue
        medians[metric.key] = statistics.median(values)
    step = medians.get("step_s", 0.0)
    for metric in SUMMARY:
        if metric.key not in medians:
            continue
        value = medians[metric.key]
        share = f"{100 * value / step:.0f}%" if metric.unit == "s" and step > 0 and metric.key != "step_s" else ""
        table.add_row(metric.label, f"{value * metric.scale:.4g} {metric.unit}", share)
    return table
