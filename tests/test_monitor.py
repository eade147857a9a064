"""DOSMonitor, its Chrome trace and ``lightning-dos report``, through real Trainers with CSVLogger on CPU.

Two Deep Optimizer States runs are shared by the module (half the sub-groups on the device, and none);
plain-Lightning runs check that the monitor also works without the engine.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.commands import report as report_cli
from lightning_dos.integration.callbacks.monitor import DOSMonitor, summary_table
from lightning_dos.integration.trace import PHASES_LANE, TracedStep, build_trace, lane_overlaps
from lightning_dos.model.plan import Place, Plan, even_plan
from lightning_dos.model.step_report import LANES, Span, StepReport
from lightning_dos.model.update_rules import ADAM_FP32
from tests.helpers import TinyLM, loader, trainer

SUB_GROUP = 700  # TinyLM has ~8k parameters: about a dozen sub-groups
STEPS = 8
TRACE_STEP = 3
PHASE_METRICS = [f"dos/{p}_s" for p in ("forward", "backward", "update", "step")] + ["dos/host_threads"]
MEMORY_METRICS = [
    f"dos/mem_{kind}_{phase}_gb"
    for phase in ("forward", "backward", "update")
    for kind in ("peak", "low", "reserved_peak")
]
ENGINE_METRICS = [
    "dos/h2d_gb",
    "dos/d2h_gb",
    "dos/h2d_gbps",
    "dos/d2h_gbps",
    "dos/pcie_util",
    "dos/gpu_fraction",
    "dos/engine_update_predicted_s",
    "dos/pinned_gb",
    "dos/engine_update_s",
    "dos/fallback_subgroups",
]


class PredictEveryStep(L.Callback):
    """Give every step a prediction: the engine's own when its planner makes one, else a stand-in.

    The scheduler predicts once it has calibrated rates; the stand-in keeps the monitor's
    ``dos/engine_update_predicted_s`` path under test should a planner return no prediction.
    """

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        adapter = trainer.strategy.dos_adapter
        planner = adapter.planner

        def with_prediction(step: int) -> tuple[Plan, float | None]:
            plan, predicted = planner(step)
            return plan, predicted if predicted is not None else 1e-3 * step

        adapter.planner = with_prediction


@dataclass
class Run:
    root: Path
    monitor: DOSMonitor
    strategy: object
    rows: dict[int, dict[str, float]]  # metrics.csv merged by step


def _rows(root: Path) -> dict[int, dict[str, float]]:
    series = report_cli.read_metrics(report_cli.find_metrics(root))
    rows: dict[int, dict[str, float]] = {}
    for key, (steps, values) in series.items():
        for step, value in zip(steps, values):
            rows.setdefault(step, {})[key] = value
    return rows


def _fit(root: Path, strategy: object, steps: int = STEPS, callbacks: tuple = (), **monitor_kw: object) -> Run:
    L.seed_everything(0, verbose=False)
    monitor = DOSMonitor(trace_dir=root / "trace", trace_steps=(TRACE_STEP,), **monitor_kw)
    logger = CSVLogger(root, name="run")
    trainer(strategy, steps=steps, callbacks=[monitor, *callbacks], logger=logger).fit(TinyLM(), loader())
    return Run(root, monitor, strategy, _rows(root))


def _dos(fraction: float, overlap: str = "off") -> DeepOptimizerStatesStrategy:
    # "off" by default here: the phases then add up to the step (under overlap the update phase is only the
    # step's own part, and the engine's loop runs on into the next batch; see the overlap test below).
    return DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=SUB_GROUP, overlap=overlap)


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("half")
    return _fit(root, _dos(0.5), callbacks=(PredictEveryStep(),), log_every_n_steps=1)


@pytest.fixture(scope="module")
def none_on_device(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _fit(tmp_path_factory.mktemp("none"), _dos(0.0), steps=3, log_every_n_steps=1)


def test_every_metric_is_logged_with_finite_values_at_every_step(half: Run) -> None:
    assert sorted(half.rows) == list(range(STEPS))
    for step, row in half.rows.items():
        for key in PHASE_METRICS + MEMORY_METRICS + ENGINE_METRICS:
            assert key in row, f"{key} missing at step {step}"
            assert math.isfinite(row[key]), f"{key}={row[key]} at step {step}"
        assert row["dos/step_s"] > 0 and row["dos/mem_peak_update_gb"] > 0
        assert 0 < row["dos/pcie_util"] < 1
        assert row["dos/host_threads"] == torch.get_num_threads() >= 1


class FirstOnDevice(L.Callback):
    """Step k (1-based) puts its first k sub-groups on the device and the rest on the host."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = len(trainer.strategy.dos_engine.sub_groups)
        trainer.strategy.dos_adapter.planner = lambda step: (
            Plan(tuple(Place.DEVICE if i < step else Place.HOST for i in range(n))),
            None,
        )


@pytest.mark.parametrize("clip", [0.5, None])  # "auto" overlaps the next forward; without clipping, backward too
def test_under_overlap_each_steps_engine_metrics_are_logged_once_its_update_is_over(
    tmp_path: Path, clip: float | None
) -> None:
    L.seed_everything(0, verbose=False)
    monitor = DOSMonitor(summary=False)
    strategy = _dos(0.5, overlap="auto")
    logger = CSVLogger(tmp_path, name="run")
    callbacks = [monitor, FirstOnDevice()]
    fit = trainer(strategy, steps=4, callbacks=callbacks, logger=logger, log_every_n_steps=1, clip=clip)
    fit.fit(TinyLM(), loader())
    rows = _rows(tmp_path)
    assert sorted(rows) == list(range(4)) and strategy.dos_adapter.overlap == "auto"
    assert strategy.dos_adapter.speculative  # the updates begun in backward speculate, with clipping or without
    for step, row in rows.items():
        assert row["dos/speculated"] >= 0 and ("dos/committed" in row) == (row["dos/speculated"] > 0), (step, row)
        # The time committing is logged on the steps whose speculative updates were kept, and only there.
        assert ("dos/commit_s" in row) == (row.get("dos/committed") == 1.0), (step, row)
        assert row.get("dos/commit_s", 0.0) >= 0.0
    if not clip:  # nothing clips: every step that speculated kept its updates, and committing them took time
        assert any(row.get("dos/committed") == 1.0 and row["dos/commit_s"] > 0.0 for row in rows.values()), rows
    if clip:  # TinyLM's steps clip at 0.5: every speculation is redone, and the running rate says so
        assert any(row["dos/speculated"] > 0 for row in rows.values())
        assert all(row.get("dos/commit_rate", 0.0) == 0.0 for row in rows.values())
    for step, row in rows.items():
        for key in set(ENGINE_METRICS) - {"dos/engine_update_predicted_s"}:  # this planner predicts nothing
            assert key in row and math.isfinite(row[key]), f"{key} at step {step}"
    # Each row carries its own step's report, not a neighbour's: step k (0-based) put its first k + 1 sub-groups
    # on the device.
    sizes = strategy.dos_engine.sizes
    for step, row in rows.items():
        assert row["dos/gpu_fraction"] == pytest.approx(sum(sizes[: step + 1]) / sum(sizes)), step


def test_phases_add_up_to_the_step_time(half: Run) -> None:
    for step, row in half.rows.items():
        phases = row["dos/forward_s"] + row["dos/backward_s"] + row["dos/update_s"]
        assert phases == pytest.approx(row["dos/step_s"], rel=0.10), step
        # The engine's loop is part of the update phase, not more than it.
        assert row["dos/engine_update_s"] <= row["dos/update_s"]


def test_the_update_phase_predicted_is_the_loops_prediction_and_the_steps_own_time_before_it(half: Run) -> None:
    """Under overlap="off" the update phase holds the engine's loop: each step's ``dos/update_predicted_s`` is the
    model's prediction of the loop plus the median of what the earlier steps' phases held beyond their loops (the
    step's own work), so it is made before the step; the first step, with no phase measured before it, has none."""
    rows = [half.rows[step] for step in range(STEPS)]
    assert "dos/update_predicted_s" not in rows[0]
    own = [max(0.0, row["dos/update_s"] - row["dos/engine_update_s"]) for row in rows]
    for step in range(1, STEPS):
        expected = rows[step]["dos/engine_update_predicted_s"] + statistics.median(own[:step])
        assert rows[step]["dos/update_predicted_s"] == pytest.approx(expected, rel=1e-6), step


def test_bytes_down_are_what_the_plan_implies(half: Run, none_on_device: Run) -> None:
    engine = half.strategy.dos_engine
    plan = even_plan(len(engine.sizes), 0.5, sizes=engine.sizes)  # gpu_fraction is a share of elements
    device_elements = sum(engine.sizes[i] for i in plan.device_indices)
    assert device_elements > 0
    for row in half.rows.values():
        # 12 bytes per device-updated element: fp32 param, exp_avg and exp_avg_sq come home.
        assert row["dos/d2h_gb"] * 1e9 == pytest.approx(ADAM_FP32.streamed_down * device_elements, rel=1e-9)
        assert row["dos/gpu_fraction"] == pytest.approx(device_elements / sum(engine.sizes))
    for row in none_on_device.rows.values():
        assert row["dos/d2h_gb"] == 0.0 and row["dos/gpu_fraction"] == 0.0
    assert min(r["dos/d2h_gb"] for r in half.rows.values()) > max(r["dos/d2h_gb"] for r in none_on_device.rows.values())


def test_trace_has_a_lane_per_kind_and_no_overlaps_within_a_lane(half: Run) -> None:
    path = half.monitor.trace_path
    assert path is not None and path.parent == half.root / "trace"
    trace = json.loads(path.read_text())
    lanes = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(lanes) == {PHASES_LANE, *LANES}
    assert len(set(lanes.values())) == len(lanes), "one tid per lane"
    assert lane_overlaps(trace) == []
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {TRACE_STEP}
    phases = [e["name"] for e in spans if e["tid"] == lanes[PHASES_LANE]]
    assert phases == ["forward", "backward", "update"]
    engine = half.strategy.dos_engine
    # A CPU "device" has no 16-bit upload lane's work; every other lane has one span per sub-group.
    for lane in ("host_adam", "upload", "device_adam", "cast", "download"):
        events = [e for e in spans if e["tid"] == lanes[lane]]
        assert events, lane
        assert all(e["args"]["bytes"] > 0 and 0 <= e["args"]["sub_group"] < len(engine.sizes) for e in events)
    assert {e["args"]["sub_group"] for e in spans if e["tid"] in (lanes["host_adam"], lanes["device_adam"])} == set(
        range(len(engine.sizes))
    )
    # Timing was on for the traced step only, and is back off.
    assert engine.timing is False and engine.last_report.spans == []


def test_trace_writer_clips_spans_that_overlap_in_a_lane() -> None:
    report = StepReport(
        step=1,
        plan=Plan(()),
        sizes=(),
        spans=[
            Span("upload", 0, 0.0, 0.002, 64),
            Span("upload", 1, 0.001, 0.003, 64),
            Span("cast", 0, 0.0, 0.001),
        ],
    )
    steps = [TracedStep(0, 0.0, [("forward", 0.0, 0.01), ("update", 0.01, 0.02)], report, engine_offset_s=0.01)]
    with pytest.warns(RuntimeWarning, match="overlapped"):
        trace = build_trace(steps)
    assert trace["otherData"]["clipped_spans"] == 1
    assert lane_overlaps(trace) == []
    upload = sorted((e for e in trace["traceEvents"] if e.get("cat") == "upload"), key=lambda e: e["ts"])
    assert [e["ts"] for e in upload] == [10_000.0, 12_000.0]
    assert upload[1]["dur"] == 1_000.0  # clipped to start where the first ended, same end
    json.dumps(trace)  # serialisable as written


def test_report_draws_a_png(half: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.png"
    assert report_cli.main([str(half.root), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    # Default output next to the run.
    assert report_cli.main([str(half.root)]) == 0 and (half.root / "dos-report.png").is_file()


def test_report_draws_the_newest_run_with_dos_metrics_and_names_it(
    half: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fit's log, then a real `validate` into the same folder: a newer version with val/loss and no dos/.
    fit_log = tmp_path / "csv" / "version_0" / "metrics.csv"
    fit_log.parent.mkdir(parents=True)
    fit_log.write_bytes(report_cli.find_metrics(half.root).read_bytes())
    L.Trainer(
        accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False, limit_val_batches=2
    ).validate(TinyLM(), loader(), verbose=False)
    assert report_cli.find_metrics(tmp_path).parent.name == "version_1"
    capsys.readouterr()
    assert report_cli.main([str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # said in lines of 80 columns
    assert out.startswith(
        "lightning-dos report: drawing csv/version_0 (newest with dos/ metrics; skipped csv/version_1)"
    )
    # Only a log without dos/ metrics: the advice names the training run.
    fit_log.unlink()
    assert report_cli.main([str(tmp_path)]) == 1
    assert "has dos/ metrics; add the DOSMonitor callback to the training run" in " ".join(
        capsys.readouterr().err.split()
    )


def test_report_medians_leave_out_the_rows_the_console_leaves_out(half: Run, none_on_device: Run) -> None:
    def labels(run: Run) -> set[str]:
        return {
            row[:24].strip()
            for row in report_cli.median_rows(report_cli.read_metrics(report_cli.find_metrics(run.root)))
        }

    def console(run: Run) -> set[str]:
        return set(summary_table(run.monitor.history, on_accelerator=False).columns[0].cells)

    # No device share and no bus on CPU with nothing on the device: the console shows neither row, nor the report.
    assert {"device share", "host to device"}.isdisjoint(labels(none_on_device) | console(none_on_device))
    assert "update" in labels(none_on_device)
    # Half the update on the simulated device: both show them.
    assert {"device share", "host to device"} <= labels(half) & console(half)


def test_report_without_matplotlib_says_how_to_install_it(
    half: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib is a dependency (pyproject.toml), so this is an environment installed with --no-deps or broken
    after: the report still says what is missing and how to add it, in 80 columns."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert report_cli.main([str(half.root)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'matplotlib>=3.8.0'" in err
    assert max(len(line) for line in err.splitlines()) <= 80


def test_report_refuses_a_folder_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_cli.main([str(tmp_path)]) == 1
    assert "no metrics.csv" in capsys.readouterr().err
    assert report_cli.main([]) == 2  # RUN_DIR is required


def test_monitor_without_the_engine_logs_phases_and_memory_and_sums_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fit(tmp_path, "auto", steps=6, log_every_n_steps=3)
    assert sorted(run.rows) == [2, 5], "every third step, as Lightning counts"
    for row in run.rows.values():
        assert all(math.isfinite(row[k]) for k in PHASE_METRICS + MEMORY_METRICS)
        assert not any(k in row for k in ENGINE_METRICS)
        phases = row["dos/forward_s"] + row["dos/backward_s"] + row["dos/update_s"]
        assert phases == pytest.approx(row["dos/step_s"], rel=0.10)
    assert len(run.monitor.history) == 6, "every step is measured, whatever is logged"
    assert "medians over 6 steps" in capsys.readouterr().out
    assert run.monitor.trace_path is not None and lane_overlaps(json.loads(run.monitor.trace_path.read_text())) == []


class _Event:
    """A CUDA event stand-in: complete only once the test (or a wait) says so."""

    def __init__(self, t: float) -> None:
        self.t, self.done = t, False


class _LazyClock:
    """The monitor's clock interface over :class:`_Event`; counts host waits (synchronisations)."""

    def __init__(self) -> None:
        self.now, self.events, self.waits = 0.0, [], 0

    def mark(self) -> _Event:
        self.events.append(_Event(self.now))
        return self.events[-1]

    def ready(self, mark: _Event) -> bool:
        return mark.done

    def wait(self, mark: _Event) -> None:
        self.waits += 1
        for event in self.events[: self.events.index(mark) + 1]:  # one stream: events complete in order
            event.done = True

    def seconds(self, start: _Event, end: _Event) -> float:
        assert start.done and end.done, "an event was read before it completed"
        return end.t - start.t


def test_device_events_are_read_lazily_and_waited_for_only_on_logged_steps() -> None:
    """Between logged steps nothing waits on the device; a logged step is resolved in its own batch-end hook
    (one wait) and goes through LightningModule.log, so it shares its row with the module's metrics."""
    to_loggers: list[tuple[int, dict]] = []
    through_module: list[tuple[int, dict]] = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: to_loggers.append((step, metrics)))
    fake = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        log_every_n_steps=3,
        loggers=[logger],
        optimizers=[],
        global_step=0,
        global_rank=0,
        is_global_zero=True,
    )
    module = SimpleNamespace(log_dict=lambda metrics, **kw: through_module.append((fake.global_step, dict(metrics))))
    monitor = DOSMonitor(summary=False)
    monitor.setup(fake, None, "fit")
    clock = monitor._clock = _LazyClock()
    monitor._memory = None
    for step in range(6):
        fake.global_step = step
        monitor.on_train_batch_start(fake, module, None, step)
        for hook, seconds in ((monitor.on_before_backward, 1.0), (monitor.on_before_optimizer_step, 2.0)):
            clock.now += seconds
            hook(fake, module, None)
        clock.now += 3.0
        monitor.on_train_batch_end(fake, module, None, None, step)
        # Unlogged steps are read once complete, one step late; a logged step is read at once.
        assert len(monitor.history) == (step + 1 if step in (2, 5) else step)
        for event in clock.events:
            event.done = True
    assert clock.waits == 2, "one wait per logged step, none otherwise"
    monitor.on_train_end(fake, module)
    assert to_loggers == []
    assert [s for s, _ in through_module] == [2, 5]
    assert through_module[0][1] == {
        "dos/forward_s": 1.0,
        "dos/backward_s": 2.0,
        "dos/update_s": 3.0,
        "dos/step_s": 6.0,
        "dos/host_threads": float(torch.get_num_threads()),
    }


def _report(h2d: int, d2h: int, update_s: float) -> StepReport:
    return StepReport(step=1, plan=Plan(()), sizes=(), update_s=update_s, h2d_bytes=h2d, d2h_bytes=d2h)


def test_pcie_util_uses_peak_gbps_then_the_engines_calibration_then_a_measurement(half: Run) -> None:
    report = _report(h2d=3 * 10**9, d2h=1 * 10**9, update_s=1.0)  # 4 GB/s both ways together
    given = DOSMonitor(peak_gbps=4.0)  # 4 GB/s each way: 8 GB/s full duplex
    given.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(dos_engine=None)), None)
    assert given._report_metrics(report, 2.0)["dos/pcie_util"] == pytest.approx(0.5)
    # The engine's calibration wins over a measurement, and is asked again every step (it arrives mid-run).
    rates: list[tuple[float, float] | None] = [None]
    engine = SimpleNamespace(device=torch.device("cpu"), peak_bandwidth=lambda: rates[0])
    monitor = DOSMonitor()
    monitor.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(dos_engine=engine)), None)
    measured = monitor._peak
    assert measured is not None and all(math.isfinite(v) and v > 0 for v in measured), "measured at fit start"
    assert monitor._report_metrics(report, 2.0)["dos/pcie_util"] == pytest.approx(4e9 / sum(measured))
    rates[0] = (6e9, 2e9)
    assert monitor._report_metrics(report, 2.0)["dos/pcie_util"] == pytest.approx(0.5)
    # The engine refines its rates online, down to what small transfers achieve; a peak does not fall.
    rates[0] = (1e6, 1e6)
    assert monitor._report_metrics(report, 2.0)["dos/pcie_util"] == pytest.approx(0.5)
    # The real run: its utilisation is over the engine's calibrated rates, not their online refinement.
    engine = half.strategy.dos_engine
    calibrated = half.strategy.dos_scheduler.estimator.calibrated
    assert engine.peak_bandwidth() is not None
    best = half.monitor._engine_best
    assert best is not None and best[0] >= calibrated.h2d_bps and best[1] >= calibrated.d2h_bps
    row = half.rows[STEPS - 1]
    achieved = (row["dos/h2d_gb"] + row["dos/d2h_gb"]) * 1e9 / row["dos/engine_update_s"]
    assert row["dos/pcie_util"] == pytest.approx(achieved / sum(best), rel=1e-3)
    with pytest.raises(ValueError, match="peak_gbps"):
        DOSMonitor(peak_gbps=0.0)


def test_the_iteration_predicted_for_a_step_is_logged_beside_its_step_time() -> None:
    report = _report(h2d=0, d2h=0, update_s=1.0)
    monitor = DOSMonitor(peak_gbps=4.0)
    monitor.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(dos_engine=None)), None)
    assert "dos/iteration_predicted_s" not in monitor._report_metrics(report, 1.0)  # phases not timed yet
    report.predicted_iteration_s = 2.5
    assert monitor._report_metrics(report, 1.0)["dos/iteration_predicted_s"] == 2.5
    table = summary_table([{"dos/step_s": 2.0, "dos/iteration_predicted_s": 2.5}])
    assert [cell for cell in table.columns[0].cells] == ["step", "step predicted"]


def _traced_lanes(root: Path, strategy: DeepOptimizerStatesStrategy) -> tuple[set[str], set[str]]:
    """The lanes with spans in the trace DOSMonitor writes of step 3 of a 12-step run, and those the traced step's
    plan implies (host sub-groups: host_adam; device ones: device_adam and cast, and streamed ones their copies)."""
    run = _fit(root, strategy, steps=12, summary=False, log_every_n_steps=1)
    trace = json.loads(run.monitor.trace_path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    (traced,) = run.monitor._traced
    places = set(traced.report.plan.places)
    implied = {PHASES_LANE} | ({"host_adam"} if Place.HOST in places else set())
    implied |= {"device_adam", "cast"} if places & {Place.DEVICE, Place.RESIDENT} else set()
    implied |= {"upload", "download"} if Place.DEVICE in places else set()
    implied |= {"host_speculate"} if traced.report.speculated else set()  # with clipping, under overlap="auto"
    return {names[e["tid"]] for e in trace["traceEvents"] if e["ph"] == "X"}, implied


@pytest.mark.parametrize("fraction", ["auto", 0.5])
def test_under_the_default_overlap_the_trace_has_every_lane_it_has_under_off(tmp_path: Path, fraction: object) -> None:
    """overlap="auto" (the default) runs the update on a thread of its own, on past the end of the batch that began
    it (where the monitor turns timing off again): the traced step's spans must still come back, every lane that
    "off" draws, and every lane the step's plan implies."""
    off, implied_off = _traced_lanes(
        tmp_path / "off", DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=SUB_GROUP, overlap="off")
    )
    assert off == implied_off
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=SUB_GROUP)
    lanes, implied = _traced_lanes(tmp_path / "auto", strategy)
    assert strategy.overlap == "auto" and strategy.dos_adapter.overlap != "off"
    assert lanes == implied and len(lanes) > 1, sorted(lanes)
    if fraction == 0.5:  # the same placement: the same lanes as "off"
        expected = {PHASES_LANE, "host_adam", "upload", "device_adam", "cast", "download"}
        assert lanes - {"host_speculate"} == off == expected
