"""Train TinyLM with the dos strategy on N CPU processes (gloo) and save the gathered parameters.

Run by tests/test_reliability.py as a script, because Lightning launches the extra ranks by re-running
the command line (or under ``torchrun --nproc-per-node N``, which starts them itself).
Usage: python tests/jobs/train_ranks.py DEVICES OUT.pt
Every rank also writes OUT.rank<R>.json: its host threads and the CPUs its threads may run on, seen
during an optimizer step, and the ``dos/host_threads`` the monitor logged; and OUT.rank<R>.planning.json:
when it calibrated and what it measured and used, the plan of every step, and the plans ``"auto"`` chooses
on its engine for rates that differ per rank, planned together and alone. Rank 1 reaches calibration
RANK1_LATE_S seconds after rank 0, as a rank that loads its data or model more slowly would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import lightning_dos.integration.setup  # noqa: E402
from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.host.ranks import reduce_min_over_ranks  # noqa: E402
from lightning_dos.integration.callbacks.monitor import DOSMonitor  # noqa: E402
from lightning_dos.model.perfmodel import HardwareRates  # noqa: E402
from lightning_dos.model.plan import Plan, parse_gpu_fraction  # noqa: E402
from lightning_dos.model.plan_search import choose_plan  # noqa: E402
from lightning_dos.planning.agree import agreed_plan_inputs  # noqa: E402
from lightning_dos.planning.scheduler import PlacementScheduler  # noqa: E402
from tests.helpers import TinyLM, full_parameters, lm_data, trainer  # noqa: E402

GLOBAL_BATCH = 16
RANK1_LATE_S = 3.0


class LateRank1LM(TinyLM):
    def configure_model(self) -> None:
        # Lightning calls this on every rank just before the strategy sets up model and optimizer (where the
        # ranks calibrate), with no collective in between.
        if self.trainer.global_rank == 1:
            time.sleep(RANK1_LATE_S)


class RecordPartition(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.partition_numel = trainer.strategy.dos_engine.pool.param.numel()


AS_LAUNCHED: dict = {}
_apply_host_threads = lightning_dos.integration.setup.apply_host_threads


def _recording_apply_host_threads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """The strategy's own function, with the thread count the launcher left noted first."""
    AS_LAUNCHED["threads"] = torch.get_num_threads()
    AS_LAUNCHED["cpus"] = sorted(os.sched_getaffinity(0))
    return _apply_host_threads(*args, **kwargs)


lightning_dos.integration.setup.apply_host_threads = _recording_apply_host_threads


class RecordHostThreads(L.Callback):
    """What the engine's host work runs with, read during an optimizer step."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seen: dict = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:  # noqa: ANN001
        every_thread: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                every_thread |= os.sched_getaffinity(int(tid))
            except OSError:
                continue
        self.seen = {
            "threads_at_start": AS_LAUNCHED.get("threads"),
            "cpus_at_start": AS_LAUNCHED.get("cpus"),
            "threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "every_thread_cpus": sorted(every_thread),
            "placement_cores": list(trainer.strategy.dos_host_placement.cores or []),
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitor = next(c for c in trainer.callbacks if isinstance(c, DOSMonitor))
        self.seen["logged_host_threads"] = monitor.history[-1]["dos/host_threads"]
        with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(self.seen, f)


def _plan(plan: Plan) -> list:
    return [[int(p) for p in plan.places], plan.device_buffers]


class PlansAsWithAnAccelerator(PlacementScheduler):
    """The strategy's scheduler, planning "auto" on this CPU engine as it would with an accelerator."""

    has_accelerator = True


class RecordPlanning(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.plans: list = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy, rank = trainer.strategy, trainer.global_rank
        # Read once every update is over (the strategy's own on_train_end waits for the last): an overlapped
        # update issues its report after its batch ended.
        engine = strategy.dos_engine
        self.plans = [_plan(engine.report_number(n).plan) for n in range(1, engine.reports_issued + 1)]
        calibration = strategy.dos_calibration
        record = {
            "started": calibration.started,
            "ended": calibration.ended,
            "measured": calibration.measured.to_dict(),
            "agreed": calibration.agreed.to_dict(),
            "plans": self.plans,
        }
        reduce_min = reduce_min_over_ranks(strategy.root_device)
        if reduce_min is not None:  # with one process there is nothing to agree on
            record.update(_planned_with_the_other_ranks(strategy.dos_engine, rank, reduce_min))
        with open(f"{self.out}.rank{rank}.planning.json", "w") as f:
            json.dump(record, f)


def _planned_with_the_other_ranks(engine, rank: int, reduce_min) -> dict:  # noqa: ANN001
    # Rates of a GPU node whose host is faster on rank 1 than on rank 0: alone, the ranks choose different
    # plans; through the process group the strategy uses, the same one.
    rates = HardwareRates(1e9 * (1 + 2 * rank), 5e9, 4e9, 1.2e10, 1.2e10, 1e10, 1e10)
    auto = parse_gpu_fraction("auto")
    together = PlansAsWithAnAccelerator(auto, engine, calibrate=lambda device: rates, reduce_min=reduce_min)
    alone = PlansAsWithAnAccelerator(auto, engine, calibrate=lambda device: rates)
    # Partitions of slightly different sizes and different device memory free: the inputs are agreed.
    sizes = [size + 64 * rank for size in engine.sizes]
    budget = (1 + rank) * 10**6
    agreed_sizes, agreed_budget, agreed_rates = agreed_plan_inputs(sizes, budget, rates, reduce_min)
    # With the update overlapped, the ranks plan for the slowest rank's forward and backward (rank 1's forward is
    # the slower here, rank 0's backward).
    overlapping = PlansAsWithAnAccelerator(
        auto, engine, calibrate=lambda device: rates, reduce_min=reduce_min, overlap="auto"
    )
    overlapping(1)
    overlapping.observe_phases(0.001 * (1 + rank), 0.003 - 0.001 * rank)
    overlapped_plan = _plan(overlapping(2)[0])
    return {
        "phases_together": {"plan": overlapped_plan, "phases": list(overlapping.phases)},
        # Steps 1 (the first plan), 2 (kept) and 10 (the ranks agree that none has drifted).
        "auto_together": [_plan(together(step)[0]) for step in (1, 2, 10)],
        "auto_alone": _plan(alone(1)[0]),
        "own_inputs": {"sizes": sizes, "budget": budget, "rates": rates.to_dict()},
        "agreed_inputs": {"sizes": agreed_sizes, "budget": agreed_budget, "rates": agreed_rates.to_dict()},
        "agreed_plan": _plan(choose_plan(agreed_sizes, agreed_rates, agreed_budget, engine.lp_bytes)[0]),
    }


def main(devices: int, out: str) -> None:
    L.seed_everything(0, verbose=False)
    model = LateRank1LM()
    t = trainer(
        DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700),
        steps=8,
        devices=devices,
        callbacks=[RecordPartition(), RecordHostThreads(out), RecordPlanning(out), DOSMonitor(summary=False)],
    )
    # The same 16 samples make each global batch whatever the process count: rank r takes every
    # devices-th sample, in order.
    data = lm_data()
    rank = int(__import__("os").environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(data, num_replicas=devices, rank=rank, shuffle=False)
    t.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // devices, sampler=sampler))
    params = full_parameters(model)
    if t.is_global_zero:
        total = sum(p.numel() for p in params.values())
        torch.save({"params": params, "partition_numel": model.partition_numel, "total": total}, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
