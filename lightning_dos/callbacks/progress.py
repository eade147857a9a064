"""A rich progress bar that shows what an offloaded step is doing: tokens/s, the phase split, PCIe."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

#: The DOS metrics the bar shows, when some callback (normally ``DOSMonitor``) provides them.
DOS_KEYS = (
    "dos/step_s",
    "dos/forward_s",
    "dos/backward_s",
    "dos/update_s",
    "dos/gpu_fraction",
    "dos/h2d_gbps",
    "dos/d2h_gbps",
)


class DOSProgressBar(RichProgressBar):
    """Lightning's rich progress bar, plus tokens/s and, when they are available, the step time with its
    forward/backward/update split, the device share of the update and PCIe GB/s per direction.

    Tokens per step come from the ``train/tokens`` metric the model logs (the recipe ``GPT`` does), or else
    from the size of the batch's first tensor; tokens/s is a running average over the wall time between
    training batches (validation time is left out) times the number of processes. The ``dos/*`` metrics are
    read from ``trainer.callback_metrics`` when present there, else from the latest step of a
    :class:`~lightning_dos.callbacks.DOSMonitor`; each item is shown only when its metric exists.

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

    # -- timing ------------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._last = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._last is not None:  # validation inside the training loop: do not count its time
            self._last = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        tokens = _step_tokens(trainer, batch)
        if self._last is not None and tokens is not None:
            rate = tokens * trainer.world_size / max(now - self._last, 1e-9)
            prev = self._tokens_per_s
            self._tokens_per_s = rate if prev is None else prev + self.smoothing * (rate - prev)
        self._last = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @property
    def tokens_per_second(self) -> float | None:
        """The running tokens/s over all processes, or None before the first timed batch."""
        return self._tokens_per_s

    # -- display -----------------------------------------------------------------------------------

    def _get_train_description(self, current_epoch: int) -> str:
        # Step-limited runs have no last epoch (max_epochs=-1): show "Epoch N", not "Epoch N/-2".
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("train/tokens", None)
        if self._tokens_per_s is not None:
            items["tok/s"] = f"{self._tokens_per_s:,.0f}"
        items.update(format_dos_metrics(dos_metrics(trainer)))
        return items


def format_dos_metrics(metrics: Mapping[str, float]) -> dict[str, str]:
    """The compact progress-bar items for the ``dos/*`` metrics present in ``metrics`` (none when absent)."""
    items: dict[str, str] = {}
    if "dos/step_s" in metrics:
        items["step"] = f"{metrics['dos/step_s']:.2f}s"
    phases = [metrics.get(f"dos/{p}_s") for p in ("forward", "backward", "update")]
    if all(v is not None for v in phases):
        items["f/b/u"] = "/".join(f"{v:.2f}" for v in phases)
    elif phases[2] is not None:
        items["update"] = f"{phases[2]:.2f}s"
    if "dos/gpu_fraction" in metrics:
        items["device"] = f"{metrics['dos/gpu_fraction']:.0%}"
    if "dos/h2d_gbps" in metrics or "dos/d2h_gbps" in metrics:
        up, down = metrics.get("dos/h2d_gbps"), metrics.get("dos/d2h_gbps")
        items["PCIe"] = (
            " ".join(f"{arrow}{value:.1f}" for arrow, value in (("↑", up), ("↓", down)) if value is not None) + " GB/s"
        )
    return items


def dos_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The latest ``dos/*`` values the bar shows: from ``trainer.callback_metrics``, else the monitor's last step."""
    found: dict[str, float] = {}
    for key in DOS_KEYS:
        value = _number(trainer.callback_metrics.get(key))
        if value is not None:
            found[key] = value
    if found:
        return found
    row = _latest_monitor_row(trainer) or {}
    for key in DOS_KEYS:
        value = _number(row.get(key))
        if value is not None:
            found[key] = value
    return found


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def _step_tokens(trainer: L.Trainer, batch: Any) -> float | None:
    """Tokens of this process's batch: the logged ``train/tokens``, else the size of the first tensor."""
    logged = _number(trainer.callback_metrics.get("train/tokens"))
    if logged is not None:
        return logged
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return float(first.numel()) if hasattr(first, "numel") else None


def _latest_monitor_row(trainer: L.Trainer) -> dict[str, float] | None:
    try:
        from lightning_dos.callbacks.monitor import DOSMonitor
    except ImportError:  # the monitor is optional for the bar
        return None
    for callback in trainer.callbacks:
        if isinstance(callback, DOSMonitor) and callback.history:
            return callback.history[-1]
    return None
