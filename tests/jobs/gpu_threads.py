"""On a real GPU: the update's thread selects the engine's device, and "auto" plans in the memory free at the update.

Run by ``bash scripts/gpu-check.sh threads`` (``DS_ACCELERATOR=cuda``). Exits non-zero when a check fails.

1. **Binding.** The engine runs on the last visible GPU; an overlapped update runs on the engine's thread. Checked:
   the update thread called ``torch.cuda.set_device`` with the engine's device before its first stream operation,
   its current device is the engine's while it works, and no CUDA primary context exists on any other GPU
   afterwards (read from the driver, ``cuDevicePrimaryCtxGetState``). With two GPUs or more the same run without
   the binding (in a process of its own) must create a context on GPU 0: the check bites. With one GPU there is
   no other device to keep clean: only the call and the current device are checked (a thread's default device is
   the only device there).
2. **Budget.** A Trainer run with ``gpu_fraction="auto"``, ``overlap="auto"`` (no clipping: host sub-groups are
   updated during backward) re-planning every step, on a model that keeps ACTIVATION_BYTES of activations through
   most of backward. Each plan is made in the budget sampled at the previous step's update, with the engine's
   formula: the memory free then (free plus cached), and, since the update overlaps the next forward, no more than
   what was spare at the last forward/backward peak, less the margin. The check compares each plan's budget with
   that formula evaluated in ``on_before_optimizer_step`` of the step before, within 2%, and prints what was free
   early in backward (sampled from a hook on the logits' gradient) beside it. Under overlap the peak bound is
   never above what is free inside backward, so where the plan is made cannot change its budget on a GPU once a
   peak is known; that plans are made outside backward is shown on the simulated accelerator
   (tests/test_overlap.py). Its first run on an H100 (2026-11-26) found the peak bound binding: 59.4 GB planned
   with 74.9 GB free at the step, which the check as first written (budget equal to the free memory) called a
   failure.

Usage: python tests/jobs/gpu_threads.py [binding|budget|unbound]
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: Activations kept through backward in the budget check (4 GiB of fp32).
ACTIVATION_BYTES = 4 << 30
#: How far the budget a plan is made in may be from the memory free at the step.
TOLERANCE = 0.02


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0, "cuInit failed"
    return cuda


def contexts() -> list[bool]:
    """Whether each visible GPU has an active primary context in this process (from the driver, not torch)."""
    cuda = _driver()
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    active = []
    for ordinal in range(count.value):
        device, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0
        assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state)) == 0
        active.append(bool(state.value))
    return active


def _overlapped_update(bind: bool) -> dict:
    """One update on the engine's thread, on the last visible GPU; what that thread did and the contexts after."""
    from lightning_dos.engine.kernels import Hyper
    from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
    from lightning_dos.model.plan import Place, Plan

    ordinal = torch.cuda.device_count() - 1
    device = torch.device("cuda", ordinal)
    torch.cuda.set_device(device)  # the training thread, as Lightning's accelerator sets it
    numels = (1 << 20, 1 << 20)
    engine = InterleavedUpdate(numels, (0, 0), 1 << 18, device, torch.bfloat16)
    if not bind:
        engine.streams.bind_thread = lambda: None
    calls: list[tuple[str, int]] = []
    set_device = torch.cuda.set_device

    def recording_set_device(where: object) -> None:
        index = where if isinstance(where, int) else torch.device(where).index
        calls.append((threading.current_thread().name, index))
        set_device(where)

    torch.cuda.set_device = recording_set_device
    seen: dict = {}
    plan = Plan(tuple(Place.DEVICE if i % 2 else Place.HOST for i in range(len(engine.sub_groups))), 2)
    grads = [torch.randn(n).pin_memory() for n in numels]
    lp = [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in numels]
    inputs = StepInputs(grads, lp, [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)], [1, 1])

    def work() -> None:
        seen["device"] = torch.cuda.current_device()
        seen["calls_before_work"] = list(calls)
        engine.step(plan, inputs)

    try:
        engine.start(work)
        engine.wait_all()
        torch.cuda.synchronize(device)
    finally:
        torch.cuda.set_device = set_device
    return {"ordinal": ordinal, "contexts": contexts(), **seen}


def check_binding() -> list[str]:
    failures = []
    result = _overlapped_update(bind=True)
    ordinal = result["ordinal"]
    print(f"engine on cuda:{ordinal}; update thread's set_device calls before its work: {result['calls_before_work']}")
    print(f"update thread's current device while it worked: {result['device']}; contexts: {result['contexts']}")
    if ("lightning-dos-update", ordinal) not in result["calls_before_work"]:
        failures.append("the update thread did not select the engine's device before its work")
    if result["device"] != ordinal:
        failures.append(f"the update thread worked on device {result['device']}, not {ordinal}")
    others = [i for i, active in enumerate(result["contexts"]) if active and i != ordinal]
    if others:
        failures.append(f"CUDA contexts on GPUs the process does not use: {others}")
    if ordinal == 0:
        print("one GPU: no other device whose context could leak (the thread's default device is the engine's)")
    else:  # the check bites: without the binding, GPU 0 gets a context
        done = subprocess.run([sys.executable, __file__, "unbound"], capture_output=True, text=True, timeout=300)
        print(done.stdout.strip())
        if "context on GPU 0: True" not in done.stdout:
            failures.append(f"without the binding no context appeared on GPU 0; the check cannot fail: {done.stderr}")
    return failures


def check_budget() -> list[str]:
    import lightning as L

    import lightning_dos.planning.scheduler as scheduler_module
    from lightning_dos import DeepOptimizerStatesStrategy
    from lightning_dos.model.perfmodel import FREE_MEMORY_MARGIN
    from tests.helpers import VOCAB, TinyLM, loader, trainer

    scheduler_module.REPLAN_EVERY = 1  # a plan, and its budget, at every step

    def free_now() -> int:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return int((free + cached) * (1.0 - FREE_MEMORY_MARGIN))

    def formula_now(peak: int | None) -> int:
        """The engine's budget (``InterleavedUpdate.device_budget``) from torch's own counters."""
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        spare = free + reserved - torch.cuda.memory_allocated()
        if peak is not None:
            spare = min(spare, free + reserved - peak)
        return int(max(0, spare) * (1.0 - FREE_MEMORY_MARGIN))

    in_backward: dict[int, int] = {}
    at_step: dict[int, int] = {}
    expected: dict[int, int] = {}
    planned: dict[int, int | None] = {}

    class KeepsActivations(TinyLM):
        """TinyLM whose loss also depends on ACTIVATION_BYTES saved at the start of the forward: backward frees
        them at its end, after the last layers' gradients are reduced and copied to the host."""

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            # Not a leaf: autograd frees it with the graph's saved tensors at the end of backward (a leaf and its
            # gradient would stay while Lightning holds the loss, through the step).
            seed = torch.zeros((), device=self.device, requires_grad=True)
            big = torch.ones(ACTIVATION_BYTES // 4, device=self.device) + seed
            pad = (big * big).mean()  # saves `big` for backward, which reaches this node last
            x, y = batch
            logits = self(x)
            step = self.trainer.global_step + 1

            def sample(grad: torch.Tensor) -> None:  # a tensor hook must return None (or a tensor)
                in_backward.setdefault(step, free_now())

            logits.register_hook(sample)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
            return loss + 0.0 * pad

    class Record(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            scheduler = trainer.strategy.dos_scheduler
            replan = scheduler._replan

            def recording_replan(step: int) -> None:
                replan(step)
                planned[step] = scheduler.budget_bytes

            scheduler._replan = recording_replan

        def on_before_optimizer_step(self, trainer: L.Trainer, *args: object) -> None:
            step = trainer.global_step + 1
            at_step[step] = free_now()
            expected[step] = formula_now(trainer.strategy.dos_engine.budget.forward_backward_peak)

    L.seed_everything(0, verbose=False)
    # Small buckets: DeepSpeed copies gradients to the host from backward's hooks while the activations are alive.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20_000}
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction="auto", sub_group_size=4096, overlap="auto", config={"zero_optimization": zero}
    )
    run = trainer(strategy, steps=8, clip=None, callbacks=[Record()], accelerator="cuda")
    run.fit(KeepsActivations(), loader())
    failures = []
    if strategy.dos_adapter.overlap != "auto":
        failures.append(f"overlap='auto' ran as {strategy.dos_adapter.overlap!r}")
    print(f"{'step':>4} {'planned GB':>11} {'formula GB':>11} {'free at step GB':>16} {'free in backward GB':>20}")
    checked = 0
    for step in sorted(planned):
        budget, formula = planned[step], expected.get(step - 1)
        free, inside = at_step.get(step), in_backward.get(step)
        print(f"{step:>4} {_gb(budget):>11} {_gb(formula):>11} {_gb(free):>16} {_gb(inside):>20}")
        if step < 3 or budget is None or formula is None:
            continue  # step 1 plans in what was free before any forward; 2 in step 1's (warm-up allocations)
        checked += 1
        if abs(budget - formula) > TOLERANCE * formula:
            failures.append(f"step {step}: planned in {budget} bytes, the formula at the step before gives {formula}")
    if checked < 3:
        failures.append(f"only {checked} steps could be compared: {planned}, {expected}")
    return failures


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def main(what: str) -> int:
    if what == "unbound":
        result = _overlapped_update(bind=False)
        print(f"without the binding: context on GPU 0: {result['contexts'][0]}")
        return 0
    failures = check_binding() if what == "binding" else check_budget()
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"gpu threads check ({what}): {'failed' if failures else 'passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "binding"))
