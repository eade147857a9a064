"""The host update side by side, on the same buffers, in one run: how close it gets to the memory roofline.

Rows (all on the same fp32 param, gradient and moments, with the gradient unscaled where the path can):
  three-pass        the path before issue 13: ``grad.mul_(1/scale)``, torch fused AdamW, cast to 16 bits
  compiled          the engine's host path: unscale, Adam and cast per element in one compiled loop
                    (engine/host_adam.c), split over the threads once per call
  compiled, fp32    the same for an fp32 model (the copy into the model's fp32 partition, no cast)
  compiled, TARGET  the same loop built for another instruction set (--march x86-64-v3,x86-64-v4,native):
                    an AVX-512 machine measures the AVX2 build too; a target this CPU cannot run is named
                    and left out
  tiles, caller     the fallback without a C compiler: unscale, torch's fused Adam and cast tile by tile, each
                    reading the last from cache, from the calling thread (three barriers per tile)
  tiles, workers    the same tiles, every host thread on its own share (no barrier between kernels): the
                    opt-in LIGHTNING_DOS_HOST_WORKERS=1 scheme (also swept over --tiles)
  tiles, grad_scale candidate: the workers' scheme with the unscale inside torch's kernel (it divides by
                    ``grad_scale`` and writes the gradient back)
  torch AdamW       torch's fused AdamW alone (no unscale, no cast): what one Adam pass costs
  DeepSpeed + cast  DeepSpeed's CPU Adam followed by the cast (no unscale: stricter than stock offload,
                    which also unscales in a pass of its own)
  stock offload     what stock ZeRO-3 offload runs: the unscale pass, DeepSpeed's CPU Adam, the cast
  memcpy            fp32 copy: this machine's copy bandwidth
With --optimizers, a second table instead: each optimizer the engine runs (Adam, Adagrad, Lion), with fp32 and
with bf16 master weights, gradient and states (DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states),
the engine's compiled update (unscale, step and bf16 cast in one pass) against DeepSpeed's CPU op for the same
optimizer (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, called on the same dtypes) followed by the
cast into the bf16 model copy (no unscale, as above); ratios are DeepSpeed's time over ours.
Rounds run every row once each, interleaved, so load on the machine falls on all rows alike; the table
gives medians (and the best sample), G elements/s, GB/s moved (a traffic model: bytes each path must
read and write per element, counted below), that against memcpy's GB/s in the same run, and ratios.

    python bench/kernels.py --numel 16000000 --sub-group-size 4000000 --rounds 15 --threads 2 \
        --march x86-64-v2,x86-64-v3,x86-64-v4,native
    python bench/kernels.py --numel 16000000 --rounds 15 --threads 2
    python bench/kernels.py --tiles 65536,131072,262144,524288,1048576,2097152 --threads 1,2   # torch tiles
    python bench/kernels.py --numel 25500000 --sub-group-size 1592640   # as bench/run.py --preset medium updates
    python bench/kernels.py --optimizers --numel 4000000 --rounds 9 --threads 2   # every optimizer vs DeepSpeed
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_dos.engine import host_workers, native
from lightning_dos.engine.kernels import HOST_TILE_ELEMENTS, SubGroupTensors, UpdateStep, step_tensor, tiled_update
from lightning_dos.model.update_rules import ADAM, RULES, Hyper

#: Bytes each path moves per element. Adam reads param, grad, exp_avg, exp_avg_sq (16) and writes param and
#: the moments (12); with ``grad_scale`` torch's kernel also writes the unscaled gradient back (4). The cast
#: reads fp32 (4) and writes 2; in the fused paths the read comes from cache or a register. The unscale pass
#: reads and writes the gradient (8); in the tiles it works in cache and the gradient is written back once (4);
#: the compiled loop unscales in a register and writes nothing back. memcpy reads and writes 4.
BYTES = {
    "three-pass": 8 + 28 + 6,
    "compiled": 16 + 12 + 2,  # also every "compiled, TARGET" row (bf16)
    "compiled, fp32": 16 + 12 + 4,
    "tiles": 16 + 16 + 2,
    "tiles, grad_scale": 16 + 16 + 2,
    "tiles, caller": 16 + 16 + 2,
    "torch AdamW": 28,
    "DeepSpeed + cast": 28 + 6,
    "stock offload": 8 + 28 + 6,
    "memcpy": 8,
}
#: A combined scale that is not a power of two (loss scale times a clip coefficient) and keeps gradients
#: far from denormals over hundreds of repeated unscales.
SCALE = 1.0 + 2.0**-10
HYPER = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)


def _deepspeed_op() -> tuple[object, object] | None:
    """DeepSpeed's CPU Adam (optimizer, op), built once; None (with the reason printed) where it cannot load."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.empty(1))], lr=1e-3, weight_decay=0.1)
        return opt, opt.ds_opt_adam
    except Exception as error:  # noqa: BLE001 - report why the op could not run, keep the other rows
        print(f"DeepSpeed CPU Adam unavailable: {error}")
        return None


#: The --optimizers table: (rule, master weights and gradient dtype, states dtype) by row name, and each rule's
#: hyperparameters (DeepSpeed's defaults but for a weight decay, so that every loop decays).
OPTIMIZER_CASES = {
    "adam": ("adam", torch.float32, torch.float32),
    "adagrad": ("adagrad", torch.float32, torch.float32),
    "lion": ("lion", torch.float32, torch.float32),
    "adam, bf16 master + states": ("adam", torch.bfloat16, torch.bfloat16),
    "adagrad, bf16 master + states": ("adagrad", torch.bfloat16, torch.bfloat16),
    "lion, bf16 master + states": ("lion", torch.bfloat16, torch.bfloat16),
}
OPTIMIZER_HYPERS = {
    "adam": Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True),
    "adagrad": Hyper(lr=1e-2, eps=1e-10, weight_decay=0.1),
    "lion": Hyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1),
}


def _deepspeed_updates() -> dict[str, Callable[..., None]] | None:
    """DeepSpeed's CPU op of each rule as ``update(param, grad, states)`` (its step 1, the rule's hyperparameters),
    built once; None (with the reason printed) where they cannot load."""
    try:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion

        dummy = [torch.nn.Parameter(torch.empty(1))]
        adam, adagrad, lion = DeepSpeedCPUAdam(dummy), DeepSpeedCPUAdagrad(dummy), DeepSpeedCPULion(dummy)
    except Exception as error:  # noqa: BLE001 - report why the ops could not run, keep our rows
        print(f"DeepSpeed's CPU optimizers unavailable: {error}")
        return None
    a, g, n = OPTIMIZER_HYPERS["adam"], OPTIMIZER_HYPERS["adagrad"], OPTIMIZER_HYPERS["lion"]
    return {
        "adam": lambda p, grad, s: adam.ds_opt_adam.adam_update(
            adam.opt_id, 1, a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, True, p, grad, *s
        ),
        "adagrad": lambda p, grad, s: adagrad.ds_opt_adagrad.adagrad_update(
            adagrad.opt_id, 1, g.lr, g.eps, g.weight_decay, p, grad, *s
        ),
        "lion": lambda p, grad, s: lion.ds_opt_lion.lion_update(
            lion.opt_id, 1, n.lr, n.beta1, n.beta2, n.weight_decay, p, grad, *s
        ),
    }


def _optimizer_rows(n: int, deepspeed: dict[str, Callable[..., None]] | None) -> dict[str, Callable[[], None]]:
    """For each of :data:`OPTIMIZER_CASES`: ours (``NAME, compiled``) and DeepSpeed's op plus the cast (``NAME,
    DeepSpeed + cast``), each on its own buffers of the case's dtypes."""
    rows: dict[str, Callable[[], None]] = {}
    for name, (rule, master, states_dtype) in OPTIMIZER_CASES.items():
        gen = torch.Generator().manual_seed(0)
        buffers = []
        for _ in range(2):  # one set of buffers for each side, from the same values
            gen.manual_seed(0)
            p, g = torch.randn(n, generator=gen).to(master), torch.randn(n, generator=gen).to(master)
            states = [torch.rand(n, generator=gen).to(states_dtype) for _ in RULES[rule].states]
            buffers.append((p, g, states, torch.empty(n, dtype=torch.bfloat16)))
        hyper = OPTIMIZER_HYPERS[rule]
        if native.available():
            p, g, states, lp = buffers[0]
            rows[f"{name}, compiled"] = lambda r=rule, p=p, g=g, s=states, lp=lp, h=hyper: native.host_update(
                r, p, g, s, 1, h, 1.0 / SCALE, lp
            )
        if deepspeed is not None:
            p, g, states, lp = buffers[1]

            def deepspeed_and_cast(r=rule, p=p, g=g, s=states, lp=lp) -> None:  # noqa: ANN001
                deepspeed[r](p, g, s)
                lp.copy_(p)

            rows[f"{name}, DeepSpeed + cast"] = deepspeed_and_cast
    return rows


def _optimizer_table(n: int, samples: dict[str, list[float]], rounds: int) -> str:
    median = {name: statistics.median(s) for name, s in samples.items()}
    lines = [
        f"| optimizer, storage | compiled: median s ({n / 1e6:.0f}M elements, {rounds} rounds) | best s "
        "| G elements/s | DeepSpeed + cast: median s | best s | G elements/s | DeepSpeed's time / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in OPTIMIZER_CASES:
        ours, theirs = median.get(f"{name}, compiled"), median.get(f"{name}, DeepSpeed + cast")
        cells = []
        for row, seconds in ((f"{name}, compiled", ours), (f"{name}, DeepSpeed + cast", theirs)):
            if seconds is None:
                cells += ["n/a"] * 3
            else:
                cells += [f"{seconds:.4f}", f"{min(samples[row]):.4f}", f"{n / seconds / 1e9:.2f}"]
        ratio = f"{theirs / ours:.2f}x" if ours and theirs else "n/a"
        lines.append(f"| {name} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def cpu_description() -> str:
    """The CPU's model name and the vector flags the builds depend on (Linux ``/proc/cpuinfo``)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "asimd", "sve"]
    present = [flag for flag in wanted if flag in flags]
    absent = [flag for flag in ("avx2", "avx512f") if flag not in flags and platform.machine() == "x86_64"]
    return f"{model}; flags: {' '.join(present) or 'unknown'}" + (f" (no {', no '.join(absent)})" if absent else "")


_PROBE = """
import sys, torch
from pathlib import Path
from lightning_dos.engine import native
from lightning_dos.model.update_rules import Hyper
kernel = native.HostUpdateKernel(Path(sys.argv[1]))
p, g, m, v = (torch.ones(4096) for _ in range(4))
hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
kernel.update("adam", p, g, (m, v), 1.0, hyper, 0.5, torch.empty(4096, dtype=torch.bfloat16), 1)
"""


def build_targets(targets: list[str], directory: Path) -> dict[str, native.HostUpdateKernel]:
    """``host_adam.c`` built with ``-march=TARGET`` for each target, as the engine builds it for ``native``; a
    target the compiler refuses or this CPU cannot run (tried in a child process first) is printed and left out."""
    compiler, kernels = native._compiler(), {}
    if compiler is None:
        print("no C compiler: the --march rows are left out")
        return kernels
    for target in targets:
        library = directory / f"host_adam-{target}.so"
        try:
            native.compile_library(compiler, [f"-march={target}", "-fopenmp"], library)
        except RuntimeError as error:
            print(f"-march={target}: left out, the compiler refused it ({str(error).splitlines()[-1]})")
            continue
        probe = subprocess.run([sys.executable, "-c", _PROBE, str(library)], capture_output=True, text=True)
        if probe.returncode != 0:
            why = "an illegal instruction" if probe.returncode in (-4, 132) else f"exit {probe.returncode}"
            print(f"-march={target}: left out, this CPU cannot run it ({why})")
            continue
        kernels[target] = native.HostUpdateKernel(library)
    return kernels


def _rows(
    buffers: list[torch.Tensor],
    tiles: list[int],
    deepspeed: tuple | None,
    targets: dict[str, native.HostUpdateKernel],
) -> dict[str, Callable[[], None]]:
    """Every path as a closure over ``buffers`` (param, grad, moments, bf16 and fp32 targets, memcpy target);
    ``targets`` are the other builds of the compiled loop, by ``-march`` name."""
    p, g, m, v, lp, lp32, dst = buffers
    n = p.numel()
    cpu = torch.device("cpu")
    step, scale = step_tensor(1, cpu), torch.tensor(SCALE, dtype=torch.float32)

    def three_pass() -> None:
        g.mul_(1.0 / SCALE)
        ADAM.torch_update(p, g, (m, v), step, HYPER)
        lp.copy_(p)

    def tiles_on_workers(tile: int, out: torch.Tensor) -> Callable[[], None]:
        tensors, update_step = SubGroupTensors(p, g, (m, v), out), UpdateStep(step, HYPER, 1.0 / SCALE)
        return lambda: tiled_update(ADAM, tensors, update_step, tile=tile)

    def compiled(out: torch.Tensor, kernel: native.HostUpdateKernel | None = None) -> Callable[[], None]:
        # The engine's build through torch's dispatcher, as the engine calls it; or another build, directly.
        update = native.host_update if kernel is None else kernel.update
        return lambda: update("adam", p, g, (m, v), 1.0, HYPER, 1.0 / SCALE, out)

    def caller_tiles(tile: int = 1 << 19) -> None:  # every kernel an OpenMP region over torch's threads
        for start in range(0, n, tile):
            span = slice(start, min(n, start + tile))
            g[span].mul_(1.0 / SCALE)
            ADAM.torch_update(p[span], g[span], (m[span], v[span]), step, HYPER)
            lp[span].copy_(p[span])

    def grad_scale_tiles(begin: int, end: int) -> None:  # torch's kernel divides by grad_scale, writes it back
        for start in range(begin, end, HOST_TILE_ELEMENTS):
            span = slice(start, min(end, start + HOST_TILE_ELEMENTS))
            torch._fused_adamw_(
                [p[span]], [g[span]], [m[span]], [v[span]], [], [step], lr=HYPER.lr, beta1=HYPER.beta1,
                beta2=HYPER.beta2, weight_decay=HYPER.weight_decay, eps=HYPER.eps, amsgrad=False,
                maximize=False, grad_scale=scale,
            )  # fmt: skip
            lp[span].copy_(p[span])

    host_workers.ENABLED = True  # the worker rows measure the opt-in scheme (the engine's default is the caller)

    def on_workers(work: Callable[[int, int], None]) -> Callable[[], None]:
        pool, count = host_workers.workers(), torch.get_num_threads()
        if pool is None:
            return lambda: work(0, n)
        return lambda: host_workers.run_shares(pool, work, host_workers.shares(n, count, 64))

    rows: dict[str, Callable[[], None]] = {"three-pass": three_pass}
    if native.available():
        rows["compiled"] = compiled(lp)
        rows["compiled, fp32"] = compiled(lp32)
    for target, kernel in targets.items():
        rows[f"compiled, {target}"] = compiled(lp, kernel)
    rows["tiles, caller"] = caller_tiles
    for tile in tiles:
        rows["tiles, workers" if tile == HOST_TILE_ELEMENTS else f"tiles, workers, tile {tile}"] = tiles_on_workers(
            tile, lp
        )
    rows["tiles, grad_scale"] = on_workers(grad_scale_tiles)
    rows["torch AdamW"] = lambda: ADAM.torch_update(p, g, (m, v), step, HYPER)
    if deepspeed is not None:
        opt, op = deepspeed

        def deepspeed_and_cast() -> None:
            op.adam_update(opt.opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, True, p, g, m, v)
            lp.copy_(p)

        def stock_offload() -> None:  # what stock ZeRO-3 offload runs per sub-group: unscale, CPU Adam, cast
            g.mul_(1.0 / SCALE)
            deepspeed_and_cast()

        rows["DeepSpeed + cast"] = deepspeed_and_cast
        rows["stock offload"] = stock_offload
    rows["memcpy"] = lambda: dst.copy_(p)
    return rows


def _all_rows(
    n: int,
    tiles: list[int],
    deepspeed: tuple | None,
    sub_group: int | None,
    targets: dict[str, native.HostUpdateKernel],
) -> dict[str, Callable]:
    """Rows over one set of buffers, whole or cut into sub-groups (each row then runs every sub-group in turn)."""
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    buffers = [p, g, m, v, torch.empty(n, dtype=torch.bfloat16), torch.empty(n), torch.empty(n)]
    spans = [slice(s, min(n, s + sub_group)) for s in range(0, n, sub_group)] if sub_group else [slice(0, n)]
    per_span = [_rows([t[span] for t in buffers], tiles, deepspeed, targets) for span in spans]

    def in_turn(name: str) -> Callable[[], None]:
        fns = [rows[name] for rows in per_span]

        def run() -> None:
            for fn in fns:
                fn()

        return run

    return {name: in_turn(name) for name in per_span[0]}


def _measure(rows: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    for fn in rows.values():
        fn()  # warm up: page faults, thread pool, DeepSpeed's op
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def _bytes(name: str) -> int:
    """Bytes per element row ``name`` moves (see :data:`BYTES`)."""
    if name in BYTES:
        return BYTES[name]
    return BYTES["tiles"] if name.startswith("tiles") else BYTES["compiled"]  # a "compiled, TARGET" row


def _table(n: int, samples: dict[str, list[float]], rounds: int) -> str:
    median = {name: statistics.median(s) for name, s in samples.items()}
    base, ds = median["three-pass"], median.get("DeepSpeed + cast")
    copy_gbps = BYTES["memcpy"] * n / median["memcpy"] / 1e9
    lines = [
        f"| path | median s ({n / 1e6:.0f}M elements, {rounds} rounds) | best s | G elements/s | bytes/element "
        "| GB/s moved | of memcpy's GB/s | vs three-pass | vs DeepSpeed + cast |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, seconds in median.items():
        nbytes = _bytes(name)
        gbps = nbytes * n / seconds / 1e9
        vs_ds = f"{ds / seconds:.2f}x" if ds else "n/a"
        lines.append(
            f"| {name} | {seconds:.4f} | {min(samples[name]):.4f} | {n / seconds / 1e9:.2f} | {nbytes} | {gbps:.1f} "
            f"| {gbps / copy_gbps:.2f} | {base / seconds:.2f}x | {vs_ds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=16_000_000, help="elements per buffer")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (one sample per row each)")
    parser.add_argument("--threads", default=None, help="comma-separated torch thread counts (default: current)")
    parser.add_argument("--tiles", default=str(HOST_TILE_ELEMENTS), help="comma-separated tile sizes to compare")
    parser.add_argument(
        "--sub-group-size", type=int, help="run every path sub-group by sub-group over the buffers, as an update does"
    )
    parser.add_argument(
        "--march",
        default="",
        help="comma-separated -march targets to build the compiled loop for and time beside the engine's own "
        "build, e.g. x86-64-v2,x86-64-v3,x86-64-v4,native",
    )
    parser.add_argument(
        "--optimizers",
        action="store_true",
        help="instead of the Adam paths: every optimizer, fp32 and all-bf16, ours against DeepSpeed's CPU op + cast",
    )
    args = parser.parse_args(argv)
    tiles = sorted({int(t) for t in args.tiles.split(",")} | {HOST_TILE_ELEMENTS})
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    before = torch.get_num_threads()
    try:  # each table sets torch's thread count: a caller in the same process (a test) gets its own back
        if args.optimizers:
            return _optimizers_main(args.numel, args.rounds, threads)
        return _adam_main(args, tiles, threads)
    finally:
        torch.set_num_threads(before)


def _adam_main(args: argparse.Namespace, tiles: list[int], threads: list[int]) -> int:
    deepspeed = _deepspeed_op()
    reason = native.unavailable_reason()
    print(f"CPU: {cpu_description()}")
    print("compiled host kernel: " + (f"unavailable ({reason}), its rows are left out" if reason else "built"))
    build_dir = tempfile.TemporaryDirectory(prefix="dos-kernels-")
    targets = build_targets([t for t in args.march.split(",") if t], Path(build_dir.name))
    for count in threads:
        torch.set_num_threads(count)
        rows = _all_rows(args.numel, tiles, deepspeed, args.sub_group_size, targets)
        samples = _measure(rows, args.rounds)
        groups = f", sub-groups of {args.sub_group_size}" if args.sub_group_size else ""
        print(f"\n{count} thread(s), torch {torch.__version__}, default tile {HOST_TILE_ELEMENTS} elements{groups}")
        print(_table(args.numel, samples, args.rounds))
    return 0


def _optimizers_main(n: int, rounds: int, threads: list[int]) -> int:
    print(f"CPU: {cpu_description()}")
    reason = native.unavailable_reason()
    print("compiled host kernel: " + (f"unavailable ({reason}), its rows are left out" if reason else "built"))
    deepspeed = _deepspeed_updates()
    for count in threads:
        torch.set_num_threads(count)
        samples = _measure(_optimizer_rows(n, deepspeed), rounds)
        print(f"\n{count} thread(s), torch {torch.__version__}, every optimizer into a bf16 copy")
        print(_optimizer_table(n, samples, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
