"""Several processes, consolidated checkpoints and interrupted runs: nothing is lost.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU (gloo).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from tests.helpers import TinyLM, clean_env, full_parameters, loader, max_relative_error, trainer

ROOT = Path(__file__).resolve().parents[1]


def _train_ranks(devices: int, out: Path, torchrun: bool = False) -> dict:
    """Run tests/jobs/train_ranks.py on ``devices`` CPU processes, launched by Lightning or by torchrun; the
    gathered parameters, each rank's record of its host threads, and what the job printed."""
    env = clean_env()
    job = [str(ROOT / "tests" / "jobs" / "train_ranks.py"), str(devices), str(out)]
    if torchrun:
        job = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", *job]
    done = subprocess.run([sys.executable, *job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate" not in done.stderr, done.stderr[-3000:]  # a rank torn down by std::terminate (issue 60)
    result = torch.load(out)
    result["ranks"] = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]
    result["planning"] = [json.loads(Path(f"{out}.rank{r}.planning.json").read_text()) for r in range(devices)]
    # Each rank's line (ranks share the console; another process may still interleave with a line).
    result["printed"] = re.findall(r"\[rank \d+\] host threads: [^\n\[]*", done.stdout)
    return result


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train_ranks(1, tmp_path_factory.mktemp("one") / "one.pt")


def _assert_each_rank_has_its_own_cores(ranks: list[dict], printed: list[str]) -> None:
    """host_threads="auto": the usable CPUs split evenly, every thread of a rank on that rank's CPUs only,
    torch's thread count one per CPU (one per physical core with SMT), logged as dos/host_threads."""
    usable = os.sched_getaffinity(0)  # the ranks inherit the test's affinity
    cores = [set(rank["placement_cores"]) for rank in ranks]
    assert all(len(c) == len(usable) // len(ranks) for c in cores), cores
    assert sum(len(c) for c in cores) == len(set().union(*cores)), f"ranks share CPUs: {cores}"
    for rank, own in zip(ranks, cores, strict=True):
        assert set(rank["affinity"]) == own and set(rank["every_thread_cpus"]) <= own, rank
        assert 1 <= rank["threads"] <= len(own) and rank["logged_host_threads"] == rank["threads"], rank
    assert sum(rank["threads"] for rank in ranks) <= len(usable), "oversubscribed"
    assert sorted(line.split("]")[0] for line in printed) == [f"[rank {r}" for r in range(len(ranks))], printed


def _assert_ranks_calibrate_and_plan_together(ranks: list[dict]) -> None:
    """Calibrations overlap in time although rank 1 arrives late (the job delays it by 3 s, more than a
    calibration takes), every rank uses the slowest measured rate of each kind, and plans are the same: those
    the run executed, and those "auto" chooses for rates, partition sizes and budgets that differ per rank
    (alone, the ranks would choose different plans there)."""
    started, ended = [rank["started"] for rank in ranks], [rank["ended"] for rank in ranks]
    assert max(started) < min(ended), f"calibrations do not overlap: {list(zip(started, ended))}"
    slowest = {key: min(rank["measured"][key] for rank in ranks) for key in ranks[0]["measured"]}
    assert all(rank["agreed"] == slowest for rank in ranks), [rank["agreed"] for rank in ranks]
    for key in ("plans", "auto_together", "agreed_inputs", "agreed_plan", "phases_together"):
        assert all(rank[key] == ranks[0][key] for rank in ranks), (key, [rank[key] for rank in ranks])
    assert ranks[0]["auto_alone"] != ranks[1]["auto_alone"], "the test's rates must lead to different plans alone"
    assert ranks[0]["auto_together"][0] in [rank["auto_alone"] for rank in ranks]  # the slower host's plan
    assert ranks[0]["phases_together"]["phases"] == [0.002, 0.003], "the slowest forward and the slowest backward"
    own = [rank["own_inputs"] for rank in ranks]
    assert ranks[0]["agreed_inputs"]["budget"] == min(o["budget"] for o in own)
    assert ranks[0]["agreed_inputs"]["sizes"] == [max(sizes) for sizes in zip(*(o["sizes"] for o in own))]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding 2 ranks to their own cores needs 2 CPUs")
def test_two_processes_train_to_the_same_parameters_as_one(tmp_path: Path, one_rank: dict) -> None:
    """ZeRO-3 over 2 CPU processes launched by Lightning: same global batch, same parameters (within 1e-5);
    each rank's engine holds only its own partition and runs on cores of its own."""
    two = _train_ranks(2, tmp_path / "two.pt")
    assert max_relative_error(two["params"], one_rank["params"]) < 1e-5
    assert one_rank["partition_numel"] == one_rank["total"]
    assert one_rank["total"] / 2 <= two["partition_numel"] < one_rank["total"] / 2 + 64  # half, plus padding
    _assert_each_rank_has_its_own_cores(two["ranks"], two["printed"])
    assert len(one_rank["ranks"][0]["placement_cores"]) == len(os.sched_getaffinity(0)), "one rank: every CPU"
    _assert_ranks_calibrate_and_plan_together(two["planning"])
    assert one_rank["planning"][0]["agreed"] == one_rank["planning"][0]["measured"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding 2 ranks to their own cores needs 2 CPUs")
def test_torchrun_ranks_get_cores_of_their_own_and_train_like_one(tmp_path: Path, one_rank: dict) -> None:
    """torchrun sets OMP_NUM_THREADS=1 and binds nothing; host_threads="auto" splits the cores all the same."""
    two = _train_ranks(2, tmp_path / "torchrun.pt", torchrun=True)
    assert max_relative_error(two["params"], one_rank["params"]) < 1e-5
    _assert_each_rank_has_its_own_cores(two["ranks"], two["printed"])
    _assert_ranks_calibrate_and_plan_together(two["planning"])


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class SnapshotAt(L.Callback):
    """Parameters of the live model right after a given optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            self.params = full_parameters(pl_module)


def test_interrupted_run_leaves_a_loadable_checkpoint_that_consolidates_to_the_live_weights(tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    L.seed_everything(0, verbose=False)
    model, snapshot = TinyLM(), SnapshotAt(5)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    t = trainer(
        DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700),
        steps=20,
        callbacks=[checkpoints, snapshot, StopAt(7)],
        enable_checkpointing=True,
    )
    # Lightning shuts down gracefully on KeyboardInterrupt (callbacks' on_exception), then exits with 1.
    with pytest.raises(SystemExit):
        t.fit(model, loader())
    assert t.interrupted and t.global_step == 7
    saved = next(tmp_path.glob("*step=5*"))

    # DeepSpeed's own consolidation gives the weights the live model had when the checkpoint was written.
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(saved), tag="checkpoint")
    for name, value in snapshot.params.items():
        assert torch.equal(consolidated[name].float(), value), name

    # And the checkpoint resumes: training continues from step 5.
    L.seed_everything(0, verbose=False)
    resumed = TinyLM()
    t2 = trainer(DeepOptimizerStatesStrategy(gpu_fraction=0.0, sub_group_size=700), steps=8)
    t2.fit(resumed, loader(), ckpt_path=str(saved))
    assert t2.global_step == 8 and len(resumed.losses) == 3
    assert all(torch.isfinite(torch.tensor(resumed.losses)))


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_checkpoint_state_is_the_engine_state(tmp_path: Path, fraction: float) -> None:
    """The optimizer state DeepSpeed writes is the engine's pinned slabs, whatever the placement."""
    L.seed_everything(0, verbose=False)
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=700)
    t = trainer(strategy, steps=3)
    t.fit(TinyLM(), loader())
    t.save_checkpoint(tmp_path / "ckpt")
    state = torch.load(
        next((tmp_path / "ckpt" / "checkpoint").glob("*optim_states.pt")), weights_only=False, map_location="cpu"
    )
    optimizer_state = state["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    engine = strategy.dos_engine
    saved_avg = torch.cat([optimizer_state[i]["exp_avg"] for i in sorted(optimizer_state)])
    assert torch.equal(saved_avg, engine.pool.state("exp_avg"))
    assert all(int(s["step"]) == 3 for s in optimizer_state.values())
