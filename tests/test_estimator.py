"""The online rate estimator's correction: converges to what is measured, stays bounded whatever the measurements
(noise, zeros, outliers, drift, a change of regime), never compounds; and in the README's main job the logged
predictions stay near the measured update phase and update loop."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from lightning_dos.model.overlap import MODES
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.update_phase import own_time_s, update_phase_s
from lightning_dos.planning.estimator import CORRECTION_RANGE, OwnTimeEstimator, RateEstimator

ROOT = Path(__file__).resolve().parents[1]
BASE = HardwareRates(2.5e9, 10e9, 150e9, 50e9, 50e9, 30e9, 30e9)
#: Few examples, no deadline (a loaded CI machine), the same examples every run.
QUICK = settings(max_examples=40, deadline=None, derandomize=True)

#: A true correction anywhere in its range but near the ends (where clamping, tested apart, would take over).
truths = st.floats(math.log(CORRECTION_RANGE[0]) + 1, math.log(CORRECTION_RANGE[1]) - 1).map(math.exp)
#: Base predictions that vary from step to step (re-plans, other plans), over several orders of magnitude.
base_predictions = st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=8)


def _run(est: RateEstimator, measured: list[float], bases: list[float]) -> list[float]:
    """Drive ``est`` as the scheduler does: each step predicted from the base rates and corrected, then measured.
    The corrected predictions, in step order."""
    predicted = []
    for step, seconds in enumerate(measured):
        base = bases[step % len(bases)]
        predicted.append(est.corrected(base))
        est.observe_update(base, seconds * base)
    return predicted


def _noise(seed: int, steps: int, k: float) -> list[float]:
    """Multiplicative noise, log-uniform in [1/k, k]."""
    rng = random.Random(seed)
    return [math.exp(rng.uniform(-math.log(k), math.log(k))) for _ in range(steps)]


@QUICK
@given(truth=truths, bases=base_predictions)
def test_the_correction_is_what_is_measured_from_the_first_step_and_never_compounds(
    truth: float, bases: list[float]
) -> None:
    """Measured = truth x the base prediction: from the first step on the correction is the truth, every later
    prediction is the measurement, and the corrected rates are the base ones slowed down by it, however many
    re-plans (the estimator's old correction rescaled its already corrected rates by every drift: it diverged)."""
    est = RateEstimator(BASE)
    predicted = _run(est, [truth] * 60, bases)
    for step, p in enumerate(predicted[1:], start=1):
        assert p == pytest.approx(truth * bases[step % len(bases)], rel=1e-9)
    assert est.correction == pytest.approx(truth, rel=1e-9)
    assert est.rates.host_adam_eps == pytest.approx(BASE.host_adam_eps / truth, rel=1e-9)
    assert est.base == BASE, "the base rates are the calibration's (no spans came)"


@QUICK
@given(truth=truths, k=st.floats(1.0, 3.0), seed=st.integers(0, 2**16), bases=base_predictions)
def test_noisy_measurements_keep_the_correction_within_the_noise(
    truth: float, k: float, seed: int, bases: list[float]
) -> None:
    """Noise up to k either way: the correction never leaves [truth/k, truth*k], and over the run the prediction
    is the measurement's median within 1.5x."""
    est = RateEstimator(BASE)
    measured = [truth * n for n in _noise(seed, 120, k)]
    predicted, corrections = [], []
    for step, seconds in enumerate(measured):
        base = bases[step % len(bases)]
        predicted.append(est.corrected(base) / base)
        est.observe_update(base, seconds * base)
        corrections.append(est.correction)
    assert all(truth / k * (1 - 1e-9) <= c <= truth * k * (1 + 1e-9) for c in corrections), (
        min(corrections),
        max(corrections),
    )
    ratios = sorted(p / m for p, m in zip(predicted[20:], measured[20:], strict=True))
    assert 1 / 1.5 <= ratios[len(ratios) // 2] <= 1.5


BAD = st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf])


@QUICK
@given(
    steps=st.lists(
        st.tuples(
            st.one_of(st.floats(1e-300, 1e300), BAD),  # base prediction
            st.one_of(st.floats(1e-300, 1e300), BAD),  # measurement
            st.booleans(),  # regime
        ),
        min_size=1,
        max_size=60,
    )
)
@example(steps=[(1.0, 2.0, False), *[(1.0, 0.0, False)] * 4, (1.0, math.nan, False), (0.0, 1.0, False)])
def test_zero_non_finite_and_absurd_measurements_never_unbound_the_correction(
    steps: list[tuple[float, float, bool]],
) -> None:
    """Whatever comes in, the correction stays in its range and the rates finite and positive; zero, negative and
    non-finite inputs are ignored outright."""
    est = RateEstimator(BASE)
    low, high = CORRECTION_RANGE
    for base, measured, regime in steps:
        before = est.correction
        est.observe_update(base, measured, regime)
        assert low <= est.correction <= high
        if not (math.isfinite(base) and math.isfinite(measured) and base > 0 and measured > 0):
            assert est.correction == before, "ignored"
        rates = est.rates
        assert all(math.isfinite(v) and v > 0 for v in (rates.host_adam_eps, rates.device_adam_eps, rates.h2d_bps))
        assert math.isfinite(est.corrected(1.0))


@QUICK
@given(
    truth=truths,
    k=st.floats(1.0, 1.15),
    seed=st.integers(0, 2**16),
    outliers=st.lists(
        st.tuples(st.integers(0, 2), st.one_of(st.floats(10.0, 1e9), st.floats(1e-9, 0.1), BAD)), max_size=15
    ),
)
def test_isolated_outliers_do_not_move_the_correction(
    truth: float, k: float, seed: int, outliers: list[tuple[int, float]]
) -> None:
    """Outliers (10x to 1e9x either way, zeros, NaN, infinities) between runs of at least two ordinary steps: the
    correction stays within the ordinary steps' noise."""
    noise = iter(_noise(seed, 100, k))
    measured: list[tuple[float, bool]] = [(truth * next(noise), False) for _ in range(2)]
    for gap, factor in outliers:
        measured.append((truth * factor, True))
        measured += [(truth * next(noise), False) for _ in range(2 + gap)]
    est = RateEstimator(BASE)
    for seconds, _ in measured:
        est.observe_update(1.0, seconds)
        assert truth / k * (1 - 1e-9) <= est.correction <= truth * k * (1 + 1e-9), measured


@QUICK
@given(
    first=truths,
    second=truths,
    k=st.floats(1.0, 1.1),
    before=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    told=st.booleans(),
)
def test_a_change_of_regime_mid_run_is_followed(
    first: float, second: float, k: float, before: int, seed: int, told: bool
) -> None:
    """The truth jumps mid-run. Told of it (a regime of its own), the correction is the new one's from its first
    step; not told, within ``patience`` steps when the jump stands out of the noise and drift (1.2 k^2), and within
    a window of steps whatever the jump. Coming back to a regime seen before, its correction is in force at once."""
    noise = iter(_noise(seed, 200, k))
    est = RateEstimator(BASE)
    for _ in range(before):
        est.observe_update(1.0, first * next(noise), False)
    stands_out = abs(math.log(second / first)) > math.log(1.2 * k * k) + 1e-9
    for step in range(1, est.window + 1):
        est.observe_update(1.0, second * next(noise), told)
        if told or (stands_out and step >= est.patience) or step == est.window:
            assert second / k * (1 - 1e-9) <= est.correction <= second * k * (1 + 1e-9), step
    if told:
        est.observe_update(1.0, first * next(noise), False)
        assert first / k * (1 - 1e-9) <= est.correction <= first * k * (1 + 1e-9)


@QUICK
@given(rate=st.floats(-0.03, 0.03), start=st.floats(0.1, 10.0), bases=base_predictions)
def test_drifting_measurements_are_tracked_within_a_bound(rate: float, start: float, bases: list[float]) -> None:
    """The truth drifts by up to 3% a step (30x over the run): every prediction after the first is within 1.5x of
    its measurement (drift by 20% for 3 steps, then the last steps alone), as long as the truth stays inside the
    correction's range (past it the correction is clamped on purpose: another test shows that)."""
    low, high = CORRECTION_RANGE
    assume(2 * low <= start * (1 + rate) ** 119 <= high / 2)
    est = RateEstimator(BASE)
    measured = [start * (1 + rate) ** t for t in range(120)]
    predicted = _run(est, measured, bases)
    for step, (p, m) in enumerate(zip(predicted[1:], measured[1:], strict=True), start=1):
        ratio = p / (m * bases[step % len(bases)])
        assert 1 / 1.5 <= ratio <= 1.5, (step, ratio)


def test_a_re_plan_is_suggested_when_the_correction_moves_not_for_noise() -> None:
    est = RateEstimator(BASE)
    noise = _noise(0, 60, 1.08)  # the correction moves at most 1.08^2 < 1.2
    flags = [est.observe_update(1.0, 3.0 * n) for n in noise]
    first = est.patience - 1  # never on the first measurements, which are the least typical
    assert flags[first] and not any(flags[:first] + flags[first + 1 :]), "once, 3x the calibration's prediction"
    flags = [est.observe_update(1.0, 0.5) for _ in range(est.patience)]
    assert flags == [False] * (est.patience - 1) + [True], "a change of regime, once it is one"


@QUICK
@given(st.sampled_from(MODES), st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(1e-4, 10.0))
def test_the_update_phase_holds_the_engines_loop_only_when_overlap_is_off(
    mode: str, phase: float, loop: float, predicted_loop: float
) -> None:
    """A measured phase less the loop it holds is the step's own time; that own time and a predicted loop give the
    phase predicted: the loop's prediction under "off" only (otherwise the step returns while the loop runs on)."""
    own = own_time_s(mode, phase, loop)
    assert own == max(0.0, phase - loop) if mode == "off" else own == phase
    expected = own + (predicted_loop if mode == "off" else 0.0)
    assert update_phase_s(mode, predicted_loop, own) == pytest.approx(expected)
    with pytest.raises(ValueError, match="overlap"):
        update_phase_s("sometimes", predicted_loop, own)


def test_the_steps_own_time_is_a_median_of_recent_steps_that_one_stall_does_not_move() -> None:
    est = OwnTimeEstimator(window=5)
    assert est.value is None
    for seconds in (0.007, 0.006, float("nan"), -1.0, 0.008, 0.5, 0.007):  # a stall, and two measurements ignored
        est.observe(seconds)
    assert est.value == 0.007
    for _ in range(5):
        est.observe(0.02)  # a new regime fills the window
    assert est.value == 0.02
    with pytest.raises(ValueError, match="window"):
        OwnTimeEstimator(window=0)


def test_the_prediction_check_ci_runs_on_the_main_job_fails_a_step_off_by_more_than_its_bound(tmp_path: Path) -> None:
    """``bench/prediction.py``, which ``.ci/run`` runs on the README main job's metrics.csv: within bounds it exits
    0; one logged step 5x off (or too few logged steps) fails it, naming the step."""
    from bench.prediction import main

    def write(ratios: list[float]) -> Path:
        path = tmp_path / "metrics.csv"
        rows = [f"{10 * k + 9},{0.01 * r},0.01,0.02,0.02" for k, r in enumerate(ratios)]
        header = "step,dos/update_predicted_s,dos/update_s,dos/engine_update_predicted_s,dos/engine_update_s"
        path.write_text("\n".join([header, *rows]) + "\n")
        return path

    assert main([str(write([1.0] * 40)), "--rows", "40"]) == 0
    assert main([str(write([1.0] * 39 + [5.0])), "--rows", "40"]) == 1
    assert main([str(write([1.0] * 10)), "--rows", "40"]) == 1
    assert main([str(write([5.0] * 40)), "--engine", "--rows", "40"]) == 0  # the engine's pair is its own columns
    assert "--every 4 --rows 40" in (Path(__file__).parents[1] / ".ci" / "run").read_text()


def test_the_update_phase_is_predicted_from_the_steps_before_in_its_regime() -> None:
    """A step whose updates begun during backward are redone (clipped) runs its own work beside more of the update:
    its phase is predicted from earlier redone steps' (from the others' until there is one), the others' from the
    others'; under overlap="off" the engine loop's prediction made at planning is added."""
    import torch

    from lightning_dos.engine.loop import InterleavedUpdate
    from lightning_dos.model.plan import parse_gpu_fraction
    from lightning_dos.planning.scheduler import PlacementScheduler

    engine = InterleavedUpdate([256], [0], 64, torch.device("cpu"), torch.float32, pin=False)
    for overlap, loop in (("auto", 0.0), ("off", 0.5)):
        scheduler = PlacementScheduler(parse_gpu_fraction(0.0), engine, lambda device: None, overlap=overlap)
        scheduler._predict_update_phase(7, 0.5)
        assert scheduler.update_phase_predicted_s(7) is None, "nothing measured yet"
        scheduler.observe_update_phase(0.01 + loop, 0.5)
        assert scheduler.update_phase_predicted_s(7, redone=True) == pytest.approx(loop + 0.01)
        for _ in range(3):
            scheduler.observe_update_phase(0.04 + loop, 0.5, redone=True)
        assert scheduler.update_phase_predicted_s(7, redone=True) == pytest.approx(loop + 0.04)
        assert scheduler.update_phase_predicted_s(7) == pytest.approx(loop + 0.01)
        assert scheduler.update_phase_predicted_s(8) is None, "not planned"
