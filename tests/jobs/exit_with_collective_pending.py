"""Set up the dos strategy's process group as a Trainer does, leave asynchronous gloo collectives whose handles
are dropped (as ZeRO-3's prefetching all-gathers can be when training ends), and exit.

Run by tests/test_ranks.py as a script: what is checked is how the process exits. The check registered first
runs last at exit (atexit runs handlers in reverse): it reports whether the strategy's handler destroyed the
group by then. Without that, gloo's threads may finish with the collectives' tensors after the interpreter is gone
and the process aborts ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402


def _report() -> None:
    # Straight to the file descriptor: sys.stdout may be closing by now.
    os.write(1, f"process group destroyed before the interpreter ends: {not dist.is_initialized()}\n".encode())


atexit.register(_report)
trainer = L.Trainer(strategy=DeepOptimizerStatesStrategy(), accelerator="cpu", devices=1, logger=False)
trainer.strategy.setup_environment()  # Lightning's first step of fit: the process group is created here
assert dist.is_initialized()


def leave_collectives_in_flight() -> None:
    out = [torch.empty(1)]
    for _ in range(20):
        dist.all_gather(out, torch.ones(1), async_op=True)  # the handle is dropped: only gloo's threads hold it


leave_collectives_in_flight()
