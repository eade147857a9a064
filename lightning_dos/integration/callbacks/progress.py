"""A rich progress bar for offloaded training: loss, tokens/s and the device's share of the update, on one line
at the console's width (80 columns in a default terminal or a log file)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from rich.cells import cell_len
from rich.measure import Measurement
from rich.progress import ProgressColumn, Task
from rich.style import Style
from rich.text import Text

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
    """Lightning's rich progress bar kept to one line at the console's width: loss (``loss``, ``val``), tokens/s
    and the share of the update done on the device (``dev``, shown with an accelerator or when above 0%).

    Phase times, PCIe rates and memory belong to :class:`~lightning_dos.integration.callbacks.DOSMonitor`'s end-of-fit
    table and the logs. Tokens per step come from the ``train/tokens_per_step`` metric the model logs (the
    recipe ``GPT`` does), or else from the size of the batch's first tensor; tokens/s is a running average
    over the wall time between training batches (validation time is left out) times the number of
    processes. The device share is read from ``trainer.callback_metrics`` when present there, else from the
    latest step of a :class:`~lightning_dos.integration.callbacks.DOSMonitor`.

    The line fits the console (rich takes its width from the terminal, or ``COLUMNS``, or 80 in a pipe or a
    log file): Lightning's it/s column is left out (tokens/s says more); below 100 columns the time column
    shows only what is left (``eta``) while running and the time taken once done; the bar itself shrinks (to
    no less than :data:`MIN_BAR_WIDTH`) when the metrics need the room; and if they still do not fit, the
    least useful items are dropped (other metrics first, then ``dev``, ``tok/s``, ``val``; never ``loss``).

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

    def _init_progress(self, trainer: L.Trainer) -> None:
        super()._init_progress(trainer)
        # Outside fit Lightning's metrics column is always empty, yet the space before it and its own padding
        # stay: validate's last frame, left in a log file, would end in two spaces.
        if self.progress is not None and trainer.state.fn != "fit":
            self.progress.columns = tuple(c for c in self.progress.columns if c is not self._metric_component)

    def configure_columns(self, trainer: L.Trainer) -> list:
        # No it/s (tok/s says more); below WIDE_CONSOLE columns one time instead of two; the bar is sized
        # (and shrunk further if need be) by _fit_to_width once the metrics are known.
        from lightning.pytorch.callbacks.progress.rich_progress import CustomTimeColumn, ProcessingSpeedColumn

        narrow = self._console is not None and self._console.width < WIDE_CONSOLE
        columns = []
        for column in super().configure_columns(trainer):
            if isinstance(column, ProcessingSpeedColumn):
                continue
            if narrow and isinstance(column, CustomTimeColumn):
                column = CompactTimeColumn(style=self.theme.time)
            if hasattr(column, "bar_width"):
                column.bar_width = BAR_WIDTH
            columns.append(column)
        return columns

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: in the log folder's name already
        items.pop("train/tokens_per_step", None)
        for long, short in SHORT_NAMES.items():
            if long in items:
                items[short] = items.pop(long)
        if self._tokens_per_s is not None:
            items["tok/s"] = _compact(self._tokens_per_s)
        on_accelerator = trainer.strategy.root_device.type != "cpu"
        items.update(format_dos_metrics(dos_metrics(trainer), show_zero_share=on_accelerator))
        return self._fit_to_width(items)

    def _fit_to_width(self, items: dict[str, Any]) -> dict[str, Any]:
        """Shrink the bar, then drop items, until the training line fits the console's width."""
        progress, console = self.progress, self._console
        tasks = [] if progress is None else [t for t in progress.tasks if t.id == self.train_progress_bar_id]
        if not tasks or console is None:
            return items
        bar, used = None, len(progress.columns) - 1  # one space between columns
        for column in progress.columns:
            if hasattr(column, "bar_width"):
                bar = column
            elif column is not self._metric_component:
                used += Measurement.get(console, console.options, column.render(tasks[0])).maximum
        room = console.width - used - (0 if bar is None else 1 + MIN_BAR_WIDTH)
        for name in _drop_order(items):
            if self._metrics_width(items) <= room:
                break
            del items[name]
        if bar is not None:  # only ever shrinks, so that the bar does not jump as the metrics' widths change
            bar.bar_width = max(MIN_BAR_WIDTH, min(bar.bar_width, room + MIN_BAR_WIDTH - self._metrics_width(items)))
        return items

    def _metrics_width(self, items: Mapping[str, Any]) -> int:
        """Columns the metrics take as Lightning's metrics column writes them."""
        texts = []
        for name, value in items.items():
            if not isinstance(value, str):
                try:
                    value = f"{value:{self.theme.metrics_format}}"
                except (TypeError, ValueError):
                    value = str(value)
            texts.append(f"{name}: {value}")
        return cell_len(self.theme.metrics_text_delimiter.join(texts))


#: Progress-bar names of the metrics the recipe logs with ``prog_bar=True`` (others keep their own names).
SHORT_NAMES = {"train/loss": "loss", "val/loss": "val"}
#: Width of the bar itself, in columns, where there is room.
BAR_WIDTH = 12
#: The narrowest the bar gets before progress-bar items are dropped.
MIN_BAR_WIDTH = 4
#: Consoles at least this wide show elapsed and remaining time; narrower ones only one of them.
WIDE_CONSOLE = 100
#: Items the bar drops first when the line does not fit (names not listed here go before these).
DROP_LAST = ("val", "tok/s", "dev")


def _drop_order(items: Mapping[str, Any]) -> list[str]:
    """Names to drop, first to last, to make room: other metrics (newest first), then dev, tok/s, val; never loss."""
    others = [name for name in items if name not in DROP_LAST and name != "loss"]
    return [*reversed(others), *(name for name in reversed(DROP_LAST) if name in items)]


class CompactTimeColumn(ProgressColumn):
    """One time instead of Lightning's two (elapsed and remaining): ``eta H:MM:SS`` while running, the time
    taken once done.

    Args:
        style: rich style of the text.
    """

    max_refresh = 0.5  # as Lightning's time column: at most twice a second, to prevent jitter

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text(str(timedelta(seconds=int(task.finished_time or 0))), style=self.style)
        left = task.time_remaining
        return Text("eta " + ("-:--:--" if left is None else str(timedelta(seconds=int(left)))), style=self.style)


def _compact(value: float) -> str:
    """``29576`` -> ``29.6k``: three significant figures and a k/M suffix."""
    for factor, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def format_dos_metrics(metrics: Mapping[str, float], show_zero_share: bool = True) -> dict[str, str]:
    """The progress-bar item for the ``dos/*`` metrics in ``metrics``: the device's share of the update.

    Phase times, PCIe rates and memory are in the monitor's end-of-fit table and in the logs; the bar keeps
    to one line. ``show_zero_share=False`` leaves out a 0% share (a run without an accelerator).
    """
    share = metrics.get("dos/gpu_fraction")
    if share is None or (share == 0 and not show_zero_share):
        return {}
    return {"dev": f"{share:.0%}"}


def dos_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The latest ``dos/*`` values the bar shows: from ``trainer.callback_metrics``, else the monitor's last step,
    else the engine's last finished step."""
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
    report = getattr(getattr(trainer.strategy, "dos_engine", None), "last_report", None)
    if "dos/gpu_fraction" not in found and report is not None:
        # No row yet (an overlapped update's row is logged once it is over): the engine's last finished step.
        found["dos/gpu_fraction"] = report.device_share
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
    """Tokens of this process's batch: the logged ``train/tokens_per_step``, else the size of the first tensor."""
    logged = _number(trainer.callback_metrics.get("train/tokens_per_step"))
    if logged is not None:
        return logged
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return float(first.numel()) if hasattr(first, "numel") else None


def _latest_monitor_row(trainer: L.Trainer) -> dict[str, float] | None:
    try:
        from lightning_dos.integration.callbacks.monitor import DOSMonitor
    except ImportError:  # the monitor is optional for the bar
        return None
    for callback in trainer.callbacks:
        if isinstance(callback, DOSMonitor) and callback.history:
            return callback.history[-1]
    return None
