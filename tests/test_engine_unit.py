"""The engine core on its own (no Lightning, no DeepSpeed): plans, sub-groups and the loop."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model.plan import (
    ALIGN_ELEMENTS,
    AUTO_SUB_GROUPS,
    MAX_AUTO_SUB_GROUP,
    MIN_AUTO_SUB_GROUP,
    Place,
    Plan,
    all_host,
    auto_sub_group_size,
    coarse_share_warning,
    even_plan,
    parse_gpu_fraction,
    random_plan,
    split_into_sub_groups,
    stride_plan,
)


@given(
    numels=st.lists(st.integers(1, 500), min_size=1, max_size=6),
    size=st.integers(1, 200),
)
def test_sub_groups_tile_each_flat_partition_exactly(numels: list[int], size: int) -> None:
    groups = [i % 2 for i in range(len(numels))]
    subs = split_into_sub_groups(numels, groups, size)
    assert all(0 < s.numel < size + ALIGN_ELEMENTS for s in subs)
    for flat, numel in enumerate(numels):
        mine = [s for s in subs if s.ds_group == flat]
        assert sum(s.numel for s in mine) == numel
        assert all(s.param_group == groups[flat] for s in mine)
    offsets = [s.slab_offset for s in subs]
    assert offsets == sorted(offsets) and subs[-1].slab_offset + subs[-1].numel == sum(numels)


@given(n=st.integers(1, 64), fraction=st.floats(0, 1))
def test_even_plan_places_the_requested_share(n: int, fraction: float) -> None:
    plan = even_plan(n, fraction)
    assert len(plan.device_indices) == round(fraction * n)


def test_stride_plan_is_the_papers_rule() -> None:
    assert stride_plan(6, 2).places == (Place.HOST, Place.DEVICE) * 3
    assert stride_plan(6, 3).device_indices == [2, 5]


def test_gpu_fraction_parsing() -> None:
    assert parse_gpu_fraction("auto").mode == "auto"
    assert parse_gpu_fraction("0.25").fraction == 0.25
    assert parse_gpu_fraction(1).fraction == 1.0
    assert parse_gpu_fraction("stride:4").stride == 4
    for bad in ("stride:0", "1.01", -1, "x", float("inf"), True):
        with pytest.raises(ValueError, match="gpu_fraction"):
            parse_gpu_fraction(bad)


def _reference_adam(p, g, m, v, step, h):  # noqa: ANN001, ANN202
    """Plain torch.optim.AdamW/Adam on one flat tensor."""
    param = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if h.decoupled else torch.optim.Adam
    opt = cls([param], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay, foreach=False)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    param.grad = g.clone()
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(3, 40), buffers=st.integers(1, 3))
def test_loop_matches_plain_adam_for_any_plan(seed: int, size: int, buffers: int) -> None:
    torch.manual_seed(seed)
    numels, groups = [50, 37, 64], [0, 1, 1]
    hypers = [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True), Hyper(3e-3, 0.8, 0.95, 1e-6, 0.0, False)]
    engine = InterleavedUpdate(numels, groups, size, torch.device("cpu"), torch.bfloat16)
    engine.pool.param.copy_(torch.randn(sum(numels)))
    rng = random.Random(seed)
    expected = [engine.param_view(i).clone() for i in range(3)]
    moments = [(torch.zeros(n), torch.zeros(n)) for n in numels]
    lp = [torch.zeros(n, dtype=torch.bfloat16) for n in numels]
    for step in (1, 2, 3):
        grads = [torch.randn(n) for n in numels]
        plan = Plan(random_plan(len(engine.sub_groups), rng).places, buffers)
        inputs = StepInputs([g.clone() for g in grads], lp, hypers, [step] * 3, inv_grad_scale=0.5)
        report = engine.step(plan, inputs)
        assert report.device_elements + report.host_elements == sum(numels)
        assert report.d2h_bytes == 12 * report.device_elements
        for i in range(3):
            p, m, v = _reference_adam(expected[i], grads[i] * 0.5, *moments[i], step, hypers[groups[i]])
            expected[i], moments[i] = p, (m, v)
    for i in range(3):
        torch.testing.assert_close(engine.param_view(i), expected[i], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(engine.state_view("exp_avg_sq", i), moments[i][1], rtol=1e-5, atol=1e-9)
        assert torch.equal(lp[i], expected[i].to(torch.bfloat16)), "16-bit copy is the rounded master"


def test_timing_records_one_span_per_operation_and_none_when_off() -> None:
    engine = InterleavedUpdate([100], [0], 25, torch.device("cpu"), torch.float32)
    hyper = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]
    plan = Plan((Place.HOST, Place.DEVICE, Place.HOST, Place.DEVICE))

    def inputs() -> StepInputs:
        return StepInputs([torch.randn(100)], [torch.zeros(100)], hyper, [1])

    assert engine.step(plan, inputs()).spans == []
    engine.record_timing(True)
    spans = engine.step(plan, inputs()).spans
    lanes = sorted(s.lane for s in spans)
    assert lanes == sorted(["host_adam"] * 2 + ["upload", "device_adam", "cast", "download"] * 2)
    assert all(s.end_s >= s.start_s >= 0 for s in spans)


def test_all_host_plan_moves_nothing_on_a_cpu_device() -> None:
    engine = InterleavedUpdate([10], [0], 4, torch.device("cpu"), torch.float32)
    report = engine.step(
        all_host(3), StepInputs([torch.ones(10)], [torch.zeros(10)], [Hyper(1e-3, 0.9, 0.999, 1e-8, 0, True)], [1])
    )
    assert (report.h2d_bytes, report.d2h_bytes, report.device_staging_bytes) == (0, 0, 0)


@given(numel=st.integers(1, 10**7), size=st.integers(1, 10**7))
def test_flats_are_cut_into_near_equal_aligned_pieces(numel: int, size: int) -> None:
    size = max(size, numel // 500 + 1)  # at most 500 pieces: the property, not the loop, is under test
    subs = split_into_sub_groups([numel], [0], size)
    sizes = [s.numel for s in subs]
    assert sum(sizes) == numel
    if size >= ALIGN_ELEMENTS:
        assert len(sizes) == min(-(-numel // size), -(-numel // ALIGN_ELEMENTS))
        assert max(sizes) - min(sizes) <= ALIGN_ELEMENTS and max(sizes) < size + ALIGN_ELEMENTS
        assert all(s.ds_offset % ALIGN_ELEMENTS == 0 for s in subs), "cuts on aligned boundaries"
    else:
        assert len(sizes) == -(-numel // size) and max(sizes) - min(sizes) <= 1 and max(sizes) <= size


def test_a_flat_just_over_the_size_is_halved_not_left_with_a_small_remainder() -> None:
    assert [s.numel for s in split_into_sub_groups([2_100_000], [0], 2_000_000)] == [1_049_984, 1_050_016]


def test_aligned_cuts_give_bitwise_the_result_of_one_whole_update() -> None:
    """Adam over aligned sub-groups is bitwise Adam over the whole flat (the kernels' lanes line up)."""
    torch.manual_seed(0)
    numel = 5000
    hyper = [Hyper(3e-3, 0.9, 0.95, 1e-8, 0.1, True)]
    results = []
    for size in (numel, 700, 1100):
        engine = InterleavedUpdate([numel], [0], size, torch.device("cpu"), torch.float32)
        engine.pool.param.copy_(torch.linspace(-1, 1, numel))
        for step in (1, 2, 3):
            grad = torch.sin(torch.arange(numel, dtype=torch.float32) * (step + 0.5))
            engine.step(all_host(len(engine.sub_groups)), StepInputs([grad], [torch.zeros(numel)], hyper, [step]))
        results.append(engine.param_view(0).clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=40), fraction=st.floats(0, 1))
def test_even_plan_over_elements_lands_within_half_a_sub_group_of_the_share(sizes: list[int], fraction: float) -> None:
    plan = even_plan(len(sizes), fraction, sizes=sizes)
    placed = sum(sizes[i] for i in plan.device_indices)
    assert abs(placed - fraction * sum(sizes)) <= max(sizes) / 2 + 1e-6


def test_auto_sub_group_size_gives_fine_placement_within_bounds() -> None:
    assert auto_sub_group_size(800_000) == MIN_AUTO_SUB_GROUP, "never below the overhead floor"
    assert auto_sub_group_size(5 * 10**9) == MAX_AUTO_SUB_GROUP, "the paper's 1e8 is the ceiling"
    for elements in (10**8, 3 * 10**8, 10**9):
        count = len(split_into_sub_groups([elements], [0], auto_sub_group_size(elements)))
        assert count == AUTO_SUB_GROUPS


def test_a_size_that_cannot_honour_the_share_is_warned_about_naming_the_size_to_use() -> None:
    half = parse_gpu_fraction(0.5)
    message = coarse_share_warning(half, [800_000], 100_000_000)
    assert message is not None and "sub_group_size=100,000,000" in message and "sub_group_size=80000" in message
    # The suggested size does honour it.
    sizes = [s.numel for s in split_into_sub_groups([800_000], [0], 80_000)]
    assert coarse_share_warning(half, sizes, 80_000) is None
    assert coarse_share_warning(parse_gpu_fraction("auto"), [800_000], 100_000_000) is None
    assert coarse_share_warning(parse_gpu_fraction(1.0), [800_000], 100_000_000) is None
    assert "'auto' (1,048,576)" in coarse_share_warning(half, [800_000], 1_048_576, auto=True)


def _resident_engine(keep: bool) -> InterleavedUpdate:
    engine = InterleavedUpdate([96, 40], [0, 0], 32, torch.device("cpu"), torch.float32, keep_resident_grads=keep)
    engine.pool.param.copy_(torch.linspace(-1, 1, 136))
    return engine


def test_resident_sub_groups_read_a_kept_gradient_on_the_device_and_upload_nothing() -> None:
    """keep_gradient copies a final gradient into the resident sub-groups' device slots: a resident sub-group
    kept whole reads it there (the host copy is not uploaded), one kept in part uploads the host copy, and a
    host or streamed sub-group is not affected. Same result as uploading, bit for bit."""
    hyper = [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True)]
    R, H, D = Place.RESIDENT, Place.HOST, Place.DEVICE
    plan = Plan((R, R, D, H, R), 1)  # sub-groups 0-2 in flat 0, 3-4 in flat 1
    kept, plain = _resident_engine(True), _resident_engine(False)
    assert kept.footprint.resident_up == 0 and plain.footprint.resident_up == 4
    torch.manual_seed(0)
    for step in (1, 2, 3):
        grads = [torch.randn(96), torch.randn(40)]
        lp = [[torch.zeros(96), torch.zeros(40)] for _ in range(2)]
        if step > 1:  # resident since step 1: backward writes their gradient on the device
            kept.keep_gradient(0, 0, grads[0][:50])
            kept.keep_gradient(0, 50, grads[0][50:])  # two parameters' partitions, across sub-groups 1 and 2
            kept.keep_gradient(1, 0, grads[1][:30])  # sub-group 4 (elements 20-39) only in part
        reports = [
            engine.step(plan, StepInputs([g.clone() for g in grads], lp[j], hyper, [step, step]))
            for j, engine in enumerate((kept, plain))
        ]
        gradient_bytes = 4 * 32 * 2 if step > 1 else 0  # sub-groups 0 and 1 kept whole
        assert reports[1].h2d_bytes - reports[0].h2d_bytes == gradient_bytes
        assert torch.equal(lp[0][0], lp[1][0]) and torch.equal(lp[0][1], lp[1][1])
    kept.flush_resident()
    plain.flush_resident()
    for ours, theirs in zip((kept.pool.param, *kept.pool.states), (plain.pool.param, *plain.pool.states), strict=True):
        assert torch.equal(ours, theirs)


def test_a_kept_gradient_is_what_the_resident_update_reads() -> None:
    """The kept copy, not the host's, feeds a resident sub-group whole: kept zeros leave Adam's moments at
    zero for it while the host copy holds ones; a sub-group left out keeps uploading."""
    engine = _resident_engine(True)
    hyper = [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.0, True)]
    plan = Plan((Place.RESIDENT,) * 5, 1)
    lp = [torch.zeros(96), torch.zeros(40)]
    engine.step(plan, StepInputs([torch.zeros(96), torch.zeros(40)], lp, hyper, [1, 1]))  # now resident
    engine.keep_gradient(0, 0, torch.zeros(32))  # sub-group 0 whole
    report = engine.step(plan, StepInputs([torch.ones(96), torch.ones(40)], lp, hyper, [2, 2]))
    assert report.h2d_bytes == 4 * (136 - 32)
    engine.flush_resident()
    moment = engine.state_view("exp_avg", 0)
    assert torch.all(moment[:32] == 0) and torch.all(moment[32:] > 0)
    engine.keep_gradient(0, 0, torch.zeros(32))
    engine.discard_kept_gradients()  # a new backward: what was kept before is not this step's
    assert engine.step(plan, StepInputs([torch.ones(96), torch.ones(40)], lp, hyper, [3, 3])).h2d_bytes == 4 * 136
