"""Train TinyLM with the dos strategy on N CPU processes (gloo) and save the gathered parameters.

Run by tests/test_reliability.py as a script, because Lightning launches the extra ranks by re-running
the command line (or under ``torchrun --nproc-per-node N``, which starts them itself).
Usage: python tests/jobs/train_ranks.py DEVICES OUT.pt
Every rank also writes OUT.rank<R>.json: its host threads and the CPUs its threads may run on, seen
during an optimizer step, and the ``dos/host_threads`` the monitor logged.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import lightning_dos.strategy  # noqa: E402
from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.callbacks.monitor import DOSMonitor  # noqa: E402
from tests.helpers import TinyLM, full_parameters, lm_data, trainer  # noqa: E402

GLOBAL_BATCH = 16


class RecordPartition(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.partition_numel = trainer.strategy.dos_engine.pool.param.numel()


AS_LAUNCHED: dict = {}
_apply_host_threads = lightning_dos.strategy.apply_host_threads


def _recording_apply_host_threads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """The strategy's own function, with the thread count the launcher left noted first."""
    AS_LAUNCHED["threads"] = torch.get_num_threads()
    AS_LAUNCHED["cpus"] = sorted(os.sched_getaffinity(0))
    return _apply_host_threads(*args, **kwargs)


lightning_dos.strategy.apply_host_threads = _recording_apply_host_threads


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


def main(devices: int, out: str) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    t = trainer(
        DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700),
        steps=8,
        devices=devices,
        callbacks=[RecordPartition(), RecordHostThreads(out), DOSMonitor(summary=False)],
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
