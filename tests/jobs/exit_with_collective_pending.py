"""Set up the dos strategy's process group on two ranks as a Trainer does, leave a gloo collective in flight on
rank 1 that completes only when the late rank 0 joins it, and exit: what is checked is how rank 1 exits.

Run by tests/test_ranks.py under torchrun (two ranks). Rank 1 keeps the collective's handle but drops its tensors,
as ZeRO-3's prefetching all-gathers are left when training ends; gloo's worker then frees them when the collective
completes. The check registered first runs last at exit (atexit runs handlers in reverse): it reports whether, by
then, the process group was destroyed and gloo's workers were idle. Without that, the worker may free the tensors
after the interpreter is gone and the rank aborts ("terminate called without an active exception", SIGABRT;
pytorch/pytorch#190489; lightning_dos/host/rank_exit.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.host.rank_exit import busy_gloo_workers  # noqa: E402

#: How long rank 0 takes to reach the collective rank 1 left in flight (seconds).
LATE_S = 1.5


def _report() -> None:
    busy, _ = busy_gloo_workers()
    # Straight to the file descriptor: sys.stdout may be closing by now.
    os.write(
        1,
        f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}: before the interpreter ends, "
        f"process group destroyed: {not dist.is_initialized()}, "
        f"gloo workers running: {len(busy)}\n".encode(),
    )


atexit.register(_report)
trainer = L.Trainer(strategy=DeepOptimizerStatesStrategy(), accelerator="cpu", devices=2, logger=False)
trainer.strategy.setup_environment()  # Lightning's first step of fit: the process group is created here
assert dist.is_initialized() and dist.get_world_size() == 2


def leave_a_collective_in_flight() -> None:
    out = [torch.empty(1000) for _ in range(2)]
    dist.all_gather(out, torch.ones(1000), async_op=True)  # the handle and the tensors are dropped here


if dist.get_rank() == 1:
    leave_a_collective_in_flight()
else:
    time.sleep(LATE_S)
    out = [torch.empty(1000) for _ in range(2)]
    dist.all_gather(out, torch.ones(1000))
