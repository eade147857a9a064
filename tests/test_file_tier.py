"""The engine's NVMe tier (lightning_dos/engine/file_tier.py) on a real directory, through DeepSpeed's async I/O op:
every placement, with any part of the state in the swap file, computes bit for bit what the all-host engine does;
the file-backed spans hold no memory between updates; an interrupted update is still pre- or post-step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dos.engine.atomic import PRE_STEP, UpdateInterrupted
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.host import disk
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAM, LION
from lightning_dos.sim.sanitizer import StreamSanitizer

AIO_MISSING = disk.aio_unavailable()
pytestmark = pytest.mark.skipif(
    AIO_MISSING is not None,
    reason="libaio-dev is not installed (scripts/nvme-tools.sh installs it as root); tests/test_disk.py checks that",
)
# Sub-groups of a few pages each, so that whole pages of their spans are given back.
NUMELS, GROUPS = [9000, 5000, 12000], [0, 1, 1]
SUB_GROUP = 3000
HYPERS = [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True), Hyper(3e-3, 0.8, 0.95, 1e-6, 0.0, False)]
H, D, R = Place.HOST, Place.DEVICE, Place.RESIDENT


@pytest.fixture(scope="module")
def aio():  # noqa: ANN201
    return disk.load_aio()


def _engine(first: int | None, directory: Path, aio, *, sim: bool, rule=ADAM, slots: int = 2):  # noqa: ANN001, ANN202
    checker = StreamSanitizer() if sim else None
    engine = InterleavedUpdate(
        NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.float32, pin=False, rule=rule,
        streams=checker.streams() if checker else None,
    )  # fmt: skip
    engine.pool.param.copy_(torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(0)))
    if checker is not None:
        checker.watch(engine)
    if first is not None:
        engine.keep_in_files(first, str(directory), 0, aio, slots=slots)
    return engine, checker


class Inputs:
    """Each step's gradients, in the same buffers every step (as DeepSpeed's: the race checker knows them by
    address)."""

    def __init__(self) -> None:
        self.grads = [torch.zeros(n) for n in NUMELS]
        self.lp = [torch.zeros(n) for n in NUMELS]

    def __call__(self, step: int) -> StepInputs:
        g = torch.Generator().manual_seed(step)
        for grad in self.grads:
            grad.copy_(torch.randn(grad.numel(), generator=g))
        return StepInputs(self.grads, self.lp, HYPERS, [step] * 3, inv_grad_scale=0.5)


def _state(engine: InterleavedUpdate) -> list[torch.Tensor]:
    engine.flush_resident()  # file-backed state read into the slabs, as for a checkpoint
    state = [engine.pool.param.clone(), *(s.clone() for s in engine.pool.states)]
    engine.release_file_copies()
    return state


def _plans(n: int, steps: int, seed: int) -> list[Plan]:
    gen = torch.Generator().manual_seed(seed)
    return [Plan(tuple((H, D, R)[int(k)] for k in torch.randint(0, 3, (n,), generator=gen)), 2) for _ in range(steps)]


@pytest.mark.parametrize("sim", [False, True], ids=["cpu-device", "simulated-accelerator"])
@pytest.mark.parametrize("rule", [ADAM, LION], ids=["adam", "lion"])
def test_any_share_in_files_and_any_placement_gives_the_all_host_engines_bits(tmp_path: Path, aio, sim, rule) -> None:  # noqa: ANN001
    reference, _ = _engine(None, tmp_path, aio, sim=sim, rule=rule)
    n = len(reference.sub_groups)
    plans = _plans(n, 4, seed=1)
    inputs = Inputs()
    for plan in plans:
        reference.step(plan, inputs(reference.steps_taken + 1))
    want = _state(reference)
    for first in (0, n // 2, n):  # every sub-group in the file, half of them, none
        (tmp_path / str(first)).mkdir()
        engine, checker = _engine(first, tmp_path / str(first), aio, sim=sim, rule=rule)
        files, inputs = engine.files, Inputs()
        in_files = sum(engine.sizes[first:]) * 4 * (1 + len(rule.states))  # master weights and states, fp32
        assert engine.pool.host_bytes == reference.pool.host_bytes - in_files  # the spans in files are not held
        for plan in plans:
            engine.step(plan, inputs(engine.steps_taken + 1))
            if files is not None:
                assert files.loaded == {}  # between updates each file-backed sub-group is in its file or a slab
                tail = engine.pool.param[engine.sub_groups[first].slab_offset + 1024 : -1024]
                assert not tail.any(), "a file-backed span still holds its state between updates"
        got = _state(engine)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        if checker is not None:
            checker.check()
        if files is not None:
            assert files.read_bytes > 0 and files.written_bytes > 0
            engine.close_files()
            assert list((tmp_path / str(first)).iterdir()) == []


def test_a_slab_still_holding_a_record_saves_its_read(tmp_path: Path, aio) -> None:  # noqa: ANN001
    """Three file-backed sub-groups through three slabs: each step's reads find every record still in a slab."""
    engine, _ = _engine(6, tmp_path, aio, sim=False, slots=3)
    assert len(engine.files.indices) == 3
    engine.step(Plan((H,) * 9), Inputs()(1))
    assert engine.files.read_bytes == 0 and engine.files.reads_skipped == 3
    engine.close_files()


def _run_interrupted(tmp_path: Path, aio, point: tuple[str, int, int] | None):  # noqa: ANN001, ANN202
    engine, _ = _engine(3, tmp_path, aio, sim=True)
    fired: list[str] = []

    def on_point(name: str, index: int) -> None:
        if point is not None and not fired and (name, index, engine.steps_taken) == point:
            fired.append(name)
            raise RuntimeError("injected")

    engine.watch_points(on_point)
    states, outcome, _inputs = [], None, Inputs()
    for step, plan in enumerate([Plan((D, H, D, H, D, H, D, H, H), 2), Plan((H, D, H, D, H, D, H, D, D), 2)], 1):
        states.append(_state(engine))
        try:
            engine.step(plan, _inputs(step))
        except UpdateInterrupted as interrupted:
            outcome = interrupted
            states.append(_state(engine))
            if interrupted.state == PRE_STEP:
                engine.step(plan, _inputs(step))
        assert engine.files.loaded == {}
    states.append(_state(engine))
    engine.close_files()
    return states, outcome


@pytest.mark.parametrize(
    "point", [("unscaled", 3, 1), ("downloading", 4, 1), ("done", 6, 2), ("computed", 7, 2), ("updated", 5, 1)]
)
def test_an_interrupted_update_with_state_in_files_is_pre_or_post_step(tmp_path: Path, aio, point) -> None:  # noqa: ANN001
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    reference, _ = _run_interrupted(tmp_path / "ref", aio, None)
    states, outcome = _run_interrupted(tmp_path / "run", aio, point)
    assert isinstance(outcome, UpdateInterrupted)
    step = point[2]
    expected = reference[step - 1] if outcome.state == PRE_STEP else reference[step]
    for got, want in zip(states[step], expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(states[-1], reference[-1], strict=True):
        assert torch.equal(got, want)


def test_every_other_step_goes_backwards_so_the_slabs_still_hold_its_first_records(tmp_path: Path, aio) -> None:  # noqa: ANN001
    """Six file-backed sub-groups, two staging slabs: a step ends with its last two records in the slabs, and the
    next one (taken the other way) begins with them, reading two records fewer from the drive. The first step takes
    them forwards after start-up wrote them forwards: a read ahead never evicts a record the update still needs, so
    the last one start-up wrote is still in its slab when the step reaches it."""
    engine, _ = _engine(3, tmp_path, aio, sim=False, slots=2)
    inputs, skipped = Inputs(), []
    for step in range(1, 4):
        before = engine.files.reads_skipped
        engine.step(Plan((H,) * 9), inputs(step))
        skipped.append(engine.files.reads_skipped - before)
    assert skipped == [1, 2, 2]
    engine.close_files()


def test_the_host_updates_what_it_holds_before_it_waits_for_a_write_back(tmp_path: Path, aio) -> None:  # noqa: ANN001
    """Four file-backed sub-groups after five in host slabs, two staging slabs. The second step (backwards) begins
    with the two records the first one left in the slabs, then updates the five host-slab sub-groups while the drive
    writes those two back: the host waits for no write-back before all seven are updated (it used to wait for the
    older one at once, to read the next record ahead, and then update the host-slab ones with the drive idle)."""
    engine, _ = _engine(5, tmp_path, aio, sim=False, slots=2)
    inputs, events = Inputs(), []
    engine.step(Plan((H,) * 9), inputs(1))
    assert engine.files.held == {7, 8}
    engine.watch_points(lambda point, index: events.append(("updated", index)) if point == "updated" else None)
    engine.files.on_request = lambda lane, index, *times: events.append((lane.split(",")[0], index))
    engine.step(Plan((H,) * 9), inputs(2))
    first_wait = next(k for k, (what, _) in enumerate(events) if what == "nvme write")
    assert events[:first_wait] == [("updated", i) for i in (8, 7, 0, 1, 2, 3, 4)]
    assert sorted(i for what, i in events if what == "updated") == list(range(9))
    engine.close_files()


def test_the_last_records_stay_unwritten_in_their_slabs_for_the_next_step(
    tmp_path: Path,
    aio,  # noqa: ANN001
) -> None:
    """Six file-backed sub-groups, three staging slabs. A step in the alternating order keeps the write-backs of the
    last two records it takes (one fewer than the slabs) in their slabs, newer than the file; the next step takes them
    first and writes them back once. A step in the forward order keeps none and writes every record. The state stays
    the all-host engine's, bit for bit, and a reader between steps (a checkpoint) copies the kept ones from their
    slabs. (A slab keeping a record is written back before it is reused for another: the random placements above
    reach that path, and fail without the write.)"""
    (tmp_path / "ref").mkdir()
    reference, _ = _engine(None, tmp_path / "ref", aio, sim=False)
    engine, _ = _engine(3, tmp_path, aio, sim=False, slots=3)
    files, record = engine.files, engine.files.swap.record_bytes(SUB_GROUP)
    inputs, ref_inputs = Inputs(), Inputs()
    written = []
    for step, order in enumerate(("alternate", "alternate", "forward", "alternate"), 1):
        engine.take_files_in(order)
        before = files.written_bytes
        engine.step(Plan((H,) * 9), inputs(step))
        reference.step(Plan((H,) * 9), ref_inputs(step))
        written.append((files.written_bytes - before) // record)
        if step == 1:  # taken forwards: 7 and 8 stay in their slabs unwritten
            assert files.unwritten == {7, 8} and files.writes_kept == 2
        if step == 2:  # taken backwards, 8 and 7 first (written once now), 4 and 3 kept
            assert files.unwritten == {4, 3}
        for got, want in zip(_state(engine), _state(reference), strict=True):
            assert torch.equal(got, want)
        assert files.unwritten or order == "forward"
    # Four records written in each alternating step; the forward one writes all six (its kept ones from the step
    # before among them, once each, when their slabs were needed) and keeps none.
    assert written == [4, 4, 6, 4]
    engine.close_files()


@pytest.mark.parametrize(("slots", "queried"), [(2, True), (4, True), (4, False)], ids=["2", "4", "4-waited"])
def test_streamed_file_backed_sub_groups_move_through_their_staging_slabs_never_their_spans(
    tmp_path: Path, aio, slots: int, queried: bool
) -> None:  # noqa: ANN001
    """All of the state in the file (budget 0) and most of it streamed to the simulated accelerator: each streamed
    sub-group is read into a staging slab, uploaded from it, downloaded into it and written back from it, so no
    file-backed state is ever in host memory beyond the slabs (the pre-flight's figure); the race checker finds no
    write-back issued before its download landed, whether found landed by a query or waited for; the bits are the
    all-host engine's."""
    plans = [Plan(tuple(D if k % 4 else H for k in range(9)), 2), Plan(tuple(H if k % 3 else D for k in range(9)), 2)]
    reference, _ = _engine(None, tmp_path, aio, sim=True)
    inputs = Inputs()
    for plan in plans * 2:
        reference.step(plan, inputs(reference.steps_taken + 1))
    engine, checker = _engine(0, tmp_path, aio, sim=True, slots=slots)
    engine.streams.events_done = queried  # False: every download is waited for (a slab needed, or the step's end)
    files, inputs = engine.files, Inputs()
    assert len(files.indices) == len(engine.sub_groups) == 9
    registered = engine.register_file_staging(engine.streams.host_registrar())
    assert registered == (engine.streams.host_registrar() is not None)
    for plan in plans * 2:
        files.reset_span_peak()
        report = engine.step(plan, inputs(engine.steps_taken + 1))
        assert report.device_elements > 0
        assert files.peak_span_bytes == 0, "a streamed file-backed sub-group was paged back into its span"
    for a, b in zip(_state(engine), _state(reference), strict=True):
        assert torch.equal(a, b)
    checker.check()
    engine.close_files()
