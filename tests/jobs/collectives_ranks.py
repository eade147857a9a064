"""Train TinyLM on N CPU processes (gloo) with gpu_fraction="auto" planned as on an accelerator, recording every
collective each rank issues (lightning_dos.sim.collectives).

Run by tests/test_ranks.py as a script (Lightning launches the extra ranks by re-running the command line).
Usage: python tests/jobs/collectives_ranks.py DEVICES OVERLAP OUT
Every rank writes OUT.rank<R>.json: its collectives, the name of DeepSpeed's data-parallel group, how many
collectives came before training began (set-up's), the adapter's overlap and the steps that updated sub-groups
during backward.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_dos.sim.collectives import CollectiveRecorder  # noqa: E402

# Before DeepSpeed starts its communication backend, which binds some collectives when it does.
RECORDER = CollectiveRecorder().install()

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import lightning_dos.integration.setup  # noqa: E402
from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.planning.scheduler import DRIFT_CHECK_EVERY, PlacementScheduler  # noqa: E402
from tests.helpers import TinyLM, lm_data, trainer  # noqa: E402

GLOBAL_BATCH = 16
#: Past the ranks' first drift check.
STEPS = DRIFT_CHECK_EVERY + 2


class PlansAsWithAnAccelerator(PlacementScheduler):
    """The strategy's scheduler, planning "auto" on this CPU engine as it would with an accelerator: together, at
    step 1, when the phases are measured, and at each drift check."""

    has_accelerator = True


lightning_dos.integration.setup.PlacementScheduler = PlansAsWithAnAccelerator


class Record(L.Callback):
    def __init__(self) -> None:
        self.record: dict = {"early": []}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        adapter = trainer.strategy.dos_adapter
        group = adapter.process_group
        self.record.update(
            setup_calls=len(RECORDER.calls),
            overlap=adapter.overlap,
            dp_group=str(group.group_name) if group is not None else None,
        )

    def _record_early(self, trainer: L.Trainer) -> None:
        # From each step's report, issued once its update is over (commits of speculative updates run on the
        # update thread after the step returned).
        engine = trainer.strategy.dos_engine
        for number in range(len(self.record["early"]) + 1, engine.reports_issued + 1):
            self.record["early"].append(len(engine.report_number(number).early))

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self._record_early(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: object) -> None:
        self._record_early(trainer)


def main(devices: int, overlap: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    record = Record()
    # Small buckets: DeepSpeed reduces (and copies gradients to the host) from autograd's hooks as backward goes,
    # not only in its epilogue.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction="auto", sub_group_size=700, overlap=overlap, config={"zero_optimization": zero}
    )
    t = trainer(strategy, steps=STEPS, devices=devices, clip=None, callbacks=[record])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(lm_data(), num_replicas=devices, rank=rank, shuffle=False)
    t.fit(TinyLM(), DataLoader(lm_data(), batch_size=GLOBAL_BATCH // devices, sampler=sampler))
    RECORDER.save(f"{out}.rank{t.global_rank}.json")
    Path(f"{out}.rank{t.global_rank}.meta.json").write_text(json.dumps(record.record))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
