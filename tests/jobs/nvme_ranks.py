"""Train TinyLM with the dos strategy on 2 CPU processes (gloo), the optimizer state on NVMe or in host memory.

Run by tests/test_nvme_training.py as a script (Lightning launches the second rank by re-running the command line).
Usage: python tests/jobs/nvme_ranks.py NVME_PATH|cpu OUT.pt
Every rank writes OUT.rank<R>.json: the swap files in NVME_PATH while it trained, its optimizer state's sizes and its
measurement of the drive;
rank 0 saves the gathered parameters and every rank's master weights and moments to OUT.pt.
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

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from tests.helpers import TinyLM, full_parameters, lm_data, trainer  # noqa: E402

GLOBAL_BATCH = 16


class Record(L.Callback):
    def __init__(self, out: str, nvme: str) -> None:
        self.out, self.nvme = out, nvme

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine, rank = trainer.strategy.dos_engine, trainer.global_rank
        engine.flush_resident()
        state = [t.clone() for t in (engine.pool.param, *engine.pool.states)]
        engine.release_file_copies()
        torch.save(state, f"{self.out}.rank{rank}.state.pt")
        files = sorted(p.name for p in Path(self.nvme).iterdir()) if self.nvme != "cpu" else []
        in_files = len(engine.files.indices) if engine.files is not None else 0
        seen = {"files": files, "in_files": in_files, "sub_groups": len(engine.sub_groups)}
        measured = getattr(trainer.strategy.dos_nvme, "measurement", None)
        if measured is not None:  # when this rank measured the drive, and the rates every rank agreed on
            seen["drive"] = [measured.started, measured.ended, measured.agreed.read_bps, measured.agreed.write_bps]
        with open(f"{self.out}.rank{rank}.json", "w") as f:
            json.dump(seen, f)


def main(nvme: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    settings = {} if nvme == "cpu" else {"offload_optimizer_device": "nvme", "nvme_path": nvme, "host_memory_budget": 0}
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700, **settings)
    t = trainer(strategy, steps=4, devices=2, callbacks=[Record(out, nvme)])
    data = lm_data()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
    model = TinyLM()
    t.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // 2, sampler=sampler))
    params = full_parameters(model)
    if t.is_global_zero:
        torch.save(params, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
