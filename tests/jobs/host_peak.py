"""Fit once in a process of its own and compare the pre-flight host figure with the host memory really added.

Usage: python tests/jobs/host_peak.py PRECISION LAYERS WIDTH OUT_JSON [SYSTEM]

SYSTEM: ``ours`` (the default: the engine, every sub-group on the host), ``sim`` (the engine on the simulated
accelerator, ``SimStreams``: its slabs registered by a registrar that faults in every page, as
``cudaHostRegister`` does, and a 16-bit staging ring) or ``stock`` (DeepSpeed's own CPU offload with
``DeepSpeedCPUAdam``).

What the pre-flight counts is the optimizer state's host memory: DeepSpeed's offload buffers and the engine's
slabs, once allocated and written (after the first steps). Measured like with like: the resident set after the
steps, with the C allocator's freed heap handed back (``malloc_trim``, as the adapter does after set-up), less
the resident set just before DeepSpeed starts allocating the optimizer's state (its fp32 partitions, the first
of them). Before that point ZeRO-3 partitions the model itself; on CPU that, the gathered parameters, the
gradients and the activations of backward are host memory too, but they are the "device" side (device memory
on a GPU) and the pre-flight does not count them. The whole run's peak over the resident set just before the
strategy allocates anything (``VmHWM`` reset there through ``/proc/self/clear_refs``) is reported beside it.

Start-up (issue 32, point 5): the peak resident set from where DeepSpeed starts allocating the optimizer's
state to the end of set-up (``on_fit_start``), less the resident set there (``VmHWM`` reset at that point, after
the run's peak so far is kept): what start-up adds at its highest, which the pre-flight figure must cover.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from lightning_dos.host.hostmem import resident_bytes, return_freed_memory  # noqa: E402
from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy  # noqa: E402
from lightning_dos.integration.preflight import deepspeed_sub_groups, figure_for  # noqa: E402
from lightning_dos.sim.simstreams import SimStreams  # noqa: E402

#: DeepSpeed's device-side buffers kept small: on CPU they are host memory the pre-flight does not count.
SMALL_DEVICE_SIDE = {
    "zero_optimization": {
        "reduce_bucket_size": 1_000_000,
        "stage3_prefetch_bucket_size": 1_000_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 2_000_000,
        "stage3_max_reuse_distance": 0,
        "sub_group_size": 3_000_000,
    }
}


class Stack(L.LightningModule):
    def __init__(self, layers: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(torch.nn.Linear(width, width, dtype=dtype) for _ in range(layers)))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x = batch[0].to(self.body[0].weight.dtype)
        return self.body(x).float().pow(2).mean()

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Baseline(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        self.rss = resident_bytes()
        self.trace: list[tuple[str, int, int]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace.append(("set up", resident_bytes() - self.rss, peak_bytes() - self.rss))
        self.startup_peak = peak_bytes()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        adapter = getattr(trainer.strategy, "dos_adapter", None)
        if adapter is not None:
            adapter.finish_update()  # held between updates: an overlapped update is over first
        self.trace.append((f"step {trainer.global_step}", resident_bytes() - self.rss, peak_bytes() - self.rss))
        return_freed_memory()
        self.held = resident_bytes()


def record_before_optimizer_state(into: dict) -> None:
    """Record the resident set where DeepSpeed starts allocating the optimizer's state (instrumentation only:
    DeepSpeed's method runs unchanged)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions

    def measured(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return_freed_memory()  # both ends count memory held, not the allocator's freed heap
        into["rss"] = resident_bytes()
        into["peak_before"] = peak_bytes()  # the run's peak so far, before start-up's is measured on its own
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS: start-up's peak from here
        return original(self, *args, **kwargs)

    Stage3._create_fp32_partitions = measured


def peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


class StockStack(Stack):
    """The same model with DeepSpeed's CPU Adam, as a user of stock ZeRO-Offload runs it."""

    def configure_optimizers(self):  # noqa: ANN201
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(self.parameters(), lr=1e-3, adamw_mode=True)


def make_strategy(system: str) -> L.pytorch.strategies.Strategy:
    if system == "stock":
        zero = {**SMALL_DEVICE_SIDE["zero_optimization"], "stage": 3}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
        return DeepSpeedCPUStrategy(config=config)
    if system == "sim":
        return DeepOptimizerStatesStrategy(gpu_fraction=0.0, config=SMALL_DEVICE_SIDE, streams_factory=SimStreams)
    if system == "ours":
        return DeepOptimizerStatesStrategy(gpu_fraction=0.0, config=SMALL_DEVICE_SIDE)
    raise SystemExit(f"unknown system {system!r}: ours, sim or stock")


def main(precision: str, layers: int, width: int, out: str, system: str = "ours") -> None:
    L.seed_everything(0, verbose=False)
    model = (StockStack if system == "stock" else Stack)(layers, width, torch.float32)
    before_state: dict = {}
    record_before_optimizer_state(before_state)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, width)), batch_size=1)
    baseline = Baseline()
    strategy = make_strategy(system)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[baseline],
    )
    trainer.fit(model, data)
    peak = max(peak_bytes(), before_state["peak_before"])
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    numels = [[int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()]]
    if system == "stock":
        # Stock has no pre-flight: the same model of DeepSpeed's buffers, with its own master weights and CPU
        # Adam's moments in place of the slabs (as bench/memory.py counts it).
        figure = figure_for(
            model,
            [{"params": list(model.parameters())}],
            strategy.config,
            world_size=1,
            on_accelerator=False,
            engine_sub_group_size="auto",
            state_owner="deepspeed",
        )
        flats = strategy.deepspeed_engine.optimizer.fp32_partitioned_groups_flat
    else:
        figure, flats = strategy.dos_host_figure, strategy.dos_adapter.flats
    result = {
        "system": system,
        "precision": precision,
        "params": params,
        "baseline": baseline.rss,
        "peak": peak,
        "peak_added": peak - baseline.rss,
        "startup_added": baseline.startup_peak - before_state["rss"],
        "state_held": baseline.held - before_state["rss"],
        "preflight": figure.total,
        # Host memory for speculative updates during backward (overlap="auto", the default), part of the figure:
        # bounded by speculation_memory ("auto": half the node's spare), on top of the optimizer state itself.
        "spare": sum(size for name, size in figure.items if name == "spare slots for speculative updates"),
        "trace": baseline.trace,
        "items": figure.items,
        "deepspeed_sub_groups": [int(f.numel()) for f in flats],
        "mirrored_sub_groups": deepspeed_sub_groups(numels, SMALL_DEVICE_SIDE["zero_optimization"]["sub_group_size"]),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
