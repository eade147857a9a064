"""Side-by-side benchmark: stock ZeRO-3 offload, TwinFlow, the paper's stride and ours, same model, same run.

Trains the recipe GPT through Lightning once per system and prints a markdown table of medians over
the steps after warm-up: forward, backward, update and iteration time, update throughput, PCIe GB/s
per direction during the update, peak accelerator memory and host memory held for the optimizer, with
ratios against stock offload and against the best TwinFlow ratio, and the update phase's floor T(r*)
from the calibrated rates. Writes the same as JSON.

    python bench/run.py                       # a model sized for this machine, every system
    python bench/run.py --preset tiny --steps 4 --warmup 1 --systems stock,stride:2,auto
    python bench/run.py --n-layer 24 --n-embd 2048 --n-head 16 --seq 2048 --precision bf16-mixed
    python bench/run.py --preset medium --precision bf16-mixed --clip 0.05 --systems stock,auto
    python bench/run.py --preset medium --systems auto@off,auto@forward,auto   # overlap "off", "forward", "auto"
    python bench/run.py --preset medium --systems stock,stock-nvme:/local_nvme  # stock NVMe offload (ZeRO-Infinity)
    python bench/run.py --preset medium --systems stock-nvme:/local_nvme,nvme:0.5:/local_nvme,nvme:0:/local_nvme
        # ours on NVMe, with half and none of the optimizer state in host memory
    python bench/run.py --preset 1b --systems stock,auto,auto@off --steps-jsonl out/steps.jsonl --trace-dir out/traces
        # one JSON line per step for bench/fit.py, and a trace of two steps of each system
    python bench/run.py --preset small --exactness --isolate --systems stock,twinflow:0.3,auto,superoffload:0.9,\
zenflow:0.1:4,fsdp-offload   # the peers (bench/peers.py), exactness beside speed, each system in its own process
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

import lightning as L  # noqa: E402

from bench import peers  # noqa: E402
from bench.steps import StepRecorder, prediction_table, write_lines  # noqa: E402
from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.data import ByteCorpusDataModule  # noqa: E402
from lightning_dos.integration.callbacks.monitor import DOSMonitor  # noqa: E402
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy  # noqa: E402
from lightning_dos.recipes.gpt import GPT  # noqa: E402

#: Model shapes: (layers, width, heads, sequence length, micro-batch).
PRESETS = {
    "tiny": (2, 64, 2, 64, 4),
    "small": (4, 256, 4, 128, 8),
    "medium": (8, 512, 8, 256, 8),
    "1b": (24, 2048, 16, 2048, 1),
    "3b": (32, 2560, 32, 2048, 1),
    "7b": (32, 4096, 32, 2048, 1),
}
DEFAULT_SYSTEMS = (
    "stock,twinflow:0.1,twinflow:0.2,twinflow:0.3,twinflow:0.4,twinflow:0.5,stride:2,stride:3,stride:4,auto"
)
GB = 1e9
#: DeepSpeed's async I/O settings both NVMe systems run with (stock's swapper and ours): 1 MiB blocks, 32 in flight,
#: each request split over 2 threads; the drive's floor is measured with them too.
AIO = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 2, "overlap_events": True}


@dataclass
class Result:
    system: str
    forward_s: float
    backward_s: float
    update_s: float
    step_s: float
    params: int
    update_params_per_s: float
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    device_share: float | None = None
    peak_accelerator_gb: float | None = None
    optimizer_host_gb: float | None = None
    predicted_update_s: float | None = None
    #: Peak resident memory of the process that ran the system alone (``--isolate``, and every peer), GB.
    peak_host_gb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class StockGPT(GPT):
    """The recipe GPT with DeepSpeed's CPU Adam, as a user of stock ZeRO-Offload runs it (DeepSpeed
    refuses torch optimizers with offload unless told otherwise). Same groups, same LR schedule."""

    cpu_adam_kind = "deepspeed"

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        torch_opt = config["optimizer"] if isinstance(config, dict) else config
        cpu_adam = peers.cpu_adam(torch_opt, self.cpu_adam_kind)
        if isinstance(config, dict) and "lr_scheduler" in config:
            scheduler = config["lr_scheduler"]
            inner = scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler
            inner.optimizer = cpu_adam  # LambdaLR and friends only read and write param_groups' lr
            for group, initial in zip(cpu_adam.param_groups, torch_opt.param_groups):
                group.setdefault("initial_lr", initial.get("initial_lr", initial["lr"]))
            return {"optimizer": cpu_adam, "lr_scheduler": scheduler}
        return cpu_adam


class ZenFlowGPT(StockGPT):
    """The same with ZenFlow's CPU Adam (its stage-3 path steps it), same hyperparameters."""

    cpu_adam_kind = "zenflow"


class FSDPGPT(peers.FSDPClipping, GPT):
    """The recipe GPT with its own torch AdamW, clipped by FSDP's ``clip_grad_norm_``."""


MODELS = {"deepspeed": StockGPT, "zenflow": ZenFlowGPT, "torch": FSDPGPT}


#: Tensor buffers stock's pipelined swapper runs with (4 sub-groups' worth for Adam: master weights, two moments,
#: gradient); ``stock-nvme:DIR:N`` runs it with N.
STOCK_BUFFERS = 16


def parse_stock_nvme(name: str) -> tuple[str, int]:
    """``stock-nvme:DIR`` or ``stock-nvme:DIR:N``: the directory, and the swapper's buffer count."""
    directory = name.split(":", 1)[1]
    head, _, tail = directory.rpartition(":")
    return (head, int(tail)) if head and tail.isdigit() else (directory, STOCK_BUFFERS)


def stock_config(
    sub_group_size: int, ratio: float = 1.0, nvme_path: str | None = None, buffers: int = STOCK_BUFFERS
) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    if ratio != 1.0:
        offload["ratio"] = ratio  # TwinFlow: the first (1 - ratio) share of sub-groups stays on the GPU
    config: dict[str, Any] = {
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "sub_group_size": sub_group_size},
        "zero_allow_untested_optimizer": True,
    }
    if nvme_path is not None:
        # ZeRO-Infinity: every sub-group's optimizer state in files, DeepSpeed's pipelined swapper reading the next
        # sub-groups ahead and writing the last ones back behind the CPU's update (its best settings).
        offload.update(
            device="nvme", nvme_path=nvme_path, pipeline_read=True, pipeline_write=True, buffer_count=buffers
        )
        config["aio"] = dict(AIO)
    return config


def make_strategy(system: str, sub_group_size: int, state_bytes: int = 0) -> tuple[L.pytorch.strategies.Strategy, bool]:
    """The strategy for a system name, and whether it is ours. Ours take an ``@overlap`` suffix (``auto@forward``;
    none: the strategy's default, ``"auto"``); ``state_bytes``: the rank's optimizer state, which ``nvme:SHARE:DIR``
    keeps that share of in host memory."""
    system, _, overlap = system.partition("@")
    if peers.is_peer(system):
        return peers.peer_strategy(system, sub_group_size, stock_config)[0], False
    if system == "stock":
        return DeepSpeedCPUStrategy(config=stock_config(sub_group_size)), False
    if system.startswith("stock-nvme:"):  # stock-nvme:DIR[:N], DeepSpeed's NVMe offload with its files under DIR
        directory, buffers = parse_stock_nvme(system)
        return DeepSpeedCPUStrategy(config=stock_config(sub_group_size, nvme_path=directory, buffers=buffers)), False
    if system.startswith("nvme:"):  # nvme:SHARE:DIR, ours with SHARE of the fp32 Adam state in host memory
        _, share, directory = system.split(":", 2)
        offload = {"device": "nvme", "nvme_path": directory}
        config = {"zero_optimization": {"stage": 3, "offload_optimizer": offload, "sub_group_size": sub_group_size}}
        strategy = DeepOptimizerStatesStrategy(
            config={**config, "aio": dict(AIO)}, overlap=overlap or "auto",
            host_memory_budget=int(float(share) * state_bytes),
        )  # fmt: skip
        return strategy, True
    if system.startswith("twinflow:"):
        gpu_share = float(system.split(":")[1])
        return DeepSpeedCPUStrategy(config=stock_config(sub_group_size, ratio=1.0 - gpu_share)), False
    fraction = system if system in ("auto",) or system.startswith("stride:") else float(system)
    overlap = overlap or "auto"
    return DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=sub_group_size, overlap=overlap), True


def trace_name(system: str, clip: float | None) -> str:
    """The folder a system's trace goes to under ``--trace-dir``: its name and clip, safe as a file name."""
    return "".join(c if c.isalnum() or c in "@.-" else "_" for c in f"{system}_clip-{clip if clip else 'off'}")


def _overlap_of(system: str, ours: bool) -> str | None:
    return (system.partition("@")[2] or "auto") if ours else None


def _device_name(args: argparse.Namespace) -> str:
    on_gpu = torch.cuda.is_available() and args.accelerator != "cpu"
    return torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"


def _median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


class _DriveWatch(L.Callback):
    """The drive of an NVMe system measured right before its measured steps and right after (``each_step``: before
    every measured step too), and the tier's byte counters there.

    A shared or virtual drive's bandwidth drifts from minute to minute (this project's CPU machine: 0.5 to 2.3 GB/s
    within the hour, bench/RESULTS.md; 1.4 before a system's steps and 2.9 GB/s after them, a minute later), so a
    step's floor is taken at the mean of the rates measured right around it, not at a figure from elsewhere. Around
    the whole run by default; ``each_step`` measures between the steps too, each step then set beside the drive of
    its own second, at the cost of the few hundred MB each measurement writes and reads between two steps. Listed
    before the monitor, so each measurement falls outside the timed phases of the step after it."""

    def __init__(self, warmup: int, directory: str | None, nbytes: int, each_step: bool = False) -> None:
        self.warmup, self.directory, self.nbytes, self.each_step = warmup, directory, nbytes, each_step
        #: (read B/s, write B/s, B/s reading and writing at once, bytes the tier had read, bytes it had written) at
        #: the first measured step's start, and at the end of the last.
        self.marks: list[tuple[float, float, float, int, int]] = []

    def _mark(self, trainer: L.Trainer) -> None:
        files = getattr(getattr(trainer.strategy, "dos_engine", None), "files", None)
        counters = (files.read_bytes, files.written_bytes) if files is not None else (0, 0)
        self.marks.append((*drive_rates(self.directory, self.nbytes), *counters))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.directory is None or trainer.global_step < self.warmup:
            return
        if self.each_step or not self.marks:
            self._mark(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.directory is not None and self.marks:
            self._mark(trainer)

    def floors(self, steps: int, fixed: tuple[float, float] | None = None) -> list[dict[str, float]]:
        """For each window between two measurements of the drive (the ``steps`` measured steps, or each of them): the
        drive's rates around it, the bytes moved per step (the tier's counters, or ``fixed``, bytes read and written
        per step) and the floor of a step, seconds: the lesser of the reads then the writes at their own rates and all
        of them at the rate of reading and writing at once."""
        per_window = steps / max(1, len(self.marks) - 1)
        return [
            drive_floor(before[:3], after[:3], *(fixed or ((after[3] - before[3]) / per_window,
                                                        (after[4] - before[4]) / per_window)))
            for before, after in zip(self.marks, self.marks[1:])
        ]  # fmt: skip


def drive_rates(directory: str, nbytes: int) -> tuple[float, float, float]:
    """The drive under ``directory`` now, B/s: reading, writing, and reading and writing at once (``nbytes`` each,
    DeepSpeed's async I/O op with the systems' :data:`AIO` settings)."""
    from lightning_dos.host.disk import measure_mixed

    rates = _measure_drive(directory, nbytes)
    mixed = measure_mixed(directory, nbytes, settings=_aio_settings())
    return rates.read_bps, rates.write_bps, mixed


def drive_floor(
    before: tuple[float, float, float], after: tuple[float, float, float], read: float, written: float
) -> dict[str, Any]:
    """The drive's floor for moving ``read`` and ``written`` bytes between two measurements of it
    (:func:`drive_rates`), at the mean of the two: the lesser of the reads then the writes at their own rates and
    all of them at the rate of reading and writing at once, seconds (``floor_s``), with the rates and bytes."""
    read_bps, write_bps, mixed_bps = ((b + a) / 2 for b, a in zip(before, after, strict=True))
    serial_s, overlapped_s = read / read_bps + written / write_bps, (read + written) / mixed_bps
    return {
        "read_bps": read_bps, "read_bps_around": (before[0], after[0]), "write_bps": write_bps,
        "mixed_bps": mixed_bps, "read_bytes": read, "written_bytes": written, "serial_floor_s": serial_s,
        "overlapped_floor_s": overlapped_s, "floor_s": min(serial_s, overlapped_s),
    }  # fmt: skip


def _drive_of(system: str, params: int) -> tuple[str | None, int]:
    """The directory an NVMe system keeps its state in, and the bytes to measure its drive with: as many as the
    system moves each way per step (fp32 Adam state, 12 bytes per parameter, ours only past its host share), at least
    64 MiB and at most 1 GiB, aligned for O_DIRECT. (None, 0) for a system that keeps no state on a drive."""
    name = system.partition("@")[0]
    if name.startswith("stock-nvme:"):
        directory, state = parse_stock_nvme(name)[0], 12 * params
    elif name.startswith("nvme:"):
        _, share, directory = name.split(":", 2)
        state = int(12 * params * (1.0 - float(share)))
    else:
        return None, 0
    return directory, min(1 << 30, max(64 << 20, -(-state // 4096) * 4096))


def _measure_drive(directory: str, nbytes: int) -> Any:
    """The drive's read and write bandwidth under ``directory`` (lightning_dos.host.disk.measure_disk: DeepSpeed's
    async I/O op with the systems' :data:`AIO` settings)."""
    from lightning_dos.host.disk import measure_disk

    return measure_disk(directory, nbytes, settings=_aio_settings())


def _aio_settings() -> Any:
    """The systems' :data:`AIO` settings, as the drive measurements take them (``lightning_dos.host.disk``)."""
    from lightning_dos.host.disk import AioSettings

    return AioSettings(AIO["block_size"], AIO["queue_depth"], AIO["intra_op_parallelism"])


def warm_drives(systems: list[str], params: int, seconds: float) -> None:
    """Read and write each NVMe system's drive (each directory once) for ``seconds`` in all before the first system
    runs, with the bytes its floor is measured with, and print the last rates: every system then meets a drive
    that has been working, not only the ones after the first."""
    directories = {}
    for system in systems:
        directory, nbytes = _drive_of(system, params)
        if directory is not None:
            directories[directory] = max(nbytes, directories.get(directory, 0))
    if not directories or seconds <= 0:
        return
    began, rounds = time.perf_counter(), 0
    while True:
        for directory, nbytes in directories.items():
            rates = _measure_drive(directory, nbytes)
        rounds += 1
        if time.perf_counter() - began >= seconds:
            break
    print(
        f"# drives warmed for {time.perf_counter() - began:.1f} s (each read and written {rounds}x): last read "
        f"{rates.read_bps / 1e9:.2f} GB/s, write {rates.write_bps / 1e9:.2f} GB/s"
    )


def prime(systems: list[str], params: int, args: argparse.Namespace) -> None:
    """Run the first NVMe system once, unmeasured, before the first round, so that no measured system is the first fit
    of the run: the first met this project's shared drive at about twice the rate of every fit after it, whichever
    system it was, the drive warmed or rested or not (bench/RESULTS.md, 2026-11-28). Nothing without NVMe systems."""
    system = next((system for system in systems if _drive_of(system, params)[0] is not None), None)
    if system is None:
        return
    began = time.perf_counter()
    update_s = run_system(system, args).update_s
    print(
        f"# primed: one unmeasured fit of {system} before the first round ({time.perf_counter() - began:.0f} s, "
        f"update {update_s:.3f} s), so that no measured system is the run's first"
    )


def _drive_floor(result: Result, rows: list[dict[str, float]], steps: list[dict[str, float]]) -> None:
    """Put the drive's floor into ``result.extra``: the floor of a step (the drive measured around the measured
    steps, or around each), the update over it (each step over its own floor, the median, where the drive was
    measured around each step), the drive's rates, bytes per step."""
    floor_s = statistics.median(s["floor_s"] for s in steps)
    updates = [row["dos/update_s"] for row in rows if "dos/update_s" in row]
    if len(steps) == len(updates) > 1:  # each step beside the drive of its own second
        over = statistics.median(u / s["floor_s"] for u, s in zip(updates, steps, strict=True) if s["floor_s"] > 0)
    else:
        over = statistics.median(updates) / floor_s if floor_s > 0 else None
    result.extra.update(
        disk_floor_s=floor_s,
        update_over_floor=over,
        step_updates_s=updates,
        read_gbs=statistics.median(s["read_bps"] for s in steps) / GB,
        write_gbs=statistics.median(s["write_bps"] for s in steps) / GB,
        mixed_gbs=statistics.median(s["mixed_bps"] for s in steps) / GB,
        read_gbs_around=tuple(bps / GB for bps in steps[0]["read_bps_around"]),
        read_gb_per_step=statistics.median(s["read_bytes"] for s in steps) / GB,
        written_gb_per_step=statistics.median(s["written_bytes"] for s in steps) / GB,
        drive_steps=steps,
    )


def run_system(system: str, args: argparse.Namespace) -> Result:
    layers, width, heads, seq, batch = args.shape
    params = GPT.count_parameters(layers, width, args.vocab, seq)
    if peers.is_peer(system):
        strategy, kind = peers.peer_strategy(system, args.sub_group_size, stock_config)
        ours, model_cls = False, MODELS[kind]
    else:
        strategy, ours = make_strategy(system, args.sub_group_size, 12 * params)
        model_cls = GPT if ours else StockGPT
    measured = args.warmup + args.steps
    callbacks: list[L.Callback] = []
    if args.exactness:
        # Stock offload's run is the reference (exact AdamW); two more steps: a non-finite batch, a finite one.
        model_cls = peers.with_injection(model_cls)
        callbacks.append(probe := peers.ExactnessProbe(measured, args.reference, save=system == "stock"))
    L.seed_everything(0, verbose=False)
    model = model_cls(n_layer=layers, n_embd=width, n_head=heads, block_size=seq, vocab_size=args.vocab)
    if args.exactness:
        model.inject_at = measured
    data = ByteCorpusDataModule(seq_len=seq, batch_size=batch, max_bytes=args.max_bytes)
    # Two steady steps traced (the first two measured), each system and clip into a folder of its own.
    trace_dir = args.trace_dir / trace_name(system, args.clip) if args.trace_dir is not None else None
    trace_steps = (args.warmup, args.warmup + 1)
    monitor = DOSMonitor(trace_dir=trace_dir, trace_steps=trace_steps, summary=False, log_every_n_steps=0)
    recorder = StepRecorder(args.warmup, lines=args.steps_jsonl is not None)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        gradient_clip_val=args.clip,
        max_steps=measured + (2 if args.exactness else 0),
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            drive := _DriveWatch(args.warmup, *_drive_of(system, params), args.drive_each_step),
            monitor,
            recorder,
            *callbacks,
        ],
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # DeepSpeed never removes its swap files, and names them by parameter ids that a process keeps counting from model
    # to model: 0.4 GB more per medium run here. The bench removes the folder it made it create (never one it found).
    swap_folder = Path(parse_stock_nvme(system)[0]) / "zero_stage_3" if system.startswith("stock-nvme:") else None
    stale_swap = swap_folder is not None and swap_folder.exists()
    trainer.fit(model, datamodule=data)
    if swap_folder is not None and not stale_swap:
        shutil.rmtree(swap_folder, ignore_errors=True)
    # Steady-state steps only: after the warm-up, neither the planner's timed iteration nor a plan switch.
    rows, steady = recorder.steady(list(monitor.history), measured)
    if args.steps_jsonl is not None:
        run = {"system": system, "clip": args.clip, "overlap": _overlap_of(system, ours), "warmup": args.warmup,
               "steps": args.steps, "shape": args.shape, "precision": args.precision, "params": params,
               "sub_group_size": args.sub_group_size, "device": _device_name(args)}  # fmt: skip
        write_lines(args.steps_jsonl, recorder.lines(list(monitor.history)[:measured], run))
    update_s = _median(rows, "dos/update_s") or float("nan")
    result = Result(
        system=system,
        forward_s=_median(rows, "dos/forward_s") or float("nan"),
        backward_s=_median(rows, "dos/backward_s") or float("nan"),
        update_s=update_s,
        step_s=_median(rows, "dos/step_s") or float("nan"),
        params=params,
        update_params_per_s=params / update_s,
        h2d_gbps=_median(rows, "dos/h2d_gbps"),
        d2h_gbps=_median(rows, "dos/d2h_gbps"),
        device_share=_median(rows, "dos/gpu_fraction"),
        peak_accelerator_gb=torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else None,
        predicted_update_s=_median(rows, "dos/update_predicted_s"),
    )
    if system.startswith("nvme:"):
        # Ours: the bytes the tier really read and wrote in each measured step (the file-backed sub-groups' master
        # weights and moments, less the reads the staging slabs saved; gradients stay in host memory).
        files = strategy.dos_engine.files
        in_files = 12 * sum(files.sub_groups[i].numel for i in files.indices) if files is not None else 0
        _drive_floor(result, rows, drive.floors(args.steps))
        result.extra["state_gb"] = in_files / GB
    if system.startswith("stock-nvme:"):
        # The drive's floor for this update: every sub-group's master weights and Adam moments (12 bytes per element)
        # read and written once per step, and its gradient read back (DeepSpeed swaps it out during backward), at the
        # bandwidth measured on the same directory.
        from lightning_dos.model.nvme import DiskRates, stock_tiered_update_s
        from lightning_dos.model.plan import split_into_sub_groups
        from lightning_dos.planning.calibrate import calibrate

        state = 12 * params  # master weights and Adam's moments, fp32; DeepSpeed reads the fp32 gradient back too
        grads = 4 * params
        _drive_floor(result, rows, drive.floors(args.steps, fixed=(state + grads, state)))
        measured = DiskRates(result.extra["read_gbs"] * GB, result.extra["write_gbs"] * GB)
        # The performance model's account of it (model/nvme.py), from this machine's calibrated host rates.
        sizes = [sg.numel for sg in split_into_sub_groups([params], [0], args.sub_group_size)]
        lp_bytes = 2 if "16" in args.precision else 4
        predicted = stock_tiered_update_s(sizes, calibrate(torch.device("cpu")), measured, lp_bytes=lp_bytes)
        result.predicted_update_s = predicted.time_s
        result.extra["state_gb"] = state / GB
    deepspeed_engine = getattr(strategy, "deepspeed_engine", None)  # FSDP has none: its model keeps the norm
    norm = getattr(model, "last_grad_norm", None)
    if args.clip and deepspeed_engine is not None:
        norm = deepspeed_engine.get_global_grad_norm()
    if norm is not None:
        # The last step's global gradient norm: clipping is active (the unscale factor is not 1) above the clip value.
        result.extra["last_grad_norm"] = float(norm)
    if args.exactness:
        result.extra.update(probe.found)
    commit = [row["dos/commit_rate"] for row in rows if "dos/commit_rate" in row]
    result.extra["commit_rate"] = commit[-1] if commit else None
    result.extra["steady_steps"] = steady
    result.extra.update(recorder.predictions(steady))
    if any("dos/engine_update_predicted_s" in row for row in rows):  # then dos/update_predicted_s is the phase's
        result.extra["predicted_update_phase_s"] = _median(rows, "dos/update_predicted_s")
    if ours:
        engine = strategy.dos_engine
        staging = engine.files.staging_bytes if engine.files is not None else 0
        # The NVMe tier's staging slabs too, and the spare slots speculative updates write into.
        result.optimizer_host_gb = (engine.pool.host_bytes + staging + engine.spare.nbytes) / GB
        result.extra["spare_gb"] = engine.spare.nbytes / GB
        result.extra["commit_s"] = _median(rows, "dos/commit_s")
        result.extra["engine_update_s"] = _median(rows, "dos/engine_update_s")
        estimator = getattr(getattr(strategy, "dos_scheduler", None), "estimator", None)
        if estimator is not None:
            from lightning_dos.model.perfmodel import floor

            # From the calibrated rates: the scheduler's own are refined and corrected by the steps just measured.
            fp = engine.footprint
            r_star, t_floor = floor(sum(engine.sizes), estimator.calibrated, engine.lp_bytes, footprint=fp)
            result.extra.update(floor_s=t_floor, r_star=r_star, calibrated_rates=estimator.calibrated.to_dict(),
                                update_elements=sum(engine.sizes), lp_bytes=engine.lp_bytes)  # fmt: skip
    return result


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _around(extra: dict[str, Any]) -> str:
    windows = extra["drive_steps"]
    if len(windows) > 1:
        reads = [bps / GB for w in windows for bps in w["read_bps_around"]]
        return (
            f"{extra['mixed_gbs']:.2f} GB/s reading and writing at once, medians; the drive measured before each "
            f"measured step and after the last, each step's floor at the mean of the two around it; reads from "
            f"{min(reads):.2f} to {max(reads):.2f} GB/s"
        )
    before, after = extra["read_gbs_around"]
    return (
        f"{extra['mixed_gbs']:.2f} GB/s reading and writing at once; the drive measured right before the measured "
        f"steps and right after, the mean of the two; reads {before:.2f} and {after:.2f} GB/s"
    )


def table(results: list[Result]) -> str:
    ran = [r for r in results if "unavailable" not in r.extra]
    by_name = {r.system: r for r in ran}
    stock = by_name.get("stock")
    twinflows = [r for r in ran if r.system.startswith("twinflow:")]
    best_tf = min(twinflows, key=lambda r: r.update_s) if twinflows else None
    floor_s = next((r.extra["floor_s"] for r in results if "floor_s" in r.extra), None)
    head = (
        "| system | fwd s | bwd s | update s | iter s | update Mparam/s | H2D GB/s | D2H GB/s | device share "
        "| peak acc GB | opt host GB | update vs stock | iter vs stock | update vs best TwinFlow | update / floor |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in results:
        if "unavailable" in r.extra:
            lines.append(f"| {r.system} | not run here: {r.extra['unavailable']} |" + " |" * 13)
            continue
        vs_stock = stock.update_s / r.update_s if stock else None
        it_stock = stock.step_s / r.step_s if stock else None
        vs_tf = best_tf.update_s / r.update_s if best_tf else None
        engine_s = r.extra.get("engine_update_s")
        over_floor = engine_s / floor_s if floor_s and engine_s else None
        if "disk_floor_s" in r.extra:  # NVMe offload: each step over the drive's floor around it, the median
            over_floor = r.extra["update_over_floor"]
        lines.append(
            f"| {r.system} | {_fmt(r.forward_s)} | {_fmt(r.backward_s)} | {_fmt(r.update_s)} | {_fmt(r.step_s)} "
            f"| {r.update_params_per_s / 1e6:.1f} | {_fmt(r.h2d_gbps, 2)} | {_fmt(r.d2h_gbps, 2)} "
            f"| {_fmt(r.device_share, 2)} | {_fmt(r.peak_accelerator_gb, 2)} | {_fmt(r.optimizer_host_gb, 3)} "
            f"| {_ratio(vs_stock)} | {_ratio(it_stock)} | {_ratio(vs_tf)} | {_fmt(over_floor, 2)} |"
        )
    if floor_s:
        lines.append(
            f"\nFloor T(r*) of the update phase from the calibrated rates (not the planner's corrected ones): "
            f"{floor_s:.4f} s; update / floor is the engine's update loop over it."
        )
    lines.append("\n" + prediction_table(ran))
    for r in results:  # what speculation costs: the spare slots (in opt host GB) and the commits after backward
        if r.extra.get("spare_gb"):
            commit_s, rate = r.extra.get("commit_s"), r.extra.get("commit_rate")
            commits = "no step committed" if commit_s is None else f"commits took {commit_s * 1e3:.2f} ms a step"
            lines.append(
                f"Speculation of {r.system}: {r.extra['spare_gb']:.3f} GB of spare host slots (in opt host GB); "
                f"{commits} (median over committed steps, after backward), commit rate {_fmt(rate, 2)}."
            )
    if any("disk_floor_s" in r.extra for r in results):
        lines.append(
            "\nNVMe systems' update / floor: the median update over the drive's floor for a step's bytes, the lesser "
            "of (bytes read / read bandwidth) + (bytes written / write bandwidth) and (bytes read and written) / "
            "(bandwidth reading and writing at once), the drive measured right before the measured steps and right "
            "after (the mean of the two; with --drive-each-step, around each step, each step over its own floor)."
        )
    stock_nvme = next((r for r in results if r.system.startswith("stock-nvme:")), None)
    for r in results:
        if "disk_floor_s" in r.extra and r.system.startswith("nvme:"):
            e = r.extra
            versus = f", {stock_nvme.update_s / r.update_s:.2f}x stock NVMe's update" if stock_nvme else ""
            if versus and not r.system.endswith("@off"):  # overlapped: the update column is what is left exposed
                versus += " (its exposed update: the rest overlaps backward and the next forward; compare iterations)"
            lines.append(
                f"Drive floor of {r.system}: {e['disk_floor_s']:.3f} s (of {e['state_gb']:.3f} GB of file-backed "
                f"optimizer state, {e['read_gb_per_step']:.3f} GB read and {e['written_gb_per_step']:.3f} GB written "
                f"per measured step, at {e['read_gbs']:.2f} / {e['write_gbs']:.2f} GB/s, {_around(e)}){versus}."
            )
        elif "disk_floor_s" in r.extra:
            e = r.extra
            lines.append(
                f"Drive floor of {r.system}: {e['disk_floor_s']:.3f} s ({e['state_gb']:.3f} GB of optimizer state read "
                f"and written per step, the gradient read too, at {e['read_gbs']:.2f} / {e['write_gbs']:.2f} GB/s, "
                f"{_around(e)}); the performance model predicted {r.predicted_update_s:.3f} s for its update."
            )
    if best_tf:
        lines.append(f"Best TwinFlow ratio here: {best_tf.system}.")
    lines.extend(peers.versus_best_peer(ran))
    norms = {r.system: r.extra["last_grad_norm"] for r in results if "last_grad_norm" in r.extra}
    if norms:
        lines.append("Last step's global gradient norm (before clipping): " + ", ".join(
            f"{name} {norm:.3g}" for name, norm in norms.items()) + ".")  # fmt: skip
    return "\n".join(lines)


def rounds_table(rounds: list[list[Result]]) -> str:
    """Each system's update over the rounds (median, least, most), and the median of its per-round ratios: against
    stock offload or stock NVMe offload of the same round (the same stretch of a drifting drive), and against the
    drive's floor where it has one."""
    lines = [
        "| system | update s (median) | least | most | vs stock, per round | vs stock (median) "
        "| update / floor, per round | update / floor (median) |",
        "|" + "---|" * 8,
    ]
    for k, system in enumerate(r.system for r in rounds[0]):
        updates = [results[k].update_s for results in rounds]
        ratios, floors = [], []
        for results in rounds:
            reference = next((r for r in results if r.system == "stock" or r.system.startswith("stock-nvme:")), None)
            if reference is not None and reference is not results[k]:
                ratios.append(reference.update_s / results[k].update_s)
            if results[k].extra.get("update_over_floor") is not None:
                floors.append(results[k].extra["update_over_floor"])
        lines.append(
            f"| {system} | {statistics.median(updates):.3f} | {min(updates):.3f} | {max(updates):.3f} "
            f"| {' '.join(f'{x:.2f}x' for x in ratios) or 'n/a'} "
            f"| {_ratio(statistics.median(ratios) if ratios else None)} "
            f"| {' '.join(f'{x:.2f}' for x in floors) or 'n/a'} "
            f"| {_fmt(statistics.median(floors) if floors else None, 2)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model shape (default: sized for this machine)")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="steps per system before measuring")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help="comma-separated: stock, stock-nvme:DIR (stock-nvme:DIR:N: its swapper with N tensor buffers, default "
        "16), twinflow:R, stride:K, a fraction, auto; ours take @off, @forward "
        "or @auto "
        "(overlap; default auto), e.g. auto@off",
    )
    parser.add_argument("--sub-group-size", type=int, help="elements per sub-group (default: ~1/16 of the model)")
    parser.add_argument("--precision", help="default: bf16-mixed on a GPU, 32-true on CPU")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--clip", type=float, help="gradient clipping by global norm (default: none)")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes to load")
    parser.add_argument("--out", type=Path, help="JSON output (default: bench/out/<time>.json)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems this many times, each round starting one system later (a shared drive's bandwidth "
        "drifts from minute to minute: rounds put each system beside the others' in every stretch of it), and "
        "print each round and their medians",
    )
    parser.add_argument(
        "--aio",
        metavar="BLOCK,DEPTH,THREADS",
        help="DeepSpeed's async I/O settings for both NVMe systems and the drive's floor: block size in bytes, "
        "requests in flight, threads per request (default: 1048576,32,2)",
    )
    parser.add_argument(
        "--drive-each-step",
        action="store_true",
        help="measure the drive of an NVMe system before every measured step, not only around them all, and set "
        "each step's update beside the floor of its own second (a shared drive drifts within a minute; this writes "
        "and reads a few hundred MB between two steps)",
    )
    parser.add_argument(
        "--drive-warmup",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="before the first system runs, read and write the NVMe systems' drives this long (default 20; 0: not "
        "at all): a shared virtual disk may serve its first seconds after a rest at several times its sustained rate "
        "(this project's CPU machine: 2.9 GB/s, then about 1 GB/s within 10 s), which would go to whichever system "
        "runs first",
    )
    parser.add_argument(
        "--no-prime",
        dest="prime",
        action="store_false",
        help="with NVMe systems, do not run the unmeasured fit of the first of them that comes before the first round "
        "otherwise: on this project's CPU machine the first fit of a run, whichever system, met its drive at about "
        "twice the rate of every fit after it (bench/RESULTS.md, 2026-11-28), an advantage the drive warm-up and a "
        "rest do not take away",
    )
    parser.add_argument(
        "--exactness",
        action="store_true",
        help="beside the times, each system's loss and distance from stock offload's weights (exact AdamW; stock "
        "runs first) after the measured steps, its skipped steps, and what one injected non-finite batch does to it "
        "(two more steps; bench/peers.py)",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run every system in a process of its own (the peers superoffload:R, zenflow:K:S and fsdp-offload "
        "always do), with its peak host memory",
    )
    parser.add_argument(
        "--system-timeout", type=float, default=1800.0, metavar="SECONDS",
        help="a system run in its own process that has not finished by then is a row saying so (default 1800)",
    )  # fmt: skip
    parser.add_argument(
        "--steps-jsonl", type=Path, metavar="PATH",
        help="append one JSON line per step of every system to PATH (bench/steps.py: every dos/* metric, the plan, "
        "the planner's predictions and rates, phases, need and landing times; the engine's spans on every step), "
        "for bench/fit.py",
    )  # fmt: skip
    parser.add_argument(
        "--trace-dir", type=Path, metavar="DIR",
        help="a Chrome/Perfetto trace of the first two measured steps of each system in DIR/<system>_clip-<clip>/",
    )  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run this system only and write its result (a child)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    systems = [system.strip() for system in args.systems.split(",") if system.strip()]
    if args.exactness and args.one is None and ("stock" not in systems or args.rounds != 1):
        parser.error("--exactness measures every system against stock offload's run: name stock among --systems, "
                     f"and one round (got --systems {args.systems} --rounds {args.rounds})")  # fmt: skip
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not args.drive_warmup >= 0:
        parser.error(f"--drive-warmup takes seconds, 0 or more; got {args.drive_warmup}")
    if args.aio:
        try:
            block, depth, threads = (int(v) for v in args.aio.split(","))
        except ValueError:
            parser.error(f"--aio takes BLOCK,DEPTH,THREADS as three integers, e.g. 1048576,32,2; got {args.aio!r}")
        AIO.update(block_size=block, queue_depth=depth, intra_op_parallelism=threads)
    gpu = torch.cuda.is_available()
    preset = args.preset or ("1b" if gpu else "small")
    shape = list(PRESETS[preset])
    for i, name in enumerate(("n_layer", "n_embd", "n_head", "seq", "batch")):
        if getattr(args, name) is not None:
            shape[i] = getattr(args, name)
    args.shape = tuple(shape)
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    params = GPT.count_parameters(shape[0], shape[1], args.vocab, shape[3])
    args.sub_group_size = args.sub_group_size or max(1024, params // 16)
    args.out = args.out or ROOT / "bench" / "out" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    # The systems run in processes of their own keep their logs and results here.
    args.workdir = args.out.parent / f"{args.out.stem}-systems"
    # The reference weights (the model's fp32 weights, twice) go to a temporary folder, never among the logs.
    args.reference = args.reference or Path(tempfile.gettempdir()) / f"{args.out.stem}-exact-{os.getpid()}"
    return args


def run_one(args: argparse.Namespace) -> int:
    """In a process of its own: run ``--one`` and write its result (or why it could not run) to ``--result``."""
    try:
        result = run_system(args.one, args)
    except Exception as error:  # noqa: BLE001 - any failure is the row's reason, in one line
        traceback.print_exc()  # the whole of it in the system's log
        peers.write_child_result(args.result, None, error)
        return 0
    result.peak_host_gb = peers.peak_host_gb()
    peers.write_child_result(args.result, asdict(result), None)
    return 0


def run_any(system: str, args: argparse.Namespace) -> Result:
    """``system`` run here, or in a process of its own (a peer, or ``--isolate``); a row saying why if it cannot."""
    if not (args.isolate or peers.is_peer(system)):
        return run_system(system, args)
    argv = [*args.argv, "--reference", str(args.reference)]
    found = peers.run_isolated(system, argv, args.workdir, args.system_timeout)
    if "unavailable" not in found:
        return Result(**found)
    nan = float("nan")
    return Result(system, nan, nan, nan, nan, 0, nan, extra={"unavailable": found["unavailable"]})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        return run_one(args)
    device = _device_name(args)
    layers, width, heads, seq, batch = args.shape
    params = GPT.count_parameters(layers, width, args.vocab, seq)
    print(
        f"# {device}: GPT {layers}x{width} ({params / 1e6:.1f}M params), seq {seq}, batch {batch}, "
        f"{args.precision}, clip {args.clip}, sub_group_size {args.sub_group_size}, {args.warmup}+{args.steps} steps"
    )
    systems = [system.strip() for system in args.systems.split(",") if system.strip()]
    if not args.prime and args.rounds < len(systems) and any(_drive_of(system, params)[0] for system in systems):
        print(
            f"# --rounds {args.rounds} for {len(systems)} systems: not every system runs first in a round, and on a "
            f"shared drive the first can run faster (bench/RESULTS.md, 2026-11-28); --rounds {len(systems)} gives "
            "each the first slot once"
        )
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.exactness:
        args.reference.mkdir(parents=True, exist_ok=True)
    warm_drives(systems, params, args.drive_warmup)
    if args.prime:
        prime(systems, params, args)
    rounds: list[list[Result]] = []
    for k in range(args.rounds):
        order = systems[k % len(systems) :] + systems[: k % len(systems)]
        if args.exactness:  # stock's run is the reference the others are measured against
            order = ["stock", *(system for system in order if system != "stock")]
        by_name = {r.system: r for r in (run_any(system, args) for system in order)}
        rounds.append([by_name[system] for system in systems])
        if args.rounds > 1:
            print(f"\n## Round {k + 1} of {args.rounds} (run in the order {', '.join(order)})\n")
        print(table(rounds[-1]))
        if args.exactness:
            print(f"\nAfter {args.warmup + args.steps} steps on the same batches, against stock offload's run; then "
                  "one batch whose loss is infinite and one finite batch:\n")  # fmt: skip
            print(peers.exactness_table(rounds[-1]))
    shutil.rmtree(args.reference, ignore_errors=True)  # weights: the size of the model's fp32 state, twice
    results = rounds[-1]
    if args.rounds > 1:
        print("\n## Over the rounds\n")
        print(rounds_table(rounds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device,
        "shape": args.shape,
        "precision": args.precision,
        "clip": args.clip,
        "aio": dict(AIO),
        "params": params,
        "results": [asdict(r) for r in results],
        "rounds": [[asdict(r) for r in results] for results in rounds],
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
