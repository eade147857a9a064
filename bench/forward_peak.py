"""The next forward's peak GPU memory with the update overlapping it, against ``overlap="off"`` (a CUDA GPU).

With ``overlap="forward"`` or ``"auto"`` the update runs beside the next forward; its device side is launched first
and its staging buffers go back to torch's caching allocator as soon as its last download is issued, and they are
sized within what was spare at the last forward/backward peak. So the forward's peak must not be above what it is
with ``overlap="off"`` (where the update is over before the forward starts), and the engine must hold nothing on
the GPU once the host side is all that is left. Default settings otherwise (``gpu_fraction="auto"``, no
``gpu_memory_budget``), a small MLP-shaped LM in bf16-mixed, a few steps, each mode in a process of its own.

For every step after the first: the forward's peak (``torch.cuda.max_memory_allocated`` from the batch's start to
the start of backward) and what was allocated at the batch's start. Exits 1 if a mode's largest forward peak is
above ``overlap="off"``'s by more than ``--slack`` bytes.

    python bench/forward_peak.py                   # about a minute per mode on one H100
    python bench/forward_peak.py --width 1024 --steps 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dos.model.overlap import MODES  # noqa: E402


def run_mode(args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dos import DeepOptimizerStatesStrategy

    class MLPLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(args.vocab, args.width)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(
                    torch.nn.LayerNorm(args.width),
                    torch.nn.Linear(args.width, 4 * args.width),
                    torch.nn.GELU(),
                    torch.nn.Linear(4 * args.width, args.width),
                )
                for _ in range(args.layers)
            )
            self.head = torch.nn.Linear(args.width, args.vocab)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            h = self.embed(x)
            for block in self.blocks:
                h = h + block(h)
            return torch.nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class ForwardPeak(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()

        def on_before_backward(self, trainer, pl_module, loss) -> None:  # noqa: ANN001
            # The strategy resets the peak as the forward begins under overlap (its own window): what it reads
            # here is the forward's peak either way.
            self.rows.append({"start_bytes": self._start, "forward_peak_bytes": torch.cuda.max_memory_allocated()})

    g = torch.Generator().manual_seed(0)
    n = args.batch * (args.steps + 1)
    x = torch.randint(0, args.vocab, (n, args.seq), generator=g)
    data = DataLoader(TensorDataset(x, (x * 7 + 3) % args.vocab), batch_size=args.batch)
    L.seed_everything(0, verbose=False)
    peak = ForwardPeak()
    trainer = L.Trainer(
        strategy=DeepOptimizerStatesStrategy(overlap=args.mode),
        accelerator="cuda",
        devices=1,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peak],
    )
    trainer.fit(MLPLM(), data)
    rows = peak.rows[1:]  # from the second batch: an update was in flight as it began
    return {
        "mode": args.mode,
        "overlap": trainer.strategy.dos_adapter.overlap,
        "max_forward_peak_bytes": max(r["forward_peak_bytes"] for r in rows),
        "max_start_bytes": max(r["start_bytes"] for r in rows),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--slack", type=int, default=2 << 20, help="bytes a forward peak may exceed off's by")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = parser.parse_args()
    if args.mode is not None:
        print("RESULT " + json.dumps(run_mode(args)))
        return 0
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode] + [
            f"--{k}={getattr(args, k)}" for k in ("width", "layers", "vocab", "seq", "batch", "steps")
        ]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            print(f"forward_peak: mode {mode} failed (exit {done.returncode})")
            return 1
        results[mode] = json.loads(lines[-1][len("RESULT ") :])
    off = results["off"]["max_forward_peak_bytes"]
    print("| overlap | runs as | forward peak (MB) | vs off (MB) | allocated at batch start (MB) |")
    print("|---|---|---|---|---|")
    worst = 0
    for mode, r in results.items():
        excess = r["max_forward_peak_bytes"] - off
        worst = max(worst, excess)
        print(
            f"| {mode} | {r['overlap']} | {r['max_forward_peak_bytes'] / 1e6:.1f} | {excess / 1e6:+.1f} | "
            f"{r['max_start_bytes'] / 1e6:.1f} |"
        )
    verdict = "above" if worst > args.slack else "within"
    print(
        f"# forward peak with overlap {verdict} off's (+{args.slack / 1e6:.1f} MB slack): worst {worst / 1e6:+.1f} MB"
    )
    return 1 if worst > args.slack else 0


if __name__ == "__main__":
    sys.exit(main())
