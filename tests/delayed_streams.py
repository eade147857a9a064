"""The engine's stream ordering on a real GPU, made to fail when a wait is missing: sleeps on one stream at a time.

On a GPU an unordered copy usually wins its race anyway when sub-groups are small (the host is slower than the
device), so a missing wait passes. Here sub-groups are 16M elements (64 MB each way per tensor) and, in each of
several runs, one stream (the uploads, the compute stream, the downloads, the 16-bit uploads, or a stand-in for
DeepSpeed's gradient stream) sleeps ``SLEEP_CYCLES`` before each piece of work issued on it, while the others do
not: whatever should wait for that stream and does not runs ahead and reads or overwrites data that is not there
yet. The result is compared with ``torch.optim.AdamW(fused=True)`` on the GPU, the 16-bit parameters with the
updated weights as a DeepSpeed all-gather on its own stream would read them right after the step, and the host
slabs as the host reads them right after the step (no synchronisation in between).

``python -m tests.delayed_streams`` checks the engine (exit status 0: equal in every run); with
``TORCH_CUDA_SANITIZER=1`` torch's CUDA sanitizer checks every kernel and copy as well. ``--mutate FILE:LINE``
runs an engine with the synchronisation at that line of that engine module (``step.py``, ``streamed.py``, ...)
removed (tests/test_stream_sanitizer.py's mutations), which must fail. tests/test_gpu.py runs both;
tests/test_gpu_check.py runs the harness itself on the simulated accelerator on CPU (no sleeps there: the
stream-race checker stands in for them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lightning_dos.engine import pool as pool_module
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.engine.streams import CudaStreams, Streams
from lightning_dos.model.plan import Place, Plan

#: Elements per sub-group: large enough that copies and kernels take longer than issuing the next one.
SUB_GROUP = 1 << 24
#: About 0.1 s on an H100 (torch.cuda._sleep spins for this many GPU clock cycles): longer than the host takes to
#: update the next host sub-groups (16M elements each), so an unordered reader always runs ahead.
SLEEP_CYCLES = 200_000_000
HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
H, D, R = Place.HOST, Place.DEVICE, Place.RESIDENT
#: Step 1: 3 sub-groups stream through 2 buffers (a buffer is reused), 3 go to the host through a 2-slot 16-bit
#: ring (a slot is reused), 1 becomes resident. Step 2: nothing streams, so the resident sub-groups' own tail
#: events are all that cover them. Step 3: the resident ones come home (a download the host waits for) and are
#: updated on the host.
PLANS = (Plan((D, H, R, D, H, D, H), 2), Plan((R, H, R, H, H, R, H), 2), Plan((D, H, H, D, H, D, H), 2))
#: The streams that sleep, one per run ("deepspeed": the stand-in for DeepSpeed's gradient copies).
DELAYED = ("h2d", "compute", "d2h", "lp_h2d", "deepspeed")
#: Largest relative difference from AdamW(fused=True) (denominators clamped at 1e-3): the host's compiled kernel
#: and the GPU's fused one round differently by a few ulps of the terms (on an H100, 2026-11-26: 1.3e-5 for the
#: weights and 9.8e-5 for exp_avg, whose elements near 0 meet the clamp); a stale or overwritten tensor is off by
#: ~lr = 1e-2 (the weights) or far more (the moments).
RTOL = {"param": 1e-4, "exp_avg": 1e-3, "exp_avg_sq": 1e-3}


class DelayedStreams(CudaStreams):
    """The engine's CUDA streams, where ``delayed`` (a name of :data:`DELAYED`, or None) sleeps before every
    piece of work the engine issues on it."""

    def __init__(self, device: torch.device, delayed: str | None, cycles: int = SLEEP_CYCLES) -> None:
        super().__init__(device)
        self.delayed, self.cycles = delayed, cycles

    def _is_delayed(self, stream: torch.cuda.Stream) -> bool:
        if self.delayed in ("h2d", "d2h", "lp_h2d"):
            return stream == getattr(self, self.delayed)
        return self.delayed == "compute" and stream == self.compute

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        with super().on(stream):
            if stream is not None and self._is_delayed(stream):
                torch.cuda._sleep(self.cycles)
            yield


@dataclass
class Outcome:
    """One run: what differed from the reference (empty: nothing), per checked quantity."""

    delayed: str | None
    lp_on_host: bool
    errors: list[str]


def _relative(mine: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float().cpu()
    return float(((mine.float().cpu() - reference).abs() / reference.abs().clamp_min(1e-3)).max())


def run(
    engine_class: type = InterleavedUpdate,
    delayed: str | None = None,
    lp_on_host: bool = False,
    sub_group: int = SUB_GROUP,
    streams: Streams | None = None,
    watch: Callable[[InterleavedUpdate], None] | None = None,
) -> Outcome:
    """The steps of :data:`PLANS` on the GPU, checked against AdamW(fused=True).

    ``streams`` (with a smaller ``sub_group``) runs the same on another accelerator (the simulated one on CPU:
    no sleeps, no DeepSpeed stream; ``watch`` hands the engine to its race checker)."""
    device = streams.device if streams is not None else torch.device("cuda", torch.cuda.current_device())
    on_gpu = device.type == "cuda"
    streams = streams or DelayedStreams(device, delayed)
    numel = sub_group * len(PLANS[0].places)
    default_slots = pool_module.LP_STAGING_SLOTS
    pool_module.LP_STAGING_SLOTS = 2  # host sub-groups reuse 16-bit slots within a step: that wait is exercised
    try:
        engine = engine_class(
            [numel],
            [0],
            sub_group,
            device,
            torch.bfloat16,
            streams=streams,
            lp_device=torch.device("cpu") if lp_on_host else None,
        )
    finally:
        pool_module.LP_STAGING_SLOTS = default_slots
    assert engine.sizes == (sub_group,) * len(PLANS[0].places), engine.sizes
    if watch is not None:
        watch(engine)
    gen = torch.Generator(device).manual_seed(0)
    start = torch.randn(numel, generator=gen, device=device)
    engine.param_view(0).copy_(start.cpu())
    reference = torch.nn.Parameter(start)
    adamw = torch.optim.AdamW(
        [reference], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
        weight_decay=HYPER.weight_decay, fused=True,
    )  # fmt: skip
    pin = on_gpu  # DeepSpeed's gradient buffers (and offloaded 16-bit parameters) are pinned
    host_grad = torch.empty(numel, pin_memory=pin)
    lp = torch.zeros(numel, dtype=torch.bfloat16, device="cpu" if lp_on_host else device, pin_memory=pin and lp_on_host)
    deepspeed = torch.cuda.Stream(device) if on_gpu else None
    allgather = torch.cuda.Stream(device) if on_gpu else None
    errors: list[str] = []
    for step, plan in enumerate(PLANS, start=1):
        grad = torch.randn(numel, generator=gen, device=device)
        reference.grad = grad.clone()
        adamw.step()
        # DeepSpeed copies each gradient partition into its pinned host buffer on its reduce stream during backward
        # (after waiting for the caller's stream) and never waits for it; the adapter records an event there after
        # the end-of-backward epilogue and hands it to the engine (backward_ended), whose step waits for just that.
        # Without it (a first real-GPU run of this harness, on an H100) the host update read gradients not yet
        # copied, and torch's sanitizer saw the engine's 16-bit writes unordered with this tensor's zeroing.
        if on_gpu:
            deepspeed.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(deepspeed):
                if delayed == "deepspeed":
                    torch.cuda._sleep(SLEEP_CYCLES)
                host_grad.copy_(grad, non_blocking=True)
            ended = torch.cuda.Event()
            ended.record(deepspeed)
            engine.backward_ended(ended)
        else:
            host_grad.copy_(grad)
        engine.step(plan, StepInputs([host_grad], [lp], [HYPER], [step]))
        # Right after the step, with no synchronisation: the host reads its slabs (a checkpoint), and the next
        # forward's all-gather reads the 16-bit parameters on its own stream, waiting for nothing of ours.
        slabs = [
            engine.pool.param.clone(),
            engine.pool.state("exp_avg").clone(),
            engine.pool.state("exp_avg_sq").clone(),
        ]
        if on_gpu and not lp_on_host:
            with torch.cuda.stream(allgather):
                gathered = lp.clone()
            allgather.synchronize()
        else:
            gathered = lp.clone()
        state = adamw.state[reference]
        # Resident sub-groups' state is on the device (the host slabs are stale until it comes home, in step 3).
        home = torch.cat([torch.full((sub_group,), place != R) for place in plan.places])
        for name, mine, theirs in zip(
            ("param", "exp_avg", "exp_avg_sq"), slabs, (reference.detach(), state["exp_avg"], state["exp_avg_sq"])
        ):
            error = _relative(mine[home], theirs.cpu()[home])
            if not error < RTOL[name]:  # NaN counts as a difference
                errors.append(f"step {step}: {name} differs from AdamW(fused=True) by {error:.2e} (relative)")
        updated = reference.detach().cpu().to(torch.bfloat16)  # within RTOL of the engine's weights, checked above
        exact = slabs[0].to(torch.bfloat16)
        # The 16-bit parameters are the engine's updated weights, cast: exactly where those are home, and for the
        # resident ones the reference's cast (the engine's own weights are on the device), equal but for a few
        # elements that the few-ulp difference rounds across a bf16 boundary.
        mismatched = float((gathered.cpu()[home] != exact[home]).float().mean())
        resident_off = float((gathered.cpu()[~home] != updated[~home]).float().mean()) if (~home).any() else 0.0
        if resident_off > 1e-3:
            errors.append(
                f"step {step}: {resident_off:.1%} of the resident 16-bit parameters are not the updated weights"
            )
        if mismatched > 0:
            errors.append(f"step {step}: {mismatched:.1%} of the 16-bit parameters are not the updated weights")
    return Outcome(delayed, lp_on_host, errors)


def check(engine_class: type = InterleavedUpdate, stop_at_first: bool = False, verbose: bool = False) -> list[Outcome]:
    """Every delayed stream, with the 16-bit parameters on the GPU and on the host; the runs that differed.
    ``verbose`` prints each run's outcome as it ends (a run cut off by a deadline keeps what it printed)."""
    failed = []
    for lp_on_host in (False, True):
        for delayed in DELAYED:
            if lp_on_host and delayed == "lp_h2d":
                continue  # with the 16-bit parameters on the host nothing is uploaded on that stream
            try:
                outcome = run(engine_class, delayed, lp_on_host)
            except Exception as error:  # noqa: BLE001 - a race may surface as an error (torch's sanitizer raises)
                outcome = Outcome(delayed, lp_on_host, [f"{type(error).__name__}: {error}"])
            if verbose:
                where = "host" if lp_on_host else "GPU"
                print(f"  {delayed} delayed, 16-bit on the {where}: {'; '.join(outcome.errors) or 'equal'}", flush=True)
            gc.collect()  # the run's engine unpins its 1.4 GB of host slabs when it is collected
            if outcome.errors:
                failed.append(outcome)
                if stop_at_first:
                    return failed
    return failed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.delayed_streams", description=__doc__)
    parser.add_argument(
        "--mutate",
        help="remove the synchronisation at FILE:LINE of the engine (e.g. streamed.py:52; LINE: step.py); 'all': each "
        "in turn, one line per mutation as it is caught or missed (tests/test_gpu.py's mutation test, as it goes)",
    )
    parser.add_argument(
        "--part", default="1/1", help="with --mutate all: K/N runs the K-th of N equal slices of the mutations"
    )
    args = parser.parse_args(argv)
    if args.mutate == "all":
        part, _, parts = args.part.partition("/")
        return _every_mutation(int(part), int(parts or 1))
    engine_class = InterleavedUpdate
    if args.mutate is not None:
        from tests.test_stream_sanitizer import mutant_engine

        where, _, line = args.mutate.rpartition(":")
        engine_class = mutant_engine(int(line), where or "step.py")
    failed = check(engine_class, stop_at_first=args.mutate is not None, verbose=True)
    for outcome in failed:
        where = "host" if outcome.lp_on_host else "GPU"
        print(f"{outcome.delayed or 'nothing'} delayed, 16-bit parameters on the {where}: {'; '.join(outcome.errors)}")
    print("delayed-streams:", "DIFFERS" if failed else "equal to AdamW(fused=True) in every run")
    return 1 if failed else 0


def _every_mutation(part: int = 1, parts: int = 1) -> int:
    """Each synchronisation removed in turn (the ``part``-th of ``parts`` slices of them: on an H200 one takes 15 to
    120 s, so all of them outlast one 10-minute command); exit status 0 when every removal made a run differ."""
    import time

    from tests.test_stream_sanitizer import all_mutations, mutant_engine

    mutations = all_mutations()
    size = -(-len(mutations) // parts)
    missed = 0
    for module, line, what in mutations[(part - 1) * size : part * size]:
        began = time.perf_counter()
        caught = check(mutant_engine(line, module), stop_at_first=True)
        missed += not caught
        found = f"caught ({caught[0].delayed} delayed)" if caught else "MISSED"
        print(f"{what} (line {line}): {found} in {time.perf_counter() - began:.1f} s", flush=True)
    print("mutations:", f"{missed} missed" if missed else "every removal caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
