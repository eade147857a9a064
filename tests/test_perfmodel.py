"""The performance model, with no GPU: shape of the prediction, optimality, budget, degenerate cases."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dos.model.perfmodel import (
    HardwareRates,
    adam_equivalent,
    device_bytes,
    floor,
    predict,
    rates_for,
    update_bytes,
)
from lightning_dos.model.plan import Place, Plan, all_host, even_plan
from lightning_dos.model.plan_search import _host_tail, choose_plan
from lightning_dos.model.step_report import Span, StepReport
from lightning_dos.model.update_rules import ADAGRAD, ADAM, ADAM_FP32, LION, Footprint
from lightning_dos.planning.estimator import RateEstimator

# One H100 rank with a share of a many-core host: CPU Adam ~2.5 G elements/s, PCIe Gen5.
GPU = HardwareRates(2.5e9, 10e9, 150e9, 50e9, 50e9, 30e9, 30e9)


def rates_strategy():  # noqa: ANN201
    r = st.floats(1e8, 2e11)
    return st.builds(
        HardwareRates, r, r, r, st.floats(1e9, 6e10), st.floats(1e9, 6e10), st.floats(1e9, 6e10), st.floats(1e9, 6e10)
    )


def test_predicted_time_falls_then_rises_in_the_device_share() -> None:
    sizes = [100_000_000] * 40
    times = [predict(sizes, even_plan(40, k / 40), GPU, 2).time_s for k in range(41)]
    best = times.index(min(times))
    assert 0 < best < 40, "neither all-host nor all-device is best on a GPU node"
    assert all(a >= b - 1e-12 for a, b in zip(times[: best + 1], times[1 : best + 1]))
    assert all(a <= b + 1e-12 for a, b in zip(times[best:], times[best + 1 :]))


@settings(max_examples=40, deadline=None)
@given(rates=rates_strategy(), n=st.integers(1, 6), resident=st.booleans(), budget_units=st.integers(0, 7))
def test_chosen_plan_matches_brute_force(rates: HardwareRates, n: int, resident: bool, budget_units: int) -> None:
    """Equal sizes take the quadratic scan (no exhaustive search), which must still be exact."""
    sizes = [1000] * n
    budget = budget_units * 16 * 1000
    places = (Place.HOST, Place.DEVICE, Place.RESIDENT) if resident else (Place.HOST, Place.DEVICE)
    best = min(
        predict(sizes, plan, rates, 2).time_s
        for combo in itertools.product(places, repeat=n)
        for buffers in range(1, 5)
        if device_bytes(sizes, plan := Plan(combo, buffers)) <= budget
    )
    plan, prediction = choose_plan(sizes, rates, budget, 2, allow_resident=resident)
    assert prediction.time_s == pytest.approx(best, rel=1e-9)
    assert device_bytes(sizes, plan) <= budget


@settings(max_examples=40, deadline=None)
@given(
    rates=rates_strategy(),
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=12),
    budget=st.integers(0, 10**6),
)
def test_budget_is_never_exceeded(rates: HardwareRates, sizes: list[int], budget: int) -> None:
    plan, prediction = choose_plan(sizes, rates, budget, 2, allow_resident=True)
    assert prediction.peak_device_bytes == device_bytes(sizes, plan) <= budget


def test_degenerate_cases() -> None:
    assert choose_plan([], GPU, None, 2)[0].places == ()
    assert choose_plan([10**8], GPU, 0, 2)[0] == all_host(1)  # zero budget
    no_gpu = HardwareRates(2.5e9, 10e9, 0.0, 1e9, 1e9, 1e9, 1e9)
    assert choose_plan([10**8] * 8, no_gpu, None, 2)[0] == all_host(8)
    one, _ = choose_plan([10**8], GPU, None, 2)
    assert len(one.places) == 1
    everything, _ = choose_plan([10**6] * 6, GPU, None, 2, allow_resident=True)
    assert set(everything.places) == {Place.RESIDENT}, "a budget that fits everything keeps it all resident"


def test_floor_is_below_every_plan() -> None:
    sizes = [100_000_000] * 20
    r_star, t_floor = floor(sum(sizes), GPU, 2)
    assert 0 < r_star < 1
    assert all(predict(sizes, even_plan(20, k / 20), GPU, 2).time_s >= t_floor * 0.999 for k in range(21))


def _report(step: int, spans: list[Span]) -> StepReport:
    return StepReport(step, all_host(1), (1,), spans=spans)


def test_rate_estimator_converges_and_flags_drift() -> None:
    est = RateEstimator(GPU)
    true_device_eps, true_up = 50e9, 20e9
    for step in range(10):
        est.observe(
            _report(
                step,
                [
                    Span("device_adam", 0, 0.0, 1.0, int(4 * true_device_eps)),
                    Span("upload", 0, 0.0, 1.0, int(true_up)),
                ],
            )
        )
    assert est.rates.device_adam_eps == pytest.approx(true_device_eps, rel=1e-6)
    assert est.rates.duplex_h2d_bps == pytest.approx(true_up, rel=1e-6)
    est.observe(StepReport(99, all_host(1), (1,), skipped=True))  # ignored
    assert [est.observe_update(1.0, 1.05) for _ in range(3)] == [False] * 3
    assert [est.observe_update(1.0, 2.0) for _ in range(3)] == [False, False, True]
    assert est.rates.host_adam_eps < GPU.host_adam_eps, "a slower machine than calibrated is followed"


@settings(max_examples=40, deadline=None)
@given(
    rates=rates_strategy(),
    sizes=st.lists(st.sampled_from([250, 400, 1000]), min_size=1, max_size=6),
    budget=st.one_of(st.none(), st.integers(0, 60_000)),
)
def test_chosen_plan_matches_brute_force_with_uneven_sizes(rates: HardwareRates, sizes: list[int], budget) -> None:  # noqa: ANN001
    plans = [
        Plan(combo, buffers)
        for combo in itertools.product((Place.HOST, Place.DEVICE), repeat=len(sizes))
        for buffers in range(1, 5)
    ]
    best = min(
        predict(sizes, plan, rates, 2).time_s for plan in plans if budget is None or device_bytes(sizes, plan) <= budget
    )
    assert choose_plan(sizes, rates, budget, 2)[1].time_s == pytest.approx(best, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(
    rates=rates_strategy(),
    sizes=st.lists(st.sampled_from([250, 400, 1000]), min_size=2, max_size=5),
    budget=st.one_of(st.none(), st.integers(0, 60_000)),
)
def test_resident_search_with_uneven_sizes_matches_brute_force(rates: HardwareRates, sizes: list[int], budget) -> None:  # noqa: ANN001
    every = (Place.HOST, Place.DEVICE, Place.RESIDENT)
    plans = [Plan(combo, b) for combo in itertools.product(every, repeat=len(sizes)) for b in range(1, 5)]
    best = min(
        predict(sizes, plan, rates, 2).time_s for plan in plans if budget is None or device_bytes(sizes, plan) <= budget
    )
    assert choose_plan(sizes, rates, budget, 2, allow_resident=True)[1].time_s == pytest.approx(best, rel=1e-9)


def test_buffers_that_do_not_shorten_the_update_are_not_kept() -> None:
    sizes = [100_000_000] * 20
    plan, prediction = choose_plan(sizes, GPU, None, 2)
    assert plan.streamed_indices, "GPU rates stream some sub-groups"
    if plan.device_buffers > 1:
        fewer = Plan(plan.places, plan.device_buffers - 1)
        assert predict(sizes, fewer, GPU, 2).time_s > prediction.time_s


def test_planning_a_hundred_sub_groups_is_not_cubic() -> None:
    """A regression guard, not a measurement (bench/resources.py measures): the former search over every
    (resident, streamed, buffers) count predicted each plan in full and took seconds at 50 sub-groups."""
    sizes = [100_000_000 - 7_919 * (i % 13) for i in range(100)]  # unequal: the slowest path
    start = time.perf_counter()
    plan, _ = choose_plan(sizes, GPU, 16 * sum(sizes) // 3, 2, allow_resident=True)
    assert time.perf_counter() - start < 1.0
    assert plan.resident_indices and plan.streamed_indices and plan.host_indices


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), max_size=9),
    per_element=st.floats(1e-3, 10.0),
    lp_per_element=st.floats(1e-3, 10.0),
)
def test_host_lane_of_every_suffix_from_one_backward_pass(sizes: list[int], per_element, lp_per_element) -> None:  # noqa: ANN001
    """The scan reads the host lane of every suffix from one pass; each must be what predict's chain gives."""
    host_s, lp_free = _host_tail(sizes, per_element, lp_per_element)
    for p in range(len(sizes) + 1):
        chained_host = chained_lp = 0.0
        for n in sizes[p:]:
            chained_host += n * per_element
            chained_lp = max(chained_lp, chained_host) + n * lp_per_element
        assert host_s[p] == pytest.approx(chained_host, rel=1e-9, abs=1e-12)
        assert lp_free[p] == pytest.approx(chained_lp, rel=1e-9, abs=1e-12)


# -- bytes and rates per optimizer rule and dtype (issue 21) ------------------------------------------------------

BF16_ADAM = Footprint(ADAM, master=2, state=2)
LION_FP32, ADAGRAD_FP32 = Footprint(LION), Footprint(ADAGRAD)


def test_each_rule_and_dtype_moves_and_holds_its_own_bytes_per_element() -> None:
    """Streamed bytes up and down, resident uploads and device bytes of a plan, from the rule's state count and
    the dtypes: Adam fp32 16/12/4/16 (the engine's figures before issue 21), bf16 Adam half of it, Lion and
    Adagrad (one state tensor each) 12/8/4/12; the device bytes also count one sub-group's temporaries of the
    update formula (Adam fp32 none, bf16 Adam 20 per element, Lion 12, Adagrad 16)."""
    sizes = [1000] * 4
    plan = Plan((Place.DEVICE, Place.DEVICE, Place.RESIDENT, Place.HOST), device_buffers=2)
    expected = {ADAM_FP32: (16, 12, 4, 16, 0), BF16_ADAM: (8, 6, 2, 8, 20), LION_FP32: (12, 8, 4, 12, 12)}
    expected[ADAGRAD_FP32] = (12, 8, 4, 12, 16)
    for footprint, (up, down, resident_up, device, temporaries) in expected.items():
        p = predict(sizes, plan, GPU, 2, footprint=footprint)
        # Two streamed sub-groups up and down, one resident gradient up, one host sub-group's 16-bit upload.
        assert p.h2d_bytes == 2 * 1000 * up + 1000 * resident_up + 1000 * 2, footprint
        assert p.d2h_bytes == 2 * 1000 * down, footprint
        # One resident sub-group and two staging buffers on the device, and one sub-group's temporaries.
        assert footprint.temporaries == temporaries, footprint
        expected_device = 1000 * (3 * device + temporaries)
        assert p.peak_device_bytes == device_bytes(sizes, plan, footprint=footprint) == expected_device
    # The default is Adam in fp32, positionally as the engine's loop calls it.
    assert predict(sizes, plan, GPU, 2, False) == predict(sizes, plan, GPU, 2, False, footprint=ADAM_FP32)


def test_update_rates_scale_by_bytes_touched_and_come_back_exactly_for_the_rule_measured() -> None:
    assert [update_bytes(f) for f in (ADAM_FP32, BF16_ADAM, LION_FP32, ADAGRAD_FP32)] == [28, 14, 20, 20]
    assert rates_for(GPU) == GPU
    bf16 = rates_for(GPU, BF16_ADAM)
    assert bf16.host_adam_eps == pytest.approx(2 * GPU.host_adam_eps)
    assert bf16.device_adam_eps == pytest.approx(2 * GPU.device_adam_eps)
    assert bf16.host_cast_eps == GPU.host_cast_eps and bf16.h2d_bps == GPU.h2d_bps, "only the update scales"
    # A calibration of Lion converts its measured rate to Adam's unit; the model gives that rate back for Lion.
    measured = replace(GPU, host_adam_eps=3.3e9, device_adam_eps=77e9)
    stored = adam_equivalent(measured, LION_FP32)
    assert rates_for(stored, LION_FP32).host_adam_eps == pytest.approx(3.3e9)
    assert rates_for(stored, LION_FP32).device_adam_eps == pytest.approx(77e9)


def test_host_only_update_time_follows_the_rule() -> None:
    sizes = [10_000_000] * 3
    host = all_host(3)
    adam, lion = predict(sizes, host, GPU, 2), predict(sizes, host, GPU, 2, footprint=LION_FP32)
    per_element = 1 / GPU.host_adam_eps * 20 / 28 + 1 / GPU.host_cast_eps
    assert lion.host_s == pytest.approx(sum(sizes) * per_element)
    assert lion.host_s < adam.host_s


def test_half_the_bytes_double_the_device_share_at_the_same_link_time() -> None:
    """With the host's update as fast as the link allows, bf16 state streams twice the elements per PCIe second,
    and the best plan of each footprint matches brute force, within its own device bytes."""
    sizes = [1000] * 6
    # A slow host so that streaming pays; the link is the limit.
    slow_host = HardwareRates(0.2e9, 10e9, 150e9, 50e9, 50e9, 30e9, 30e9)
    for footprint in (ADAM_FP32, BF16_ADAM, LION_FP32):
        budget = 3 * 1000 * footprint.device
        plan, best = choose_plan(sizes, slow_host, budget, 2, allow_resident=True, footprint=footprint)
        brute = min(
            (predict(sizes, Plan(places, b), slow_host, 2, footprint=footprint).time_s, places, b)
            for places in itertools.product((Place.HOST, Place.DEVICE, Place.RESIDENT), repeat=6)
            for b in (1, 2, 3)
            if device_bytes(sizes, Plan(places, b), footprint=footprint) <= budget
        )
        assert best.time_s == pytest.approx(brute[0], rel=1e-9), footprint
        assert best.peak_device_bytes <= budget
        share, t = floor(sum(sizes), slow_host, 2, footprint=footprint)
        assert t <= best.time_s * (1 + 1e-9)
    assert floor(10**9, GPU, 2, footprint=BF16_ADAM)[0] > floor(10**9, GPU, 2)[0]


def test_rate_estimator_keeps_adam_units_for_an_engine_running_another_rule() -> None:
    est = RateEstimator(GPU, footprint=LION_FP32)
    for step in range(5):
        est.observe(_report(step, [Span("device_adam", 0, 0.0, 1.0, int(4 * 70e9))]))
    # Lion's spans showed 70 G elements/s: kept as the Adam-equivalent rate, given back for Lion.
    assert rates_for(est.rates, LION_FP32).device_adam_eps == pytest.approx(70e9, rel=1e-6)
    assert est.rates.device_adam_eps == pytest.approx(70e9 * 20 / 28, rel=1e-6)


FOOTPRINTS = st.sampled_from([ADAM_FP32, BF16_ADAM, LION_FP32, ADAGRAD_FP32, Footprint(ADAM, 2, 4)])


@settings(max_examples=40, deadline=None)
@given(
    rates=rates_strategy(),
    sizes=st.one_of(
        st.integers(1, 6).map(lambda n: [1000] * n),  # equal sizes: the quadratic scan
        st.lists(st.sampled_from([250, 400, 1000]), min_size=1, max_size=5),  # uneven: exhaustive
    ),
    resident=st.booleans(),
    budget_units=st.integers(0, 7),
    footprint=FOOTPRINTS,
)
def test_chosen_plan_matches_brute_force_for_every_rule_and_dtype(
    rates: HardwareRates, sizes: list[int], resident: bool, budget_units: int, footprint: Footprint
) -> None:
    """The search is exact for every footprint, in that footprint's own device bytes."""
    budget = budget_units * footprint.device * 1000
    places = (Place.HOST, Place.DEVICE, Place.RESIDENT) if resident else (Place.HOST, Place.DEVICE)
    best = min(
        predict(sizes, plan, rates, 2, footprint=footprint).time_s
        for combo in itertools.product(places, repeat=len(sizes))
        for buffers in range(1, 5)
        if device_bytes(sizes, plan := Plan(combo, buffers), footprint=footprint) <= budget
    )
    plan, prediction = choose_plan(sizes, rates, budget, 2, allow_resident=resident, footprint=footprint)
    assert prediction.time_s == pytest.approx(best, rel=1e-9)
    assert prediction.peak_device_bytes == device_bytes(sizes, plan, footprint=footprint) <= budget
    # The floor, searched at this plan's streamed share too, is below it (without resident state, which the
    # floor counts only within a budget).
    if not resident:
        share = sum(sizes[i] for i in plan.streamed_indices) / sum(sizes)
        _, t_floor = floor(sum(sizes), rates, 2, shares=[(share, 0.0)], footprint=footprint)
        assert t_floor <= prediction.time_s * (1 + 1e-9)


def test_rate_estimator_reads_update_spans_in_the_master_weights_bytes() -> None:
    """Under bf16 master weights the engine's update spans carry 2 bytes per element: 100 G elements/s of bf16
    Adam are 200 GB/s of span bytes, kept as 50 G elements/s of Adam fp32 (14 bytes touched against 28)."""
    est = RateEstimator(GPU, footprint=BF16_ADAM)
    for step in range(5):
        est.observe(_report(step, [Span("device_adam", 0, 0.0, 1.0, int(2 * 100e9))]))
    assert rates_for(est.rates, BF16_ADAM).device_adam_eps == pytest.approx(100e9, rel=1e-6)
    assert est.rates.device_adam_eps == pytest.approx(50e9, rel=1e-6)


def test_contention_shares_round_trip_default_to_nothing_charged_and_survive_scaling(tmp_path) -> None:  # noqa: ANN001
    """Profiles written before contention was measured still load (every share 1.0: nothing charged); measured
    shares survive a profile's round trip and a uniform rescaling of the rates (they are ratios of rates)."""
    from lightning_dos.planning.profiles import load_profile, save_profile

    old = {k: v for k, v in GPU.to_dict().items() if not k.startswith("overlap_")}
    assert HardwareRates.from_dict(old) == GPU
    paper, _ = load_profile("paper-h100x4")
    assert (paper.overlap_copy_speed, paper.overlap_host_speed, paper.overlap_launch_speed) == (1.0, 1.0, 1.0)
    measured = replace(GPU, overlap_copy_speed=0.8, overlap_host_speed=0.7, overlap_launch_speed=0.6)
    for suffix in ("yaml", "json"):
        assert load_profile(save_profile(tmp_path / f"p.{suffix}", measured, device="cuda"))[0] == measured
    scaled = measured.scaled(0.5)
    assert scaled.host_adam_eps == GPU.host_adam_eps / 2 and scaled.overlap_launch_speed == 0.6
    with pytest.raises(ValueError, match="overlap_copy_speed"):
        HardwareRates.from_dict({**old, "overlap_copy_slowdown": 2.0})


def test_copies_beside_the_host_update_are_charged_their_measured_share() -> None:
    """A link-bound update with host sub-groups takes 1 / overlap_copy_speed as long; one with no host sub-group (no
    host update beside its copies) and a CPU "device" (whose copies add to the host's work) are not charged."""
    from lightning_dos.model.perfmodel import overlapped

    # The device's own work next to nothing: every second of the update is the link's.
    slow_link = replace(GPU, device_adam_eps=1e18, h2d_bps=2e9, d2h_bps=2e9, duplex_h2d_bps=1e9, duplex_d2h_bps=1e9)
    sizes, plan = [10_000_000] * 8, even_plan(8, 0.5)
    alone = predict(sizes, plan, slow_link, 2)
    assert alone.time_s > 2 * alone.host_s, "the link binds"
    half = replace(slow_link, overlap_copy_speed=0.5)
    assert predict(sizes, plan, half, 2).time_s == pytest.approx(2 * alone.time_s, rel=1e-9)
    all_device = even_plan(8, 1.0)
    assert predict(sizes, all_device, half, 2).time_s == predict(sizes, all_device, slow_link, 2).time_s
    cpu = replace(GPU, shared_cpu=True)
    assert predict(sizes, plan, replace(cpu, overlap_copy_speed=0.5), 2) == predict(sizes, plan, cpu, 2)
    assert overlapped(overlapped(half)) == overlapped(half), "rates passed through twice are charged once"
    # The search sees the charge: still the optimum (equal sizes: an exact scan), streaming less than uncharged.
    sizes, charged = sizes[:6], replace(GPU, overlap_copy_speed=0.5)
    brute = min(
        predict(sizes, Plan(combo, buffers), charged, 2).time_s
        for combo in itertools.product((Place.HOST, Place.DEVICE), repeat=6)
        for buffers in range(1, 5)
    )
    chosen, best = choose_plan(sizes, charged, None, 2)
    assert best.time_s == pytest.approx(brute, rel=1e-12)
    assert len(chosen.streamed_indices) < len(choose_plan(sizes, GPU, None, 2)[0].streamed_indices)


def test_the_update_beside_the_training_thread_and_the_training_thread_beside_it_are_slowed_by_their_shares() -> None:
    """Under overlap the host update runs at overlap_host_speed of its rate: a host-bound update beside the training
    thread takes 1 / that share as long; the training thread's work takes 1 / overlap_launch_speed as long."""
    from lightning_dos.model.perfmodel import beside_update_s, overlapped

    sizes, plan = [10_000_000] * 8, all_host(8)
    shared = replace(GPU, overlap_host_speed=0.8, overlap_launch_speed=0.4)
    alone = predict(sizes, plan, shared, 2)
    assert alone == predict(sizes, plan, GPU, 2), "the update alone (overlap off) is not charged"
    beside = predict(sizes, plan, overlapped(shared, beside_training=True), 2)
    assert beside.host_s == pytest.approx(alone.host_s / 0.8, rel=1e-12)
    assert beside.time_s == pytest.approx(alone.time_s + beside.host_s - alone.host_s, rel=1e-12)  # + last upload
    assert overlapped(shared, beside_training=True).overlap_host_speed == 1.0
    assert beside_update_s(0.3, shared) == pytest.approx(0.75) and beside_update_s(0.3, GPU) == 0.3
