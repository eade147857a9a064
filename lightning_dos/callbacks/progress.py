"""A rich progress bar that shows what an offloaded step is doing: tokens/s, the phase split, PCIe."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class DOSProgressBar(RichProgressBar):
    """Lightning's rich progress bar, plus tokens/s and, when a :class:`DOSMonitor` runs, the step time
    with its forward/backward/update split, the device share and PCIe GB/s of the update.

    Args:
        smoothing: weight of the newest batch in the tokens/s running average (0 < smoothing <= 1).
        **kwargs: arguments of :class:`~lightning.pytorch.callbacks.RichProgressBar`.
    """

    def __init__(self, smoothing: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"DOSProgressBar smoothing={smoothing} is not valid; use a number in (0, 1]")
        self.smoothing = smoothing
        self._tokens_per_s: float | None = None
        self._last: float | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None and isinstance(batch, (tuple, list)) and hasattr(batch[0], "numel"):
            rate = batch[0].numel() * trainer.world_size / max(now - self._last, 1e-9)
            prev = self._tokens_per_s
            self._tokens_per_s = rate if prev is None else prev + self.smoothing * (rate - prev)
        self._last = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("train/tokens", None)
        if self._tokens_per_s is not None:
            items["tok/s"] = f"{self._tokens_per_s:,.0f}"
        row = _latest_monitor_row(trainer)
        if row:
            if "dos/step_s" in row:
                split = "/".join(f"{row.get(f'dos/{p}_s', 0.0):.2f}" for p in ("forward", "backward", "update"))
                items["step"] = f"{row['dos/step_s']:.2f}s (f/b/u {split})"
            if "dos/gpu_fraction" in row:
                items["device"] = f"{row['dos/gpu_fraction']:.0%}"
            if "dos/h2d_gbps" in row:
                items["PCIe"] = f"↑{row['dos/h2d_gbps']:.1f} ↓{row.get('dos/d2h_gbps', 0.0):.1f} GB/s"
        return items


def _latest_monitor_row(trainer: L.Trainer) -> dict[str, float] | None:
    from lightning_dos.callbacks.monitor import DOSMonitor

    for callback in trainer.callbacks:
        if isinstance(callback, DOSMonitor) and callback.history:
            return callback.history[-1]
    return None
