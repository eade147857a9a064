"""Train TinyLM with the dos strategy on N CPU ranks for a few steps, gather the weights as a user's script would,
and exit: what is checked is how each rank exits (scripts/rank_exits.py, tests/test_ranks.py).

Usage: python tests/jobs/exit_ranks.py DEVICES PRECISION OVERLAP   (under torchrun, or alone: Lightning's launcher)
The last all-gather (``GatheredParameters``) is the collective a gloo worker may still be finishing when the
interpreter ends; a rank that aborted there printed "terminate called without an active exception".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from tests.helpers import TinyLM, full_parameters, lm_data, trainer  # noqa: E402


def main(devices: int, precision: str, overlap: str) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700, overlap=overlap, host_threads=1)
    t = trainer(strategy, steps=4, devices=devices, precision=precision)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    data = lm_data(n=16 * 4)
    sampler = DistributedSampler(data, num_replicas=devices, rank=rank, shuffle=False)
    t.fit(model, DataLoader(data, batch_size=16 // devices, sampler=sampler))
    full_parameters(model)  # every rank joins the gather; its tensors are dropped at once
    # Under Lightning's launcher this process started the other ranks: their exit statuses are read here, the only
    # place they can be (under torchrun, torchrun reads them and fails the job for any but 0).
    children = getattr(t.strategy.launcher, "procs", [])
    if children:
        statuses = [proc.wait(timeout=120) for proc in children]
        print(f"child rank exit statuses: {statuses}", flush=True)
        if any(statuses):
            sys.exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
