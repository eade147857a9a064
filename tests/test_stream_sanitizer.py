"""The engine's stream ordering, checked on CPU: simulated streams plus a stream-race checker.

The engine runs its accelerator path on a simulated accelerator (device staging, 16-bit staging and the
``lp_h2d`` upload), every aten op is checked for happens-before, and the results must equal plain AdamW.
A mutation test removes, one at a time, every wait, host wait and tail event the engine's source contains, and the
device synchronisations of its failure paths (an update finished on the host), and expects the checker to report a
race for each.
"""

from __future__ import annotations

import ast
import copy
import functools
import gc
import importlib
import inspect
import pkgutil
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_dos.engine.loop as loop_module
import lightning_dos.engine.pool as pool_module
from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.atomic import UpdateInterrupted
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import StepInputs
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAGRAD, ADAM, LION, Footprint
from lightning_dos.sim.sanitizer import SanitizerUnavailableError, StreamSanitizer
from lightning_dos.sim.simdrive import SimSwapFile
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, max_relative_error, trainer

H, D, R = Place.HOST, Place.DEVICE, Place.RESIDENT
NUMELS, GROUPS, SUB_GROUP = (48, 40, 64), (0, 1, 1), 16  # 10 sub-groups over 3 flats, 2 param groups
N_SUB_GROUPS = 10
HYPERS = (Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True), Hyper(3e-3, 0.8, 0.95, 1e-6, 0.0, True))


def mixed(*pattern: Place) -> tuple[Place, ...]:
    return tuple(pattern[i % len(pattern)] for i in range(N_SUB_GROUPS))


@dataclass(frozen=True)
class Scenario:
    """Steps to run: a :class:`Plan`, or "flush" (checkpoint save), "drop" (checkpoint load), "skip"."""

    name: str
    steps: tuple
    memory_limit: int | None = None
    budget: int | None = None
    inv_grad_scale: float = 1.0
    expect_fallback: bool = False
    #: ``(point, sub_group, exception)`` raised once inside the second step (the interrupted-update paths): at one of
    #: the engine's progress points (its ``on_point`` seam), or at ``"device_update"``, as the device reports an error
    #: once the sub-group's update kernels are queued (its staging still in use). Interrupted before any change, the
    #: step is taken again (the framework did not count it), once the interrupted one's error is dropped.
    fail_at: tuple | None = None
    #: The 16-bit parameters live in host memory (DeepSpeed's parameter offload): device sub-groups download
    #: their 16-bit result, host sub-groups cast straight into it.
    lp_on_host: bool = False
    #: Slots of the 16-bit staging ring (None: the engine's default, one per sub-group); a bounded ring
    #: reuses slots within a step, behind the host's wait for each slot's last upload.
    lp_staging_slots: int | None = None
    #: The second half of the sub-groups keep their state in a swap file (the NVMe tier, through DeepSpeed's async
    #: I/O op): loaded before their update, written back after it (a streamed one once its download landed).
    files: bool = False
    #: The order the file-backed host sub-groups are taken in (``model.nvme.ORDERS``; the planner's choice).
    files_order: str = "alternate"
    #: The swap file's staging slabs (the adapter opens 4 to 16).
    file_slots: int = 2
    #: What a query of an event answers (``SimStreams.events_done``): False drives the engine's waiting path.
    events_done: bool = True


SCENARIOS = (
    Scenario("all-host", (Plan(mixed(H)),) * 2),
    Scenario("streamed, 1 buffer", (Plan(mixed(D), 1),) * 2, inv_grad_scale=0.5),
    Scenario("streamed, 2 buffers", (Plan(mixed(D), 2),) * 2),
    Scenario("streamed, 4 buffers", (Plan(mixed(D), 4),) * 2),
    Scenario("mixed", (Plan(mixed(H, D, R, D), 2),) * 3, inv_grad_scale=0.25),
    Scenario("all-resident", (Plan(mixed(R)),) * 3),
    Scenario("eviction", (Plan(mixed(R)), Plan(mixed(D, H), 1), Plan(mixed(R, D)), Plan(mixed(H)))),
    Scenario("checkpoint", (Plan(mixed(R, D, H)), "flush", Plan(mixed(R, D, H)), "drop", Plan(mixed(R, H)))),
    Scenario("out of memory", (Plan(mixed(D, R), 2),) * 2, memory_limit=0, expect_fallback=True),
    Scenario("budget shrink", (Plan(mixed(D, R, H), 4),) * 2, budget=700, expect_fallback=True),
    Scenario("fp16 skip", (Plan(mixed(D, H, R)), "skip", Plan(mixed(D, H, R)), "skip", Plan(mixed(H, D)))),
    Scenario(
        "interrupted mid-stream",
        (Plan(mixed(D, R, H), 1),) * 3,
        inv_grad_scale=0.5,
        fail_at=("computed", 3, RuntimeError("a kernel failed")),
    ),
    Scenario(
        "out of memory mid-stream",
        (Plan(mixed(D, R, H), 1),) * 3,
        fail_at=("downloading", 6, torch.OutOfMemoryError("simulated")),
        expect_fallback=True,
    ),
    # Before any change, with the first streamed sub-group's upload and update still queued on its staging buffer:
    # pre-step, the staging freed once the device is idle (or, begun during backward, finished on the host).
    Scenario(
        "a kernel failing before any change",
        (Plan(mixed(D, H), 2),) * 3,
        fail_at=("device_update", 0, RuntimeError("a kernel failed")),
    ),
    # Only the last resident sub-group is left, updated but not yet cast: the host finishes it with a copy on the
    # device, which the next forward's all-gather reads once the step returns.
    Scenario(
        "out of memory after the last resident update",
        (Plan(mixed(R)),) * 2,
        fail_at=("updated", N_SUB_GROUPS - 1, torch.OutOfMemoryError("simulated")),
        expect_fallback=True,
    ),
    Scenario("parameter offload", (Plan(mixed(D, H, R, D), 2),) * 3, inv_grad_scale=0.5, lp_on_host=True),
    Scenario("parameter offload, 1 buffer", (Plan(mixed(D, R), 1), Plan(mixed(D, H), 1)), lp_on_host=True),
    # Nothing streams behind the resident downloads: only their own tail event covers them.
    Scenario("parameter offload, all resident", (Plan(mixed(R)),) * 2, lp_on_host=True),
    Scenario("bounded 16-bit staging ring", (Plan(mixed(H, D, H), 2),) * 2, lp_staging_slots=2),
    # The NVMe tier on the simulated drive (no libaio needed): its staging slabs race-checked too.
    Scenario("state in files", (Plan(mixed(H, D, R, D), 2),) * 3, inv_grad_scale=0.5, files=True),
    Scenario("state in files, 1 buffer", (Plan(mixed(D), 1), Plan(mixed(D, H), 1)), files=True),
    Scenario("state in files, forwards", (Plan(mixed(H, D), 1),) * 3, files=True, files_order="forward"),
    # Enough slabs for a sub-group to be updated in the slab its record's last write-back left it in: only the wait
    # for every write at the end of the update orders that write before the update.
    Scenario("state in files, 3 slabs", (Plan(mixed(D, H), 1),) * 3, files=True, file_slots=3),
    # No download found landed by a query: each is waited for, when its slab is needed or at the step's end.
    Scenario("state in files, downloads waited for", (Plan(mixed(D, H), 1),) * 3, files=True, events_done=False),
)


#: (update rule, master dtype, state dtype) of the engine a scenario runs; the first is plain AdamW's.
CASES = {
    "adam-fp32": (ADAM, torch.float32, torch.float32),
    "adagrad-fp32": (ADAGRAD, torch.float32, torch.float32),
    "lion-fp32": (LION, torch.float32, torch.float32),
    "adam-bf16-master": (ADAM, torch.bfloat16, torch.float32),
    "adam-bf16-states": (ADAM, torch.bfloat16, torch.bfloat16),
}


class Ran(tuple):
    """:func:`run`'s checker, the plain optimizer's parameters and the engine, with the sub-groups it speculated."""

    def __new__(cls, values: tuple, speculated: list[int]) -> Ran:
        ran = super().__new__(cls, values)
        ran.speculated = speculated
        return ran


def run(
    scenario: Scenario,
    engine_class: type | None = None,
    backward_sync: bool = True,
    case: str = "adam-fp32",
    overlap: bool = False,
    early: bool = False,
    clipped: bool | None = None,
) -> Ran:
    """Run ``scenario`` on an engine of ``case`` under the checker, next to plain AdamW; return the checker, the
    reference flats (plain AdamW's: only meaningful for the Adam fp32 case) and the engine. ``overlap``: the next
    forward is modelled as under ``overlap="forward"`` (each all-gather after the engine's per-sub-group wait);
    ``early``: each step begins during the modelled backward, as under ``overlap="auto"``; ``clipped`` (with it):
    the updates begun during backward are speculative, and each step turns out clipped (True: redone with half the
    factor) or not (False: committed)."""
    engine_class = engine_class or loop_module.InterleavedUpdate
    rule, master_dtype, state_dtype = CASES[case]
    checker = StreamSanitizer(memory_limit=scenario.memory_limit)
    default_slots = pool_module.LP_STAGING_SLOTS
    pool_module.LP_STAGING_SLOTS = scenario.lp_staging_slots or default_slots
    try:
        engine = engine_class(
            NUMELS,
            GROUPS,
            SUB_GROUP,
            torch.device("cpu"),
            torch.float32,
            # The same sub-groups fit as for Adam in fp32, whatever the rule's bytes per element.
            gpu_memory_budget=scenario.budget and scenario.budget * Footprint.of(*CASES[case]).device // 16,
            streams=checker.streams(),
            lp_device=torch.device("cpu") if scenario.lp_on_host else None,
            rule=rule,
            master_dtype=master_dtype,
            state_dtype=state_dtype,
        )
    finally:
        pool_module.LP_STAGING_SLOTS = default_slots
    if scenario.lp_staging_slots is not None:
        assert engine.pool.lp_staging.slots == scenario.lp_staging_slots
    engine.streams.events_done = scenario.events_done
    speculated: list[int] = []  # every sub-group speculated, for the test to see
    device_update = engine.device_update
    checker.watch(engine, backward_sync=backward_sync, overlap=overlap, early=early, clipped=clipped)
    if clipped is not None:
        engine.reserve_speculation(len(engine.sub_groups))
        begin = engine.spare.begin
        engine.spare.begin = lambda index, *args: speculated.append(index) or begin(index, *args)
    real_inv_grad_scale = scenario.inv_grad_scale * (0.5 if clipped else 1.0)
    gen = torch.Generator().manual_seed(0)
    reference = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in NUMELS]
    for i, flat in enumerate(reference):
        engine.param_view(i).copy_(flat.detach())
    if scenario.files:  # the second half on the simulated drive: its staging slabs race-checked too
        first = len(engine.sub_groups) // 2

        def open_swap(records: list[int], master: torch.dtype, state: torch.dtype, states: int) -> SimSwapFile:
            return SimSwapFile(checker, first, records, master, state, states, slots=scenario.file_slots)

        engine.keep_records_in(first, open_swap)
        engine.take_files_in(scenario.files_order)
    groups = [{"params": [p for p, g in zip(reference, GROUPS) if g == k]} for k in (0, 1)]
    for group, h in zip(groups, HYPERS):
        group.update(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay)
    plain = torch.optim.AdamW(groups, foreach=False)
    grads = [torch.zeros(n, dtype=master_dtype) for n in NUMELS]
    lp = [torch.zeros(n) for n in NUMELS]
    taken = 0
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for action in scenario.steps:
            slabs = (engine.pool.param, *engine.pool.states)
            if action == "flush":  # a checkpoint save: the engine flushes, the checkpoint copies the slabs
                engine.flush_resident()
                saved = ([t.clone() for t in slabs], [p.detach().clone() for p in reference], taken)
                saved_optimizer = copy.deepcopy(plain.state_dict())
            elif action == "drop":  # a checkpoint load: the slabs are overwritten, the engine drops its copies
                for slab, value in zip(slabs, saved[0]):
                    slab.copy_(value)
                for p, value in zip(reference, saved[1]):
                    p.data.copy_(value)
                plain.load_state_dict(saved_optimizer)
                taken = saved[2]
                engine.drop_resident()
            elif action == "skip":
                engine.skip(Plan(mixed(H)))
            else:
                for g in grads:
                    g.copy_(torch.randn(g.shape, generator=gen))
                for p, g in zip(reference, grads):
                    p.grad = g.float() * real_inv_grad_scale
                plain.step()
                taken += 1
                failing = scenario.fail_at is not None and taken == 2
                fired: list[bool] = []
                if failing:
                    _inject(engine, *scenario.fail_at, fired)
                while True:  # once, or again after an interruption before any change (the framework did not count it)
                    inputs = StepInputs(
                        grads, lp, HYPERS, [taken] * len(NUMELS), inv_grad_scale=scenario.inv_grad_scale
                    )
                    inputs.speculative = clipped is not None
                    for flat, g in enumerate(grads):  # backward's copies into resident sub-groups' device slots
                        engine.keep_gradient(flat, 0, g)
                    try:
                        report, state = engine.step(action, inputs), None
                    except UpdateInterrupted as interrupted:  # finished on the host (post-step), or nothing changed
                        assert failing and fired, interrupted
                        report, state = None, interrupted.state
                    finally:
                        engine.watch_points(None)
                        engine.use_device_update(device_update)
                    if state != "pre-step":
                        break
                    assert scenario.fail_at[0] == "device_update", f"{scenario.name}: interrupted before any change"
                    gc.collect()  # the error dropped, what its frames held is freed (the staging, its kernels queued)
                assert fired or not failing, f"{scenario.name}: the failure was never injected"
                if state == "post-step":
                    continue
                expected = scenario.expect_fallback and (scenario.fail_at is None or failing)
                assert bool(report.fallback_host) == expected, scenario.name
        engine.flush_resident()  # the host slabs are current for the comparison (a checkpoint would read them)
    if scenario.lp_on_host:  # every sub-group's 16-bit result landed in the host-resident partition
        for i, target in enumerate(lp):
            expected = engine.param_view(i).float()
            assert torch.equal(target, expected), f"{scenario.name}: flat {i}'s 16-bit parameters"
    return Ran((checker, [p.detach() for p in reference], engine), speculated)


def _inject(engine: object, point: str, sub_group: int, error: BaseException, fired: list[bool]) -> None:
    """Raise ``error`` once in ``engine``'s next step, at ``point`` of ``sub_group`` (see :attr:`Scenario.fail_at`): a
    fresh one, so that no traceback of an earlier run keeps that run's device memory from being freed."""
    error = type(error)(*error.args)
    if point != "device_update":

        def on_point(at: str, index: int) -> None:
            if (at, index) == (point, sub_group) and not fired:
                fired.append(True)
                raise error

        engine.watch_points(on_point)
        return
    update = engine.device_update

    def device_update(*args: object, **kwargs: object) -> None:
        update(*args, **kwargs)  # the kernels are queued on the device, then it reports the error
        if engine.streams.operation == ("device_adam", sub_group) and not fired:
            fired.append(True)
            raise error

    engine.use_device_update(device_update)


#: The overlaps the scenarios run under: (the next forward overlapped, the step begun during backward).
OVERLAPS = {"off": (False, False), "forward": (True, False), "auto": (True, True)}


@pytest.mark.parametrize("mode", ["off", "forward", "auto"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_targeted_plans_are_race_free_and_equal_plain_adamw(scenario: Scenario, mode: str) -> None:
    checker, reference, engine = run(scenario, overlap=OVERLAPS[mode][0], early=OVERLAPS[mode][1])
    checker.check()
    if mode == "auto" and any(H in step.places for step in scenario.steps if isinstance(step, Plan)):
        assert engine.updated_early or scenario.fail_at, "host sub-groups are updated during the modelled backward"
    # The simulated accelerator takes the 16-bit staging path, unless the 16-bit parameters are on the host.
    assert (engine.pool.lp_staging is None) == scenario.lp_on_host
    for i, expected in enumerate(reference):
        torch.testing.assert_close(engine.param_view(i), expected, rtol=1e-5, atol=1e-7)
    lanes = {op.lane for op in checker.log if op.kind == "op"}
    if any(p == H for step in scenario.steps if isinstance(step, Plan) for p in step.places):
        uploads = "lp_upload" in lanes
        assert uploads != scenario.lp_on_host, "host sub-groups upload their 16-bit copy on lp_h2d (unless offloaded)"


@pytest.mark.parametrize("clipped", [False, True], ids=["committed", "redone"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_speculative_updates_committed_or_redone_are_race_free_and_equal_plain_adamw(
    scenario: Scenario, clipped: bool
) -> None:
    """Under overlap="auto" with clipping: host sub-groups are updated during the modelled backward into spare
    slots, then committed (their 16-bit results uploaded through the staging ring) or restored and redone."""
    ran = run(scenario, overlap=True, early=True, clipped=clipped)
    checker, reference, engine = ran
    checker.check()
    if any(H in step.places for step in scenario.steps if isinstance(step, Plan)) and not scenario.fail_at:
        assert ran.speculated, "host sub-groups are speculated during the modelled backward"
        assert bool(engine.updated_early) != clipped, "committed sub-groups count as updated early; redone do not"
    assert engine.spare.pending == {}
    engine.flush_resident()  # committed state held in spare slots comes home, as a checkpoint's reader has it
    for i, expected in enumerate(reference):
        torch.testing.assert_close(engine.param_view(i), expected, rtol=1e-5, atol=1e-7)


#: Scenarios of plans only (no checkpoint, no skip): each has an all-host twin to compare with bit for bit.
PLAN_SCENARIOS = [
    s for s in SCENARIOS if all(isinstance(step, Plan) for step in s.steps) and s.memory_limit is s.budget is None
]


@pytest.mark.parametrize("case", [c for c in CASES if c != "adam-fp32"])
@pytest.mark.parametrize("scenario", PLAN_SCENARIOS, ids=[s.name for s in PLAN_SCENARIOS])
def test_every_rule_and_dtype_is_race_free_and_any_placement_matches_the_host_to_the_bit_but_where_kernels_round(
    scenario: Scenario, case: str
) -> None:
    """The simulated accelerator runs the device's formula (the rule's torch formula) on its device sub-groups and
    the host's compiled kernel on the others. Adagrad: the two agree on every element (as
    tests/test_native_rules.py pins), so any placement gives the all-host bits. Adam too: torch's fused CPU kernel
    rounds its scalar remainder (the last ``numel % 16`` elements of each call) its own way, and the compiled
    kernel reproduces it on the same elements. Lion: the host kernel
    rounds as DeepSpeed's CPU Lion does (fused multiply-adds), the device formula rounds each product as torch's
    kernels (and CUDA's) do: every sub-group that was on the device agrees to float precision, the rest to the bit."""
    checker, _, engine = run(scenario, case=case)
    checker.check()
    all_host = Scenario(
        "all-host twin",
        tuple(Plan(mixed(H)) for _ in scenario.steps),
        inv_grad_scale=scenario.inv_grad_scale,
        lp_on_host=scenario.lp_on_host,
    )
    _, _, twin = run(all_host, case=case)
    rule, master_dtype, state_dtype = CASES[case]
    assert engine.pool.param.dtype == master_dtype and len(engine.pool.states) == len(rule.states)
    assert all(state.dtype == state_dtype for state in engine.pool.states)
    tails = torch.zeros(engine.pool.param.numel(), dtype=torch.bool)
    on_device = {i for step in scenario.steps for i, place in enumerate(step.places) if place != H}
    for sg in (engine.sub_groups[i] for i in on_device):
        end = sg.slab_offset + sg.numel
        if rule is LION:
            tails[sg.slab_offset : end] = True
    for ours, theirs in zip((engine.pool.param, *engine.pool.states), (twin.pool.param, *twin.pool.states)):
        assert torch.equal(ours[~tails], theirs[~tails]), f"{scenario.name}, {case}"
        # Lion's last bits differ anywhere in a device sub-group (a few ulps of values near 1: 1.2e-7 measured).
        atol = 1e-6 if rule is LION else 0.0
        torch.testing.assert_close(ours[tails], theirs[tails], rtol=1e-6, atol=atol, msg=f"{scenario.name}, {case}")


def test_the_lp_h2d_branch_runs_and_its_upload_is_what_the_next_forward_reads() -> None:
    checker, _, _ = run(SCENARIOS[0])
    uploads = [op for op in checker.log if op.lane == "lp_upload"]
    assert len(uploads) == 2 * N_SUB_GROUPS and all(op.stream == 2 for op in uploads)
    # The engine names each operation's sub-group through streams.lane; the log carries it.
    assert sorted({op.sub_group for op in uploads}) == list(range(N_SUB_GROUPS))


def test_timing_on_the_simulated_accelerator_gives_a_span_per_lane() -> None:
    """The monitor's timeline (events on streams) works on simulated streams too, and stays race-free."""
    checker = StreamSanitizer()
    engine = loop_module.InterleavedUpdate(
        NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.bfloat16, streams=checker.streams()
    )
    checker.watch(engine)
    engine.record_timing(True)
    grads, lp = [torch.randn(n) for n in NUMELS], [torch.zeros(n, dtype=torch.bfloat16) for n in NUMELS]
    report = engine.step(Plan(mixed(H, D, R), 2), StepInputs(grads, lp, HYPERS, [1] * len(NUMELS)))
    checker.check()
    assert {s.lane for s in report.spans} == {"host_adam", "upload", "device_adam", "cast", "download", "lp_upload"}
    assert all(s.end_s >= s.start_s >= 0 for s in report.spans)


def test_the_host_update_of_a_large_sub_group_is_seen_although_it_would_run_on_worker_threads() -> None:
    """Dispatch modes are per thread: under the checker the one-pass host update runs its tiles on the
    calling thread (same program order), so none of its work escapes the check or the log."""
    from lightning_dos.engine import host_workers
    from lightning_dos.engine.kernels import HOST_TILE_ELEMENTS

    numel = 2 * HOST_TILE_ELEMENTS * max(2, torch.get_num_threads()) + 5  # more than one tile per thread
    checker = StreamSanitizer()
    engine = loop_module.InterleavedUpdate(
        [numel], [0], numel, torch.device("cpu"), torch.bfloat16, streams=checker.streams()
    )
    checker.watch(engine)
    workers = host_workers.workers
    grads, lp = [torch.randn(numel)], [torch.zeros(numel, dtype=torch.bfloat16)]
    engine.step(Plan((H,)), StepInputs(grads, lp, HYPERS[:1], [1], inv_grad_scale=0.5))
    checker.check()
    assert host_workers.workers is workers, "the worker pool is given back after the check"
    assert sum(op.elements for op in checker.log if op.lane == "host_adam") == numel
    assert sum(op.elements for op in checker.log if op.lane == "host_cast") == numel


def test_a_missing_host_wait_before_a_checkpoint_read_is_a_race() -> None:
    """The prototype's blind spot: host memory. A download not waited for before the checkpoint reads."""
    checker = StreamSanitizer()
    sim = checker.streams()
    slab = torch.zeros(64)
    with sim.on(sim.d2h):  # allocated on the stream that reads it: only the host side is in question
        device_block = sim.empty(64, torch.float32)
    with checker.active():
        with sim.on(sim.d2h):
            slab.copy_(device_block, non_blocking=True)
        event = sim.record(sim.d2h)
        slab.sum()  # the host reads the slab: no host wait yet
    assert checker.races and "d2h" in str(checker.races[0])
    with checker.active():
        sim.host_wait(event)
        slab.sum()
    assert len(checker.races) == 1


def test_aliasing_views_of_one_slab_conflict_by_address_range() -> None:
    checker = StreamSanitizer()
    sim = checker.streams()
    flat = torch.zeros(100)
    checker.name(flat, "16-bit partition", device=True)
    with checker.active():
        with sim.on(sim.lp_h2d):
            flat[40:60].copy_(torch.ones(20), non_blocking=True)  # one sub-group's upload
    checker.model_access(102, "deepspeed.allgather", reads=[flat])  # the whole flat, another data_ptr
    assert len(checker.races) == 1
    checker.model_access(102, "deepspeed.allgather", reads=[flat[:40]])  # a disjoint range: no race
    assert len(checker.races) == 1


def test_freeing_a_block_before_its_last_use_is_ordered_is_a_race() -> None:
    checker = StreamSanitizer()
    sim = checker.streams()
    block = sim.empty(32, torch.float32)  # allocated on the default (compute) stream
    sim.wait(sim.d2h, sim.record(sim.default))  # the download is ordered after the allocation
    with checker.active(), sim.on(sim.d2h):
        torch.zeros(32).copy_(block, non_blocking=True)
    del block  # the allocator may hand it to compute-stream work now; the download is not ordered before it
    assert len(checker.races) == 1 and "freed" in str(checker.races[0])


def test_a_first_access_on_another_stream_not_ordered_after_the_allocation_is_a_race() -> None:
    """As torch's CUDA sanitizer (which a real H100 run of tests/delayed_streams.py showed): the allocator may hand a
    block out while work of its previous owner is still queued on the allocating stream, so the first access on
    another stream must be ordered after the allocation; allocated on the stream that uses it, there is no race."""
    for allocate_on_d2h, races in ((False, 1), (True, 0)):
        checker = StreamSanitizer()
        sim = checker.streams()
        with sim.on(sim.d2h if allocate_on_d2h else sim.default):
            block = sim.empty(32, torch.float32)
        with checker.active(), sim.on(sim.d2h):
            torch.zeros(32).copy_(block, non_blocking=True)
        assert len(checker.races) == races, (allocate_on_d2h, [str(r) for r in checker.races])
        if races:
            assert "allocation on compute" in str(checker.races[0])


def test_a_block_freed_after_record_stream_on_the_stream_still_using_it_is_not_a_race() -> None:
    """The engine frees its staging once the device side is issued, its downloads still queued: recorded on the
    download stream (CUDA's ``record_stream``), the block is reused only after them; not recorded, it is a race."""
    for recorded, races in ((True, 0), (False, 1)):
        checker = StreamSanitizer()
        sim = checker.streams()
        block = sim.empty(32, torch.float32)
        sim.wait(sim.d2h, sim.record(sim.default))  # the download is ordered after the allocation
        with checker.active(), sim.on(sim.d2h):
            torch.zeros(16).copy_(block[:16], non_blocking=True)
        if recorded:
            sim.record_stream(block[:16], sim.d2h)
        del block
        assert len(checker.races) == races, (recorded, [str(r) for r in checker.races])


def test_a_changed_torch_sanitizer_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.cuda import _sanitizer

    class Renamed:  # what a torch release that reworked its private CSAN classes might leave
        pass

    monkeypatch.setattr(_sanitizer, "StreamSynchronizations", Renamed)
    with pytest.raises(SanitizerUnavailableError, match=r"StreamSynchronizations lacks .*tested with torch 2\.13"):
        StreamSanitizer()


# -- the mutation test -------------------------------------------------------------------------------

SYNC_CALLS = {"wait", "host_wait", "device_synchronize", "record_stream"}
#: A query whose True orders the host after the event, as a wait does (``Streams.done``: CUDA's ``Event.query``).
QUERY = "done"


def _on_streams(call: ast.Call) -> bool:
    """``call`` is a method of the engine's streams (``streams.x(...)``, ``self.streams.x(...)``)."""
    owner = getattr(call.func, "value", None)
    return getattr(owner, "id", None) == "streams" or getattr(owner, "attr", None) == "streams"


def _tail_lists(tree: ast.AST) -> set[str]:
    """Names of the lists whose events the engine host-waits in a loop (``for e in tails: host_wait(e)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Name):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and getattr(inner.func, "attr", None) == "host_wait":
                    names.add(node.iter.id)
    return names


def find_mutations(source: str) -> list[tuple[int, str]]:
    """Every synchronisation in the engine's source: ``(line, what)`` for each wait, host wait, device
    synchronisation, query of an event, and each statement that puts an event on the tail list the step ends by
    waiting on."""
    tree = ast.parse(source)
    tails = _tail_lists(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == QUERY and _on_streams(node):
            found.append((node.lineno, f"{QUERY} at line {node.lineno}"))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in SYNC_CALLS:
                found.append((node.lineno, f"{func.attr} at line {node.lineno}"))
            if isinstance(func, ast.Attribute) and func.attr == "append" and getattr(func.value, "id", None) in tails:
                found.append((node.lineno, f"tail event appended at line {node.lineno}"))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in tails for t in targets) and isinstance(node.value, ast.Call):
                found.append((node.lineno, f"tail events gathered at line {node.lineno}"))
    return sorted(found)


class _Remove(ast.NodeTransformer):
    """Remove the synchronisation at one line: a call becomes ``pass``; tail events are dropped; a query of an event
    answers True without asking (the event taken as done, nothing ordering the host after it)."""

    def __init__(self, line: int) -> None:
        self.line = line

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if node.lineno == self.line and getattr(node.func, "attr", None) == QUERY and _on_streams(node):
            return ast.copy_location(ast.Constant(True), node)
        return self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if node.lineno != self.line or not isinstance(call, ast.Call) or getattr(call.func, "attr", None) == QUERY:
            return self.generic_visit(node)
        func = node.value.func  # type: ignore[attr-defined]
        if func.attr == "append":  # evaluate the event, leave it off the tail list
            return ast.copy_location(ast.Expr(node.value.args[0]), node)  # type: ignore[attr-defined]
        return ast.copy_location(ast.Pass(), node)

    def _drop(self, node: ast.Assign | ast.AugAssign) -> ast.AST:
        self.generic_visit(node)  # a query in the value
        if node.lineno == self.line:  # `tails = f()` -> `tails = f() and []`: f runs, its events are dropped
            node.value = ast.BoolOp(ast.And(), [node.value, ast.List([], ast.Load())])
        return node

    visit_Assign = _drop
    visit_AugAssign = _drop


#: The engine's modules whose update synchronises with the device, by name (the parts the engine is made of; the step
#: first). A new module that synchronises goes here or in one of the lists below (the test of every module that
#: synchronises says when one is missing): its waits are then removed one by one like the others'.
STEP_MODULES = ("step", "in_flight", "streamed", "resident", "host_side", "early")
#: The NVMe tier's part of the update: the scenarios with state in files reach its synchronisations; the delayed-stream
#: harness (tests/delayed_streams.py), which keeps no state in files, does not.
FILE_STEP_MODULES = ("file_backed",)
#: Those whose synchronisations run only once an update has failed (finishing it on the host): the scenarios with a
#: failure reach them; the delayed-stream harness (tests/delayed_streams.py), which injects none, does not.
FAILURE_MODULES = ("recovery",)
#: Those that wait for the drive (the NVMe tier's requests), which :func:`drive_wait_mutations` removes.
DRIVE_MODULES = ("file_tier",)
#: The engine's other modules that call a wait, and why none of them is mutated here.
NOT_MUTATED = {
    "streams": "defines the synchronisations (record_stream's CUDA call)",
    "host_workers": "waits for its worker threads to start (a threading.Event), not for the device",
    "swap_files": "the swap file's own waits on its aio handles (tests/test_swap_files.py runs them on a real file)",
}


def _engine_modules(names: tuple[str, ...]) -> tuple[types.ModuleType, ...]:
    return tuple(importlib.import_module(f"lightning_dos.engine.{name}") for name in names)


#: The update's synchronising modules: every mutation of theirs is a race in the scenarios, and the delayed-stream
#: harness reaches each one (tests/test_gpu_check.py, tests/test_gpu.py).
SYNC_MODULES = _engine_modules(STEP_MODULES)
#: Every module whose synchronisations the mutation test removes, the NVMe tier's and the failure paths' included.
MUTATED_MODULES = SYNC_MODULES + _engine_modules(FILE_STEP_MODULES + FAILURE_MODULES)


def _module_named(name: str) -> types.ModuleType:
    """One of :data:`MUTATED_MODULES` by file name (``loop.py``) or module name."""
    (module,) = [m for m in MUTATED_MODULES if Path(m.__file__).name == name or m.__name__ == name]
    return module


@functools.cache
def _engine_imports(name: str) -> frozenset[str]:
    """The engine modules that module ``name`` imports."""
    tree = ast.parse(inspect.getsource(importlib.import_module(name)))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return frozenset(n for n in found if n.startswith("lightning_dos.engine.") and n != name)


def _rebuild_order(mutated: str) -> list[str]:
    """``mutated`` and every engine module that imports it, directly or through others, up to loop.py: each after
    the modules it imports, so that each is built again taking the mutant (a part moved into a module of its own
    stays mutable)."""
    order: list[str] = []
    needs: dict[str, bool] = {}

    def visit(name: str) -> bool:
        if name not in needs:
            needs[name] = False  # an import cycle is met once
            deps = [visit(dep) for dep in sorted(_engine_imports(name))]
            needs[name] = name == mutated or any(deps)
            if needs[name]:
                order.append(name)
        return needs[name]

    assert visit(loop_module.__name__), f"loop.py does not import {mutated}, directly or not"
    return order


def _engine_from(code: ast.Module | str, module: types.ModuleType = loop_module) -> type:
    """The engine class built with ``module``'s source replaced by ``code`` (the engine's own source, changed: an AST
    or the text). For a part of the engine, its mutant stands in for it while the modules importing it, loop.py last,
    are built again."""
    order = _rebuild_order(module.__name__)
    originals = {name: sys.modules[name] for name in order}
    try:
        for name in order:
            original = originals[name]
            mutant = types.ModuleType(f"{name}_mutant")
            # The race checker names frames of lightning_dos files.
            mutant.__file__ = f"mutant/lightning_dos/engine/{Path(original.__file__).name}"
            source = code if name == module.__name__ else inspect.getsource(original)
            sys.modules[mutant.__name__] = mutant  # dataclasses look their module up while the class is built
            try:
                exec(compile(source, mutant.__file__, "exec"), mutant.__dict__)  # noqa: S102 - the engine's own source
            finally:
                del sys.modules[mutant.__name__]
            sys.modules[name] = mutant  # what the modules built after it import
        return sys.modules[loop_module.__name__].InterleavedUpdate
    finally:
        sys.modules.update(originals)


def mutant_engine(line: int, module: types.ModuleType | str = "step.py") -> type:
    """The engine with the synchronisation at ``line`` of ``module`` (a module, or its file name) removed."""
    module = _module_named(module) if isinstance(module, str) else module
    source = inspect.getsource(module)
    return _engine_from(ast.fix_missing_locations(_Remove(line).visit(ast.parse(source))), module)


def all_mutations(modules: tuple[types.ModuleType, ...] = SYNC_MODULES) -> list[tuple[types.ModuleType, int, str]]:
    """Every synchronisation of ``modules`` (the update's, without its failure paths, unless told):
    ``(module, line, what)``, ``what`` naming the file."""
    return [
        (module, line, f"{what} of {Path(module.__file__).name}")
        for module in modules
        for line, what in find_mutations(inspect.getsource(module))
    ]


def _stream_synchronisations(module: types.ModuleType) -> list[int]:
    """Lines of ``module`` that synchronise with the device through the engine's streams (``streams.wait(...)``,
    ``self.streams.host_wait(...)``, ...)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in {*SYNC_CALLS, QUERY} and _on_streams(node)
    ]


def test_every_module_that_synchronises_is_mutated() -> None:
    """A module of the engine that waits (a part of the update moved into a module of its own, say) is listed where
    its waits are removed one by one: one that synchronises through the engine's streams among the update's or its
    failure paths' modules, one that waits for the drive among the file tier's, any other said why not."""
    engine = importlib.import_module("lightning_dos.engine")
    names = sorted(info.name for info in pkgutil.iter_modules(engine.__path__))
    synchronising = (*STEP_MODULES, *FILE_STEP_MODULES, *FAILURE_MODULES)
    listed = (*synchronising, *DRIVE_MODULES, *NOT_MUTATED)
    assert set(listed) <= set(names), "a listed module is gone from lightning_dos/engine: update the lists"
    modules = dict(zip(names, _engine_modules(tuple(names)), strict=True))
    waiting = [name for name, module in modules.items() if find_mutations(inspect.getsource(module))]
    assert set(waiting) <= set(listed), f"modules that wait, listed nowhere: {sorted(set(waiting) - set(listed))}"
    streams = [name for name, module in modules.items() if _stream_synchronisations(module)]
    assert set(streams) <= set(synchronising), f"synchronising with the device: {streams}"
    assert set(synchronising) <= set(streams), "a module listed that does not synchronise"


def races_of(engine_class: type, backward_sync: bool, case: str = "adam-fp32") -> list[str]:
    """The races of every scenario, with the next forward modelled as under ``overlap="off"``, then as under
    ``"forward"`` (where the engine's per-sub-group waits are what orders the all-gathers), then as under ``"auto"``
    (the step also begun during backward, as each sub-group's gradient copy lands), exactly and speculatively."""
    for mode, (overlap, early) in OVERLAPS.items():
        for scenario in SCENARIOS:
            checker, _, _ = run(scenario, engine_class, backward_sync, case, overlap, early)
            if checker.races:
                return [f"{scenario.name} (overlap={mode}): {r}" for r in checker.races]
    # Under "auto" with clipping, steps that are not clipped: the speculative updates are committed (their 16-bit
    # results go up through the staging ring). A clipped step's redo runs the host path above.
    for scenario in SCENARIOS:
        checker, _, _ = run(scenario, engine_class, backward_sync, case, True, True, clipped=False)
        if checker.races:
            return [f"{scenario.name} (overlap=auto, speculation committed): {r}" for r in checker.races]
    return []


def test_the_unmutated_engine_is_clean_under_both_deepspeed_models() -> None:
    assert races_of(loop_module.InterleavedUpdate, backward_sync=True) == []
    assert races_of(loop_module.InterleavedUpdate, backward_sync=False) == []


@pytest.mark.parametrize("case", ["adam-fp32", "adam-bf16-states"])
def test_removing_any_wait_host_wait_or_tail_event_is_reported_as_a_race(case: str) -> None:
    """Every synchronisation in the engine's source is needed: removing any one of them is a race.

    Two cases: fp32, and 16-bit state, whose rounded copies the engine moves beside the masters. The rule does not
    choose the synchronisations (Lion's one state and Adagrad's take the same waits as Adam's two; the unmutated
    engine runs clean under every rule in the tests above).

    Each mutant runs under DeepSpeed's stock behaviour first. The step's host wait for the end-of-backward event
    (recorded on DeepSpeed's reduce stream, :meth:`InterleavedUpdate.backward_ended`) is redundant there (DeepSpeed's
    host waits on that stream at the end of backward), so it is run again under DeepSpeed on an accelerator that
    resolves data dependencies itself, where DeepSpeed skips that wait (``resolves_data_dependency()``): only the
    engine's wait then keeps host Adam, the uploads and the resident sub-groups' kept gradients from being read
    unfinished. It must be the only synchronisation that needs it. The update has no device-wide synchronise left:
    nothing ties it to other work on the device (the next forward, queued meanwhile under overlap). Only an update that
    failed synchronises the device, as it finishes on the host (recovery.py): the scenarios that fail reach those
    synchronisations, and removing any of them is a race too.
    """
    mutations = all_mutations(MUTATED_MODULES)
    kinds = {what.split(" at ")[0] for _, _, what in mutations}
    assert {"wait", "host_wait", "record_stream", "device_synchronize"} <= kinds and len(mutations) >= 20, mutations
    device_wide = {module for module, _, what in mutations if what.startswith("device_synchronize")}
    failure_paths = set(_engine_modules(FAILURE_MODULES))
    assert device_wide <= failure_paths, "a device-wide wait in the update ties it to the training thread's work"
    assert {module for module, _, _ in mutations} == set(MUTATED_MODULES), "a module listed that does not synchronise"
    backward_end = _backward_end_wait()
    missed, needs_unsynced_deepspeed = [], []
    for module, line, what in mutations:
        engine_class = mutant_engine(line, module)
        if races_of(engine_class, backward_sync=True, case=case):
            continue
        unsynced = races_of(engine_class, backward_sync=False, case=case)
        if not unsynced:
            missed.append(what)
        else:
            needs_unsynced_deepspeed.append((what, unsynced[0]))
    assert not missed, f"removing these synchronisations went unnoticed: {missed}"
    assert [what for what, _ in needs_unsynced_deepspeed] == [f"host_wait at line {backward_end} of step.py"]
    assert "gradient buffer" in needs_unsynced_deepspeed[0][1]


#: The file tier's waits for the drive: the swap file's, and the tier's own helper around it.
DRIVE_WAITS = {"wait", "_wait"}
#: Functions whose waits the scenarios do not reach: teardown (the swap file's close waits for every request too).
TEARDOWN = {"close"}


def drive_wait_mutations() -> list[tuple[types.ModuleType, int, str]]:
    """Every call that waits for the drive in the file tier's modules, outside teardown: ``(module, line, what)``."""
    found = []
    for module in _engine_modules(DRIVE_MODULES):
        for function in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(function, ast.FunctionDef) or function.name in TEARDOWN:
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                    func = node.value.func
                    if isinstance(func, ast.Attribute) and func.attr in DRIVE_WAITS:
                        where = f"line {node.lineno} in {function.name}"
                        found.append((module, node.lineno, f"{func.attr} at {where} of {Path(module.__file__).name}"))
    return sorted(found, key=lambda found: (found[0].__name__, found[1]))


def test_removing_any_wait_for_the_drive_is_a_race_on_a_staging_slab() -> None:
    """The file tier's requests run on the simulated drive beside the host until it waits for them: without any one
    of its waits, a host copy or update touches a slab a request is still filling or draining, or a read lands in a
    slab still being written back. Each mutant runs the scenarios with state in files, in every overlap mode."""
    mutations = drive_wait_mutations()
    functions = {what.split(" in ")[-1].split(" of ")[0] for _, _, what in mutations}
    assert functions == {"_wait", "_take", "load", "settle"}, mutations
    files = [s for s in SCENARIOS if s.files]
    missed = []
    for module, line, what in mutations:
        source = ast.fix_missing_locations(_Remove(line).visit(ast.parse(inspect.getsource(module))))
        engine_class = _engine_from(source, module)
        races = [
            race
            for scenario in files
            for overlap, early in OVERLAPS.values()
            for race in run(scenario, engine_class, overlap=overlap, early=early)[0].races
        ]
        if not any("staging slab" in str(race) and "the drive" in str(race) for race in races):
            missed.append(what)
    assert not missed, f"removing these waits for the drive went unnoticed: {missed}"


def test_a_read_landing_in_a_slab_still_being_written_back_is_a_race() -> None:
    checker = StreamSanitizer()
    swap = SimSwapFile(checker, 0, [8, 8], torch.float32, torch.float32, 2, slots=1)
    swap.write(0, 0)
    swap.read(0, 1)  # no wait for the write between the two
    assert any("staging slab 0" in str(race) and "nvme_read" in str(race) for race in checker.races), checker.races
    checker = StreamSanitizer()
    swap = SimSwapFile(checker, 0, [8, 8], torch.float32, torch.float32, 2, slots=1)
    swap.write(0, 0)
    swap.wait(0)
    swap.read(0, 1)
    swap.wait(0)
    with checker.active():
        swap.views(0, 1)[0].add_(1.0)
    assert checker.races == []


def _backward_end_wait() -> int:
    """The line of the step's host wait for the end-of-backward events."""
    source = inspect.getsource(_module_named("step.py")).splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if "for event in ended:" in text]
    assert "host_wait(event)" in source[line], source[line]
    return line + 1


# -- through a real Trainer and DeepSpeed ZeRO-3 -------------------------------------------------------


class Watch(L.Callback):
    def __init__(self, checker: StreamSanitizer) -> None:
        self.checker = checker

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.checker.watch(trainer.strategy.dos_engine)


def fit(strategy: object, callbacks: tuple = (), steps: int = 8) -> TinyLM:
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    trainer(strategy, steps=steps, callbacks=callbacks).fit(model, loader())
    return model


def test_trainer_with_deepspeed_zero3_on_the_simulated_accelerator_is_race_free_and_equals_adamw() -> None:
    reference = full_parameters(fit("auto"))
    checker = StreamSanitizer()
    placement = RandomPlacement(seed=3, places=(H, D, R))
    # The checker models DeepSpeed's backward itself (its reduce stream): the update begins after it ("forward"). The
    # step begun during backward ("auto") is checked against the modelled backward above.
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction=0.5, sub_group_size=700, streams_factory=checker.streams, overlap="forward"
    )
    model = fit(strategy, callbacks=(Watch(checker), placement))
    checker.check()
    engine = strategy.dos_engine
    assert engine.pool.lp_staging is None  # used (the lp_upload lane below), then freed at teardown
    lanes = {op.lane for op in checker.log if op.kind == "op"}
    assert {"upload", "device_adam", "cast", "download", "host_adam", "lp_upload"} <= lanes
    assert any(R in plan.places for plan in placement.plans)
    assert max_relative_error(full_parameters(model), reference) < 1e-5


def test_parameter_offload_on_the_simulated_accelerator_is_race_free_and_lands_16_bit_results_on_the_host() -> None:
    """``offload_parameters=True``: DeepSpeed keeps the 16-bit partitions in host memory, yet device sub-groups
    still update on the (simulated) accelerator and download their 16-bit result; host ones cast straight in."""
    reference = full_parameters(fit("auto"))
    checker = StreamSanitizer()
    placement = RandomPlacement(seed=3, places=(H, D, R))
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction=0.5,
        sub_group_size=700,
        streams_factory=checker.streams,
        offload_parameters=True,
        overlap="forward",
    )
    model = fit(strategy, callbacks=(Watch(checker), placement))
    checker.check()
    engine = strategy.dos_engine
    assert engine.lp_downloads and engine.pool.lp_staging is None
    lanes = {op.lane for op in checker.log if op.kind == "op"}
    assert {"upload", "device_adam", "cast", "download", "host_adam"} <= lanes and "lp_upload" not in lanes
    assert any(D in plan.places for plan in placement.plans)
    assert max_relative_error(full_parameters(model), reference) < 1e-5


def test_a_gradient_kept_on_the_device_is_read_only_after_the_end_of_backward_event() -> None:
    """Resident sub-groups read the gradient backward copied into their device slot (keep_gradient, modelled on
    DeepSpeed's reduce stream): without the step's wait for the end-of-backward event on that stream, on an
    accelerator where DeepSpeed does not wait for its reduce stream either, the device update reads those slots
    unordered with that copy."""
    all_resident = next(s for s in SCENARIOS if s.name == "all-resident")
    checker, _, _ = run(all_resident, mutant_engine(_backward_end_wait()), backward_sync=False)
    assert any("lightning_dos.keep_gradient" in str(race) for race in checker.races), checker.races[:3]
    checker, _, engine = run(all_resident, backward_sync=False)
    assert checker.races == [] and engine.last_report.h2d_bytes == 0, "nothing uploaded once resident"


def _engine_with(old: str, new: str) -> type:
    """The engine with one statement of its source replaced (``old`` must occur once, in one of its modules)."""
    (module,) = [m for m in MUTATED_MODULES if old in inspect.getsource(m)]
    source = inspect.getsource(module)
    assert source.count(old) == 1, old
    return _engine_from(source.replace(old, new), module)


def test_a_streamed_sub_group_lands_with_its_cast_not_its_download() -> None:
    """The next forward waits for a streamed sub-group only until its 16-bit cast on the device (the state's
    download home goes on beside it): that is race-free, and landing any earlier (at its upload) is a race with
    the cast, which the checker reports."""
    streamed = next(s for s in SCENARIOS if s.name == "streamed, 2 buffers")
    landing = "self.landing.land(index, computed if buf.lp is None else slot_free[slot])"
    checker, _, _ = run(streamed, overlap=True)
    assert checker.races == []
    early = _engine_with(landing, "self.landing.land(index, uploaded)")
    checker, _, _ = run(streamed, early, overlap=True)
    assert any("16-bit partition" in race.memory and "in launch" in race.previous.where for race in checker.races), (
        checker.races[:3]
    )


# -- failures under overlap: no forward read is released before its 16-bit partition is final ------------------

#: Step 1 makes sub-groups resident; step 2, where the faults are injected, evicts some, brings others up, streams
#: some through two buffers and updates the rest on the host: every phase of the update.
FAULT_PLANS = (Plan(mixed(R, D, H)), Plan(mixed(H, D, R, D), 2))


class FaultyStreams:
    """Raise ``error`` once, at the simulated accelerator's seam ``at``: ``("alloc", None)`` (a device allocation of
    step 2), ``(lane, sub_group)`` as the engine issues that operation (an upload, a kernel, a cast, a download, the
    host update), or ``("point", name, sub_group)`` at the engine's ``on_point`` test seam. None injects nothing and
    records the seams step 2 passes."""

    def __init__(self, engine: object, at: tuple | None, error: BaseException) -> None:
        self.engine, self.at, self.error = engine, at, error
        self.armed, self.fired, self.seen = False, False, []
        sim = engine.streams
        lane, empty = sim.lane, sim.empty

        def faulty_lane(name: str, sub_group: int, *args: object, **kwargs: object) -> object:
            self._pass((name, sub_group))
            return lane(name, sub_group, *args, **kwargs)

        def faulty_empty(*args: object, **kwargs: object) -> torch.Tensor:
            self._pass(("alloc", None))
            return empty(*args, **kwargs)

        sim.lane = faulty_lane
        engine.pool._allocate = faulty_empty  # the pool allocates device memory through the streams' empty
        engine.watch_points(lambda point, index: self._pass(("point", point, index)))

    def _pass(self, seam: tuple) -> None:
        if not self.armed:
            return
        if seam not in self.seen:
            self.seen.append(seam)
        if seam == self.at and not self.fired:
            self.fired = True
            raise self.error


def overlapped_with_fault(at: tuple | None, engine_class: type | None = None) -> tuple[StreamSanitizer, object, list]:
    """Two steps as the adapter's overlapped update runs them (``engine.start``: the step, then, when it was
    interrupted before any change, the step taken whole on the host, as ``ZeRO3Adapter._apply`` does), the second
    with a fault at ``at``; each next forward modelled once joined, ordered only by the engine's releases."""
    from lightning_dos.engine.atomic import PRE_STEP

    engine_class = engine_class or loop_module.InterleavedUpdate
    checker = StreamSanitizer()
    engine = engine_class(NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.float32, streams=checker.streams())
    checker.watch(engine, threaded=True)
    faults = FaultyStreams(engine, at, RuntimeError("injected"))
    gen = torch.Generator().manual_seed(0)
    for i in range(len(NUMELS)):
        engine.param_view(i).copy_(torch.randn(NUMELS[i], generator=gen))
    lp = [torch.zeros(n) for n in NUMELS]
    interruptions: list = []
    for step, plan in enumerate(FAULT_PLANS, start=1):
        grads = [torch.randn(n, generator=gen) for n in NUMELS]
        inputs = StepInputs(grads, lp, HYPERS, [step] * len(NUMELS), inv_grad_scale=0.5)
        for flat, g in enumerate(grads):
            engine.keep_gradient(flat, 0, g)
        faults.armed = step == 2

        def work(plan: Plan = plan, inputs: StepInputs = inputs) -> None:
            try:
                engine.step(plan, inputs)
            except UpdateInterrupted as failure:
                interruptions.append(failure.state)
                if failure.state == PRE_STEP:  # the framework counted the step: taken whole on the host
                    engine.take_on_host(inputs, failure)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.start(work)
            engine.wait_all()
    faults.armed = False
    assert at is None or faults.fired, f"{at} was never reached"
    engine.flush_resident()
    for i, target in enumerate(lp):  # every 16-bit partition is the post-step cast of the master weights
        assert torch.equal(target, engine.param_view(i)), (at, i)
    return checker, engine, faults.seen if at is None else interruptions


def _seams() -> list[tuple]:
    _, _, seen = overlapped_with_fault(None)
    return seen


FAULT_SEAMS = _seams()


def test_faults_are_injected_at_every_phase_of_the_update() -> None:
    lanes = {seam[0] for seam in FAULT_SEAMS if seam[0] != "point"}
    points = {seam[1] for seam in FAULT_SEAMS if seam[0] == "point"}
    assert {"alloc", "upload", "device_adam", "cast", "download", "host_adam", "lp_upload"} <= lanes, lanes
    assert {"flush", "unscaled", "updated", "computed", "downloading", "done"} <= points, points


@pytest.mark.parametrize("at", FAULT_SEAMS, ids=lambda seam: "-".join(map(str, seam)))
def test_a_failure_at_any_phase_releases_no_forward_read_before_its_16_bit_partition_is_final(at: tuple) -> None:
    """Under overlap, the next forward's all-gathers wait only for the sub-groups they read. A failure anywhere in the
    update leaves every 16-bit partition final (pre-step then taken on the host, or finished on the host) before the
    engine lets a reader of it go on: the race checker reports a write to a partition after its release."""
    checker, engine, interruptions = overlapped_with_fault(at)
    assert interruptions and interruptions[0] in ("pre-step", "post-step")
    assert checker.races == [], checker.races[:3]
    _, clean, _ = overlapped_with_fault(None)
    assert torch.equal(engine.pool.param, clean.pool.param), "the step is taken exactly once"


def test_releasing_the_waiters_when_the_step_returns_is_a_race_with_the_host_taking_it() -> None:
    """The mutation that shows the check bites: a step run by start() releasing every waiter as it returns (before its
    caller takes a step interrupted before any change whole on the host, which rewrites every 16-bit partition)."""
    pre_step = [seam for seam in FAULT_SEAMS if seam in (("alloc", None), ("point", "flush", 0))]
    assert pre_step, FAULT_SEAMS
    early_release = _engine_with("if releases:", "if True:")
    for at in pre_step:
        checker, _, interruptions = overlapped_with_fault(at, early_release)
        assert interruptions == ["pre-step"]
        assert any(
            "16-bit partition" in race.memory and "finish_on_host" in race.previous.where for race in checker.races
        ), (at, checker.races[:3])


def _fp16_steps(speculative: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[object], object]:
    """fp16 loss scaling on the simulated accelerator: 16-bit parameters in fp16, gradients scaled by 1024, five
    all-host steps: not clipped, an overflow (the last gradient of backward is infinite), the loss scale moved (the
    real factor half the guess), then two more not clipped. ``speculative``: each step begins during the modelled
    backward with the updates speculative (``auto``); otherwise it runs after backward with the real factor, the
    overflow skipped whole (``off``). Returns the slabs, the fp16 parameters, the reports and the engine."""
    checker = StreamSanitizer()
    engine = loop_module.InterleavedUpdate(
        NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.float16, streams=checker.streams()
    )
    checker.watch(engine, backward_sync=True, overlap=speculative, early=speculative, clipped=False)
    if speculative:
        engine.reserve_speculation(len(engine.sub_groups))
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate(NUMELS):
        engine.param_view(i).copy_(torch.randn(n, generator=gen))
    grads = [torch.zeros(n) for n in NUMELS]
    lp = [torch.zeros(n, dtype=torch.float16) for n in NUMELS]
    scale, taken, reports = 1024.0, 0, []
    plan = Plan(mixed(H))
    for outcome in ("run", "overflow", "scale moved", "run", "run"):
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=gen) * scale)
        if outcome == "overflow":
            grads[0][0] = float("inf")  # sub-group 0's gradient is the last backward makes final
        real = (0.5 if outcome == "scale moved" else 1.0) / scale
        number = taken + (outcome != "overflow")
        inputs = StepInputs(grads, lp, HYPERS, [number] * len(NUMELS), inv_grad_scale=1.0 / scale)
        if not speculative:
            if outcome == "overflow":
                reports.append(engine.skip(plan))
                continue
            inputs.inv_grad_scale = real
            reports.append(engine.step(plan, inputs))
        else:
            inputs.speculative = True
            arrivals = checker.modelled_backward(engine, inputs, True)
            arrivals.real_inv_grad_scale = real
            arrivals.outcome = arrivals.SKIP if outcome == "overflow" else arrivals.RUN
            reports.append(engine.step(plan, inputs, arrivals))
            assert engine.spare.pending == {}, "no speculative result outlives its step"
        taken = number
    checker.check()
    engine.flush_resident()
    return [t.clone() for t in (engine.pool.param, *engine.pool.states)], lp, reports, engine


def test_fp16_loss_scaling_speculation_is_race_free_and_bit_identical_to_off() -> None:
    """fp16 (which this CPU's DeepSpeed may refuse) on the simulated accelerator: speculated sub-groups are committed
    when the step runs with the loss scale they began with, dropped on an overflow (the step skipped, nothing of it
    kept) and redone when the factor moved; the slabs and fp16 parameters equal the run that updates after
    backward, bit for bit, with no race."""
    slabs, lp, reports, engine = _fp16_steps(speculative=True)
    plain_slabs, plain_lp, plain_reports, _ = _fp16_steps(speculative=False)
    assert [r.skipped for r in reports] == [r.skipped for r in plain_reports] == [False, True, False, False, False]
    assert all(r.speculated > 0 for r in reports), "every step speculated sub-groups during backward"
    assert [r.committed for r in reports] == [True, False, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(slabs, plain_slabs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(lp, plain_lp, strict=True))
    assert all(t.dtype == torch.float16 for t in lp) and engine.spare.held == {}
