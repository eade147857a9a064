"""Host memory per parameter: ours against stock DeepSpeed ZeRO-3 offload, same model, fp32 and bf16-mixed.

Each (system, precision) trains the recipe GPT for a few steps in a process of its own, so that its peak
resident set (``VmHWM``) is its own. Bytes per parameter = (peak RSS during the fit - RSS just before it)
/ parameters: what the fit adds on top of the built model (the model's own fp32 weights are in the
baseline). On CPU the model's 16-bit partitions, DeepSpeed's buffers and the optimizer state all live in
host memory, so this is the sum of everything ZeRO-3 offload holds; a short sequence and a micro-batch
of one keep activations small beside it. The engine's own figures (host bytes it allocated, bytes really
pinned) come with our rows.

Beside it, the pre-flight figure (what ``DeepOptimizerStatesStrategy`` checks host memory against before it
allocates: DeepSpeed's offload buffers, rounded as their pinning rounds, and the engine's slabs; for stock, the
same model of DeepSpeed with its own fp32 partitions and CPU Adam moments in place of the slabs) and what it is
compared with, like with like: "state held" = the resident set after the steps less the resident set where
DeepSpeed starts allocating the optimizer's state (its fp32 partitions), both with the C allocator's freed heap
handed back. The rest of "fit adds" is the device side, which on CPU is host memory too (ZeRO-3's 16-bit
partitions, gathered parameters, gradients, buckets, activations, and freed heap glibc keeps).

"start-up" is the peak resident set from where DeepSpeed starts allocating the optimizer's state to the end of
set-up, less the resident set there (``VmHWM`` reset at that point through ``/proc/self/clear_refs``): what
start-up adds at its highest, DeepSpeed's master copies and the engine's slabs included while both exist, which
the pre-flight figure must cover (issue 32, point 5: registering the slabs, which faults in every page, before
DeepSpeed's fp32 master copies were freed put start-up 4 B/param above it on a GPU node).

    python bench/memory.py                                    # 8x512 GPT (25M params), both precisions
    python bench/memory.py --precisions bf16-states          # bf16 master weights + bf16 Adam moments

``bf16-states`` is ``bf16-mixed`` with DeepSpeed's ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``
and ``DeepSpeedCPUAdam(fp32_optimizer_states=False)``, for both systems (stock runs that optimizer anyway).
    python bench/memory.py --n-layer 4 --n-embd 256 --steps 2 --precisions 32-true
    python bench/memory.py --simulated                       # ours on the simulated accelerator (CPU)
    python bench/memory.py --precisions 32-true --systems stock-nvme:/nvme,nvme:0.5:/nvme,nvme:0:/nvme  # NVMe tiers
    python bench/memory.py --accelerator cuda                # on a GPU: DeepSpeed's pinned buffers, registered slabs

``--simulated`` runs ours on the simulated accelerator (``SimStreams``): the engine's GPU-side host memory (its
16-bit staging ring), and slabs registered by a registrar that faults in every page as ``cudaHostRegister`` does.
``--accelerator cuda`` trains on the GPU: host memory is then only what is offloaded (and CUDA's own).

``stock-nvme:DIR`` is stock ZeRO-3 NVMe offload (no pre-flight figure: DeepSpeed has none, and ours does not model
its swapper's buffers); ``nvme:SHARE:DIR`` ours with SHARE of the fp32 Adam state in host memory and the rest in a
swap file under DIR (its pre-flight figure counts the host part and the staging slabs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _record_before_optimizer_state(into: dict) -> None:
    """Record the resident set (freed heap handed back) where DeepSpeed starts allocating the optimizer's state;
    DeepSpeed's method runs unchanged."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from lightning_dos.host.hostmem import resident_bytes, return_freed_memory

    original = Stage3._create_fp32_partitions

    def measured(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return_freed_memory()
        into["before_state"] = resident_bytes()
        into["peak_before"] = _status_bytes("VmHWM")  # the fit's peak so far; start-up's is measured from here
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return original(self, *args, **kwargs)

    Stage3._create_fp32_partitions = measured


def child(args: argparse.Namespace) -> None:
    """One fit; prints one JSON line."""
    sys.path.insert(0, str(ROOT))
    on_cuda = args.accelerator == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")
    import lightning as L
    import torch

    from bench.run import StockGPT, make_strategy
    from lightning_dos.data import ByteCorpusDataModule
    from lightning_dos.host.hostmem import resident_bytes, return_freed_memory
    from lightning_dos.integration.preflight import figure_for
    from lightning_dos.recipes.gpt import GPT

    class Held(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks["startup_peak"] = _status_bytes("VmHWM")

        def on_train_batch_end(self, trainer: L.Trainer, *rest: object) -> None:
            engine = getattr(trainer.strategy, "dos_engine", None)
            if engine is not None:  # while fitting: teardown unpins the slabs
                marks["pinned_bytes"] = engine.pool.pinned_bytes
            return_freed_memory()
            marks["held"] = resident_bytes()

    marks: dict = {}
    _record_before_optimizer_state(marks)

    params = GPT.count_parameters(args.n_layer, args.n_embd, 256, args.seq)
    strategy, ours = make_strategy(args.system, args.sub_group_size, 12 * params)
    shape = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq, vocab_size=256)
    precision = args.precision
    L.seed_everything(0, verbose=False)
    if precision == BF16_STATES:
        precision = "bf16-mixed"
        strategy, ours = _bf16_states_strategy(args.system, args.sub_group_size)
        model = GPT(**shape, optimizer="deepspeed_adamw", fp32_optimizer_states=False)
    else:
        model = (GPT if ours else StockGPT)(**shape)
    if ours and args.simulated:
        from lightning_dos.sim.simstreams import SimStreams

        strategy.streams_factory = SimStreams
    data = ByteCorpusDataModule(seq_len=args.seq, batch_size=1, max_bytes=200_000)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if on_cuda else "cpu",
        devices=1,
        precision=precision,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Held()],
    )
    data.prepare_data()
    data.setup("fit")
    next(iter(data.train_dataloader()))  # the corpus is loaded before the baseline is taken
    baseline = _status_bytes("VmRSS")
    trainer.fit(model, datamodule=data)
    peak = max(_status_bytes("VmHWM"), marks["peak_before"])
    row = {"system": args.system, "precision": args.precision, "params": params, "baseline": baseline, "peak": peak}
    if ours:
        pool = strategy.dos_engine.pool
        row.update(engine_host_bytes=pool.host_bytes, pinned_bytes=marks["pinned_bytes"])
        figure = strategy.dos_host_figure
    elif args.system.startswith("stock-nvme:"):
        figure = None  # DeepSpeed's swapper: no pre-flight to set beside it
    else:
        # Stock has no pre-flight: the same model of DeepSpeed's buffers, its own master weights and optimizer state
        # in place of the slabs, in the dtypes the config asks for (preflight.config_footprint; Adam's two moments).
        # One parameter group: without pinning (CPU) grouping changes how sub-groups are cut, not their sum.
        figure = figure_for(
            model,
            [{"params": list(model.parameters())}],
            strategy.config,
            world_size=1,
            on_accelerator=on_cuda,
            engine_sub_group_size=args.sub_group_size,
            state_owner="deepspeed",
        )
    row.update(
        preflight=None if figure is None else figure.total,
        state_held=marks["held"] - marks["before_state"],
        startup=marks["startup_peak"] - marks["before_state"],
    )
    del torch
    print("RESULT " + json.dumps(row), flush=True)


#: The ``--precisions`` value for bf16-mixed with bf16 master weights and bf16 optimizer states.
BF16_STATES = "bf16-states"
_BF16_SECTION = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _bf16_states_strategy(system: str, sub_group_size: int) -> tuple[object, bool]:
    """``make_strategy`` with DeepSpeed's bf16 master weights and optimizer states configured."""
    from bench.run import stock_config
    from lightning_dos import DeepOptimizerStatesStrategy
    from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy

    if system == "stock":
        return DeepSpeedCPUStrategy(config={**stock_config(sub_group_size), "bf16": dict(_BF16_SECTION)}), False
    fraction = system if system == "auto" or system.startswith("stride:") else float(system)
    config = {"bf16": dict(_BF16_SECTION)}
    return DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=sub_group_size, config=config), True


def _per_param(row: dict) -> float:
    return (row["peak"] - row["baseline"]) / row["params"]


def preflight_table(rows: list[dict]) -> str:
    """The pre-flight figure beside what the run held, per (precision, system): medians over repeats."""
    lines = [
        "| precision | system | pre-flight B/param | state held B/param (range) | held / pre-flight "
        "| start-up peak B/param | start-up / pre-flight | fit adds B/param |",
        "|" + "---|" * 8,
    ]
    for precision, system in dict.fromkeys((r["precision"], r["system"]) for r in rows):
        mine = [r for r in rows if (r["precision"], r["system"]) == (precision, system)]
        params = mine[0]["params"]
        held = [r["state_held"] / params for r in mine]
        startup = statistics.median(r["startup"] for r in mine) / params
        if mine[0]["preflight"] is None:
            pre_text = held_ratio = startup_ratio = "n/a"
        else:
            pre = statistics.median(r["preflight"] for r in mine) / params
            pre_text, held_ratio = f"{pre:.2f}", f"{statistics.median(held) / pre:.3f}"
            startup_ratio = f"{startup / pre:.3f}"
        lines.append(
            f"| {precision} | {system} | {pre_text} | {statistics.median(held):.2f} ({min(held):.2f}-{max(held):.2f}) "
            f"| {held_ratio} | {startup:.2f} | {startup_ratio} "
            f"| {statistics.median(_per_param(r) for r in mine):.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One line per (precision, system): the median over repeats, the range, and the ratio to stock."""
    lines = [
        "| precision | system | params | runs | peak RSS GB | fit adds B/param (median) | range | vs stock "
        "| engine host B/param | pinned B/param |",
        "|" + "---|" * 10,
    ]
    keys = list(dict.fromkeys((r["precision"], r["system"]) for r in rows))
    medians = {k: statistics.median(_per_param(r) for r in rows if (r["precision"], r["system"]) == k) for k in keys}
    for precision, system in keys:
        mine = [r for r in rows if (r["precision"], r["system"]) == (precision, system)]
        per = [_per_param(r) for r in mine]
        stock = medians.get((precision, "stock"))
        first = mine[0]
        engine, pinned = (
            "n/a" if first.get(key) is None else f"{first[key] / first['params']:.1f}"
            for key in ("engine_host_bytes", "pinned_bytes")
        )
        ratio = f"{medians[(precision, system)] / stock:.3f}x" if stock else "n/a"
        lines.append(
            f"| {precision} | {system} | {first['params'] / 1e6:.1f}M | {len(mine)} "
            f"| {statistics.median(r['peak'] for r in mine) / GB:.3f} | {medians[(precision, system)]:.2f} "
            f"| {min(per):.2f}-{max(per):.2f} | {ratio} | {engine} | {pinned} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per (system, precision), interleaved")
    parser.add_argument("--sub-group-size", type=int, default=2_000_000)
    parser.add_argument("--systems", default="stock,auto")
    parser.add_argument("--precisions", default="32-true,bf16-mixed")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    parser.add_argument("--simulated", action="store_true", help="ours on the simulated accelerator (CPU only)")
    parser.add_argument(
        "--max-startup-ratio",
        type=float,
        help="exit 1 when one of ours has a start-up peak above this many times its pre-flight figure",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    common = [
        f"--n-layer={args.n_layer}",
        f"--n-embd={args.n_embd}",
        f"--n-head={args.n_head}",
        f"--seq={args.seq}",
        f"--steps={args.steps}",
        f"--sub-group-size={args.sub_group_size}",
        f"--accelerator={args.accelerator}",
        *(["--simulated"] if args.simulated else []),
    ]
    rows = []
    for precision in args.precisions.split(","):
        for system in [s for _ in range(args.repeats) for s in args.systems.split(",")]:
            cmd = [sys.executable, __file__, "--child", f"--system={system}", f"--precision={precision}", *common]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{system} {precision} failed (exit {out.returncode})")
            rows.append(json.loads(lines[-1][len("RESULT ") :]))
            print(f"# done: {system} {precision}", file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(preflight_table(rows))
    if args.max_startup_ratio is not None:
        over = [
            r
            for r in rows
            if r["system"] != "stock"
            and r["preflight"] is not None
            and r["startup"] > args.max_startup_ratio * r["preflight"]
        ]
        for r in over:
            print(
                f"start-up above {args.max_startup_ratio}x the pre-flight figure: {r['system']} {r['precision']} "
                f"{r['startup'] / r['params']:.2f} B/param against {r['preflight'] / r['params']:.2f}",
                file=sys.stderr,
            )
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
