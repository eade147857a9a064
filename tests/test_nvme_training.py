"""The NVMe tier through a real Lightning Trainer and real DeepSpeed ZeRO-3 on a real directory: the same parameters
and optimizer state, bit for bit, as the all-host engine, whatever share of the state is in the swap file; resume
across tiers; the swap file gone after teardown; every bad setting refused before any work."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import disk
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy
from lightning_dos.model.nvme import files_update, staging_slots
from lightning_dos.model.perfmodel import predict
from tests.helpers import (
    FP32_RTOL,
    RandomPlacement,
    TinyLM,
    block_4k_filesystem,
    clean_env,
    full_parameters,
    loader,
    max_relative_error,
    trainer,
)

AIO_MISSING = disk.aio_unavailable()
needs_aio = pytest.mark.skipif(
    AIO_MISSING is not None,
    reason="libaio-dev is not installed (scripts/nvme-tools.sh installs it as root); tests/test_disk.py checks that",
)
SUB_GROUP = 700
STEPS = 6


class StateAtEnd(L.Callback):
    """The engine's master weights and optimizer state when training ends (before teardown removes the swap file),
    whether its swap file existed then, and its staging slabs."""

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.trainer, engine = trainer, trainer.strategy.dos_engine
        engine.flush_resident()
        self.state = [engine.pool.param.clone(), *(s.clone() for s in engine.pool.states)]
        engine.release_file_copies()
        self.files = engine.files
        self.swap_existed = engine.files is not None and engine.files.swap.path.exists()
        self.slabs = len(engine.files.swap.slabs) if engine.files is not None else 0


def _fit(  # noqa: ANN202
    tmp_path: Path | None,
    budget: int | str | None,
    precision: str = "32-true",
    steps: int = STEPS,
    overlap="off",
    placement: bool = True,
    **kw,  # noqa: ANN001, ANN003
):
    """Fit a TinyLM with the NVMe tier under ``tmp_path`` (None: all in host memory); ``placement``: a random plan
    each step (host, streamed, resident), else the ratio scheduler's."""
    L.seed_everything(0, verbose=False)
    model, end = TinyLM(), StateAtEnd()
    nvme = {} if tmp_path is None else {"offload_optimizer_device": "nvme", "nvme_path": str(tmp_path)}
    if budget is not None:
        nvme["host_memory_budget"] = budget
    strategy = DeepOptimizerStatesStrategy(sub_group_size=SUB_GROUP, overlap=overlap, **nvme)
    callbacks = [end, *([RandomPlacement(seed=3)] if placement else []), *kw.pop("callbacks", [])]
    trainer(strategy, steps=steps, precision=precision, callbacks=callbacks, **kw).fit(model, loader())
    return model, end, strategy


@needs_aio
@pytest.mark.parametrize(("precision", "overlap"), [("32-true", "off"), ("bf16-mixed", "auto")])
def test_any_host_budget_gives_the_all_host_engines_bits(tmp_path: Path, precision: str, overlap: str) -> None:
    """fp32 with the update waited for, and the defaults (bf16-mixed, overlap="auto" with clipping: host sub-groups
    speculated on during backward, those in files after it)."""
    reference, want, _ = _fit(None, None, precision, overlap=overlap)
    after_fit = tmp_path / "after-fit-host"
    want.trainer.save_checkpoint(after_fit)
    state_bytes = 12 * sum(getattr(p, "ds_numel", p.numel()) for p in reference.parameters())
    assert state_bytes > 0
    for budget in (0, state_bytes // 2):  # all of the state in the file, half of it
        directory = tmp_path / str(budget)
        directory.mkdir()
        model, got, strategy = _fit(directory, budget, precision, overlap=overlap)
        files = got.files
        assert files is not None and got.swap_existed
        in_files = sum(files.sub_groups[i].numel for i in files.indices)
        assert (in_files == sum(strategy.dos_engine.sizes)) == (budget == 0) and in_files > 0
        assert files.read_bytes > 0 and files.written_bytes > 0
        # Tiny records: more staging slabs than 4 where there are records enough (model.nvme.staging_slots), never
        # more than the pre-flight counted.
        assert got.slabs == staging_slots(12 * SUB_GROUP, len(files.indices))
        assert (got.slabs > 4) == (budget == 0)  # 15 records in files: 7 slabs; 9: the fewest, 4
        assert dict(strategy.dos_host_figure.items)["NVMe staging slabs"] >= files.staging_bytes
        for a, b in zip(got.state, want.state, strict=True):
            assert torch.equal(a, b)
        for name, value in full_parameters(reference).items():
            assert torch.equal(full_parameters(model)[name], value), name
        assert list(directory.iterdir()) == [], "the swap file's name outlived teardown"
        # Saved after fit, as stock NVMe offload allows: the trained state, the all-host run's (saved after fit too).
        got.trainer.save_checkpoint(tmp_path / f"after-fit-{budget}")
        _assert_same_optimizer_state(tmp_path / f"after-fit-{budget}", after_fit)
        assert list(directory.iterdir()) == [] and strategy.dos_engine.files.loaded == {}  # read, then given back
        assert _open_swap_files(directory) == 1  # kept open (its name gone) until the strategy lets go of it
        strategy.dos_engine.close_files()
        assert _open_swap_files(directory) == 0


def _open_swap_files(directory: Path) -> int:
    """This process's descriptors open on a swap file in ``directory``."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # the listing's own descriptor is closed by now
            count += os.readlink(fd).startswith(f"{directory}/lightning-dos-rank")
    return count


def _optimizer_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DeepSpeed checkpoint's optimizer state (master weights, moments, step counts), by path."""
    saved = torch.load(next(checkpoint.glob("*/*optim_states.pt")), map_location="cpu", weights_only=False)
    tensors = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for k, item in enumerate(value):
                walk(item, f"{path}/{k}")
        elif isinstance(value, torch.Tensor):
            tensors[path] = value

    walk(saved["optimizer_state_dict"], "")
    return tensors


def _assert_same_optimizer_state(checkpoint: Path, expected: Path) -> None:
    """Two checkpoints hold the same optimizer state, bit for bit."""
    got, want = _optimizer_tensors(checkpoint), _optimizer_tensors(expected)
    assert want and got.keys() == want.keys()
    for path, value in want.items():
        assert got[path].dtype == value.dtype and torch.equal(got[path], value), path


@needs_aio
def test_a_budget_holding_everything_keeps_no_file(tmp_path: Path) -> None:
    _, end, strategy = _fit(tmp_path, "auto")  # this machine's memory holds a TinyLM's state many times over
    assert end.files is None and list(tmp_path.iterdir()) == []


def _stock_nvme(directory: Path, precision: str) -> dict[str, torch.Tensor]:
    """Stock ZeRO-3 NVMe offload (DeepSpeed's pipelined swapper) of the same model, optimizer and data."""
    offload = {"device": "nvme", "nvme_path": str(directory), "pipeline_read": True, "pipeline_write": True}
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {**offload, "buffer_count": 16},
            "sub_group_size": SUB_GROUP,
        },
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    trainer(DeepSpeedCPUStrategy(config=config), steps=STEPS, precision=precision).fit(model, loader())
    return full_parameters(model)


@needs_aio
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_ours_on_nvme_is_within_stocks_own_deviation_of_stock_nvme_offload(tmp_path: Path, precision: str) -> None:
    """Stock's own deviation: how far stock NVMe offload's parameters are from the all-host engine's, which compute
    torch's fused AdamW (tests/test_equivalence.py). Ours, with all of the state in files, is no further from stock
    than that (it is the all-host engine's bits), and stock is within float tolerance of both. Under the strategy's
    own placement (the ratio scheduler's), whose predictions count the drive measured at start-up."""
    (tmp_path / "stock").mkdir()
    (tmp_path / "ours").mkdir()
    stock = _stock_nvme(tmp_path / "stock", precision)
    reference, _, _ = _fit(None, None, precision, placement=False)
    model, _, strategy = _fit(tmp_path / "ours", 0, precision, placement=False)
    ours, exact = full_parameters(model), full_parameters(reference)
    own_deviation = max_relative_error(stock, exact)
    assert max_relative_error(ours, stock) <= own_deviation
    assert max_relative_error(ours, exact) == 0.0
    assert own_deviation < (FP32_RTOL if precision == "32-true" else 1e-2)
    assert list((tmp_path / "ours").iterdir()) == []
    # The drive was measured at start-up, and the ratio scheduler predicted each update with its reads and writes.
    engine, scheduler = strategy.dos_engine, strategy.dos_scheduler
    assert scheduler.drive is strategy.dos_nvme.drive is not None
    report = engine.last_report
    in_memory = predict(engine.sizes, report.plan, scheduler.rates, engine.lp_bytes, footprint=scheduler.footprint)
    files = engine.files
    kwargs = {"lp_bytes": engine.lp_bytes, "slots": files.slots, "footprint": scheduler.footprint}
    backwards = engine.files_backwards(report.step)
    # Predicted from the estimator's base rates, then corrected (the correction is of the whole update, drive included).
    estimator = scheduler.estimator
    args = (engine.sizes, report.plan, estimator.base, scheduler.drive, files.indices)
    tiered = files_update(*args, order=engine.files_order, backwards=backwards, **kwargs)
    assert report.predicted_s == pytest.approx(estimator.corrected(tiered.time_s)) and tiered.disk_s > 0
    assert report.predicted_s >= in_memory.time_s * (1 - 1e-9)  # never less: the same host work, plus the drive's
    # The order of the file-backed sub-groups is the one the model chose (no phases on CPU: the shorter update).
    choice = scheduler.files_order
    assert engine.files_order == choice.order == ("alternate" if choice.alternate_s <= choice.forward_s else "forward")


def _resume(checkpoint: Path, swap: Path | None) -> tuple[TinyLM, StateAtEnd]:
    L.seed_everything(0, verbose=False)
    model, end = TinyLM(), StateAtEnd()
    nvme = {} if swap is None else {"offload_optimizer_device": "nvme", "nvme_path": str(swap), "host_memory_budget": 0}
    strategy = DeepOptimizerStatesStrategy(sub_group_size=SUB_GROUP, overlap="off", **nvme)
    trainer(strategy, steps=STEPS, callbacks=[end, RandomPlacement(seed=3)]).fit(
        model, loader(), ckpt_path=str(checkpoint)
    )
    return model, end


@needs_aio
def test_resume_across_tiers_is_bit_exact(tmp_path: Path) -> None:
    """Checkpoints saved with the state on NVMe and in host memory resume onto either, to the same bits; so does one
    saved on NVMe after fit."""
    swap = tmp_path / "swap"
    swap.mkdir()
    saved = {}
    for tier in ("nvme", "cpu"):
        saves = ModelCheckpoint(dirpath=tmp_path / tier, every_n_train_steps=3, save_top_k=-1)
        # Saved under the scheduler's plan (all on the host here): the last records each step took stay in their
        # slabs unwritten, so the checkpoint at step 3 reads them from there. Resumed under random placements.
        _, end, strategy = _fit(
            swap if tier == "nvme" else None, 0, steps=3, placement=False, callbacks=[saves], enable_checkpointing=True
        )
        saved[tier] = next((tmp_path / tier).glob("*step=3*"))
        if tier == "nvme":
            assert strategy.dos_engine.files.writes_kept > 0
            # The script's last line, after fit (the swap file's name is gone): the state ModelCheckpoint saved.
            assert list(swap.iterdir()) == []
            end.trainer.save_checkpoint(tmp_path / "after-fit")
            saved["after-fit"] = tmp_path / "after-fit"
            _assert_same_optimizer_state(saved["after-fit"], saved["nvme"])
    want_model, want = _resume(saved["cpu"], None)
    want_params = full_parameters(want_model)
    for source, onto in (("nvme", None), ("nvme", swap), ("cpu", swap), ("after-fit", swap)):
        model, end = _resume(saved[source], onto)
        assert (end.files is not None) == (onto is not None)
        for a, b in zip(end.state, want.state, strict=True):
            assert torch.equal(a, b), (source, onto)
        for name, value in full_parameters(model).items():
            assert torch.equal(value, want_params[name]), (source, onto, name)
    assert list(swap.iterdir()) == []


class Counting(L.Callback):
    steps = 0

    def on_train_batch_end(self, *args: object) -> None:
        Counting.steps += 1


def _refused(tmp_path: Path, match: str, **settings: object) -> None:
    """``settings`` are refused, naming what is wrong, before any step and with nothing left under ``tmp_path``."""
    Counting.steps = 0
    with pytest.raises(DOSConfigError, match=match):
        strategy = DeepOptimizerStatesStrategy(sub_group_size=SUB_GROUP, **settings)
        trainer(strategy, steps=2, callbacks=[Counting()]).fit(TinyLM(), loader())
    assert Counting.steps == 0
    assert not any(tmp_path.rglob("*.swap"))


def test_bad_nvme_settings_are_refused_before_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvme = {"offload_optimizer_device": "nvme"}
    for path, why in ((tmp_path / "missing", "does not exist"), (None, "does not exist")):  # None: Lightning's default
        given = {} if path is None else {"nvme_path": str(path)}
        with pytest.raises(DOSConfigError, match=rf"nvme_path='.*' {why}"):  # at construction, before any setup
            DeepOptimizerStatesStrategy(**nvme, **given)
    _refused(tmp_path, r"nvme_path='.*missing' does not exist", nvme_path=str(tmp_path / "missing"), **nvme)
    (tmp_path / "a-file").write_text("")
    _refused(tmp_path, "is not a directory", nvme_path=str(tmp_path / "a-file"), **nvme)
    _refused(tmp_path, "host_memory_budget=-1 is not valid", nvme_path=str(tmp_path), host_memory_budget=-1, **nvme)
    _refused(tmp_path, "offload_optimizer_device='disk' is not valid", offload_optimizer_device="disk")
    section = {"device": "nvme"}
    _refused(tmp_path, "needs nvme_path", config={"zero_optimization": {"stage": 3, "offload_optimizer": section}})
    config = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "aio": {"block_size": 1000},
    }
    _refused(tmp_path, "aio.block_size=1000 is not valid; use a multiple of 4096", config=config)
    config = {  # a fresh one: the strategy takes the NVMe section out of the config it is given
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "aio": {"intra_op_parallelism": 0},
    }
    _refused(tmp_path, "aio.intra_op_parallelism=0 is not valid; use a positive integer", config=config)
    # libaio missing: the real answer where it is; where it is installed (CI), DeepSpeed's check is made to answer
    # as it does without it (tests/test_disk.py does the same).
    if AIO_MISSING is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    _refused(tmp_path, "apt-get install libaio-dev", nvme_path=str(tmp_path), host_memory_budget=0, **nvme)


@needs_aio
def test_two_ranks_keep_one_swap_file_each_and_train_as_in_host_memory(tmp_path: Path) -> None:
    """Two processes on one directory: each rank's state in its own file while training, none left after, and the
    same parameters and optimizer state, bit for bit, as two ranks with the state in host memory; the drive measured
    by both at once, the same rates agreed."""
    job = Path(__file__).parent / "jobs" / "nvme_ranks.py"
    swap = tmp_path / "swap"
    swap.mkdir()
    for nvme, out in ((str(swap), tmp_path / "nvme.pt"), ("cpu", tmp_path / "cpu.pt")):
        done = subprocess.run(
            [sys.executable, str(job), nvme, str(out)], env=clean_env(), capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
    drives = []
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"nvme.pt.rank{rank}.json").read_text())
        drives.append(seen["drive"])
        assert seen["files"] == ["lightning-dos-rank0.swap", "lightning-dos-rank1.swap"]
        assert seen["in_files"] == seen["sub_groups"] > 0
        got = torch.load(tmp_path / f"nvme.pt.rank{rank}.state.pt")
        want = torch.load(tmp_path / f"cpu.pt.rank{rank}.state.pt")
        # DeepSpeed pads rank 1's partition where a parameter does not divide by two: those master weights are never
        # initialised (any value, run to run: -6.6e12 in one, 0 in another) and get no gradient, so their moments
        # stay 0. Every other element is compared bit for bit.
        padding = (want[1] == 0) & (want[2] == 0)
        assert int(padding.sum()) < want[0].numel() // 20
        assert torch.equal(got[0][~padding], want[0][~padding]), rank
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), rank
    got, want = torch.load(tmp_path / "nvme.pt"), torch.load(tmp_path / "cpu.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert list(swap.iterdir()) == []
    # The two ranks measured their shared drive at once (each its share, as in the update) and agreed on the rates.
    (start0, end0, *rates0), (start1, end1, *rates1) = drives
    assert max(start0, start1) < min(end0, end1), "the ranks measured the drive one after the other"
    assert rates0 == rates1 and min(rates0) > 0


@needs_aio
def test_the_trace_has_the_drives_requests_in_lanes_of_their_own(tmp_path: Path) -> None:
    """Under the defaults (bf16-mixed, overlap="auto"), all of the state in files: the traced step's timeline has each
    staging slab's reads and writes (issue to the host's wait) in lanes of their own, none overlapping within one, and
    the trace writer has nothing to clip."""
    from lightning_dos import DOSMonitor
    from lightning_dos.integration.trace import lane_overlaps

    (tmp_path / "swap").mkdir()
    monitor = DOSMonitor(trace_dir=tmp_path / "trace", trace_steps=(3,), summary=False)
    _fit(tmp_path / "swap", 0, "bf16-mixed", overlap="auto", placement=False, callbacks=[monitor])
    trace = json.loads(monitor.trace_path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {names[e["tid"]] for e in spans}
    assert {lane for lane in lanes if lane.startswith("nvme read, slab ")}, lanes
    assert {lane for lane in lanes if lane.startswith("nvme write, slab ")}, lanes
    assert lane_overlaps(trace) == [] and trace["otherData"]["clipped_spans"] == 0
    drive = [e for e in spans if names[e["tid"]].startswith("nvme ")]
    assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in drive), drive[:3]


def test_auto_keeps_what_fits_with_start_ups_masters_of_the_rest_counted() -> None:
    """``host_memory_budget="auto"``: the state kept in host memory, the other buffers, and DeepSpeed's master
    partitions of the part bound for the file (a third of Adam's fp32 state, held at start-up) fit 90% of what each
    rank has; a budget asked for is taken as it is."""
    from lightning_dos.host.hostmem import HostMemory
    from lightning_dos.integration.nvme_tier import AUTO_SHARE, NvmeTier, resolve_host_budget

    state, other, share = 1200, 100, 1 / 3
    for headroom in (500, 800, 1000, 1400):
        memory = HostMemory(headroom=2 * headroom, limit=2 * headroom, in_use=0, source="test")
        kept = resolve_host_budget(NvmeTier("/x", "auto"), state, other, memory, 2, share)
        at_start_up = other + kept + share * (state - kept)
        assert 0 <= kept <= state
        if 0 < kept < state:
            spare = headroom - other - share * state
            assert at_start_up == pytest.approx(other + share * state + AUTO_SHARE * spare, abs=1)
        assert at_start_up <= headroom or kept == 0  # none kept: the pre-flight refuses what start-up cannot hold
    memory = HostMemory(headroom=10**6, limit=10**6, in_use=0, source="test")
    assert resolve_host_budget(NvmeTier("/x", "auto"), state, other, memory, 1, share) == state
    assert resolve_host_budget(NvmeTier("/x", 300), state, other, memory, 1, share) == 300


@needs_aio
def test_the_console_of_a_run_on_nvme_under_the_defaults(tmp_path: Path) -> None:
    """bf16-mixed, overlap="auto", gradient clipping, all of the state on NVMe, in a process of its own (DeepSpeed's
    notice about SSD wear is logged once per process): the tier's line with the drive measured at start-up, that
    notice once in our words at 80 columns (true for a run that writes its state to the drive every step), and no
    warning."""
    script = f"""
import lightning as L
from lightning_dos import DeepOptimizerStatesStrategy
from tests.helpers import TinyLM, loader, trainer
L.seed_everything(0, verbose=False)
nvme = dict(offload_optimizer_device="nvme", nvme_path={str(tmp_path)!r}, host_memory_budget=0)
strategy = DeepOptimizerStatesStrategy(**nvme)
trainer(strategy, steps=4, precision="bf16-mixed", clip=1.0).fit(TinyLM(), loader())
"""
    env = {**clean_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    lines = console.splitlines()
    tier = [k for k, line in enumerate(lines) if "the NVMe tier keeps" in line]
    assert len(tier) == 1 and "GB/s read" in " ".join(lines[tier[0] : tier[0] + 4]), console
    # DeepSpeed's 365-character notice about SSD wear, said once in our words in 80 columns.
    assert "Offloading to NVMe can generate heavy write traffic" not in console, console
    assert console.count("datacenter SSD") == 1, console
    ours = lines[tier[0] : tier[0] + 4] + [line for line in lines if "SSD" in line or "drive: that" in line]
    assert all(len(line) <= 80 for line in ours if str(tmp_path) not in line), ours
    others = [line for line in lines if "warning" in line.lower()]
    assert others == [], console
    assert list(tmp_path.iterdir()) == []


@needs_aio
def test_auto_reserves_spare_slots_only_for_the_sub_groups_not_on_nvme(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the defaults (bf16-mixed, overlap="auto", clipping): sub-groups in files are read only after backward,
    never speculated on. All of the state on NVMe: no spare slot, "auto" runs as "forward" and says why, and the
    host figure is forward's; half of it: a slot for each sub-group in host memory, and the line counts those."""
    state_bytes = 12 * sum(p.numel() for p in TinyLM().parameters())
    runs = {}
    for name, budget, overlap in (("forward", 0, "forward"), ("all", 0, "auto"), ("half", state_bytes // 2, "auto")):
        (tmp_path / name).mkdir()
        caplog.clear()
        with caplog.at_level("INFO"):
            _, end, strategy = _fit(tmp_path / name, budget, "bf16-mixed", steps=2, overlap=overlap, placement=False)
        said = [r.getMessage() for r in caplog.records if "overlap='auto'" in r.getMessage()]
        runs[name] = strategy, end.files, said
    in_files, _, said = runs["all"]
    assert in_files.dos_adapter.overlap == "forward" and in_files.dos_engine.spare.slots == 0
    assert len(said) == 1 and "runs as 'forward'" in said[0] and "every sub-group's state is on NVMe" in said[0]
    assert in_files.dos_host_figure.total <= runs["forward"][0].dos_host_figure.total
    strategy, files, said = runs["half"]
    on_host = len(strategy.dos_engine.sub_groups) - len(files.indices)
    assert 0 < on_host < len(strategy.dos_engine.sub_groups)
    assert strategy.dos_adapter.speculative and strategy.dos_engine.spare.slots == on_host
    assert len(said) == 1 and f"({on_host} of the {on_host} sub-groups not on NVMe," in said[0], said


@needs_aio
def test_two_io_threads_on_a_4096_byte_block_drive_give_the_all_host_engines_bits(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Records of an odd number of pages (700 fp32 elements: 3) split over 2 I/O threads, on a drive with 4096-byte
    logical blocks (a loop device): each thread's share is padded to whole blocks, so O_DIRECT takes every request
    (before, half of each was refused without a word and training went on from stale state, 9.4e-2 away)."""
    with block_4k_filesystem(tmp_path_factory.mktemp("drive")) as directory:
        if directory is None:
            pytest.skip("no 4096-byte-block drive: making one needs root, losetup, mkfs.ext4 and a loop device")
        reference, want, _ = _fit(None, None)
        L.seed_everything(0, verbose=False)
        model, got = TinyLM(), StateAtEnd()
        config = {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(directory)}},
            "aio": {"intra_op_parallelism": 2},
        }
        strategy = DeepOptimizerStatesStrategy(
            sub_group_size=SUB_GROUP, overlap="off", host_memory_budget=0, config=config
        )
        trainer(strategy, steps=STEPS, callbacks=[got, RandomPlacement(seed=3)]).fit(model, loader())
        assert got.files is not None and got.files.swap.threads == 2 and got.files.read_bytes > 0
        for a, b in zip(got.state, want.state, strict=True):
            assert torch.equal(a, b)
        for name, value in full_parameters(reference).items():
            assert torch.equal(full_parameters(model)[name], value), name
