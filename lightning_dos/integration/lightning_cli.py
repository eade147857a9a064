"""``DOSCLI``: LightningCLI with the recipe GPT and byte corpus as defaults, the DOS monitor and progress bar on.

Kept apart from :mod:`lightning_dos.commands.main` so that the command's help and its other subcommands do not import
Lightning and torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lightning_dos.integration.strategy  # noqa: F401 - registers the strategy name "dos"
from lightning_dos.integration.callbacks import DOSModelSummary, DOSMonitor, DOSProgressBar


class SettingError(ValueError):
    """A setting given on the command line or in a recipe was refused while building the run."""


class DOSCLI(LightningCLI):
    """LightningCLI with the recipe GPT and byte corpus as defaults, the DOS monitor, progress bar and model
    summary on, and CSV (plus TensorBoard, when installed) logs under ``trainer.default_root_dir``."""

    def instantiate_classes(self) -> None:
        # Settings are checked when the model, data and strategy are built, before any work: report a
        # refusal as one message, not a traceback through jsonargparse.
        try:
            super().instantiate_classes()
            check = getattr(self.model, "check_seq_len", None)
            if check is not None and self.datamodule is not None:
                check(getattr(self.datamodule, "seq_len", None))
        except (ValueError, TypeError, FileNotFoundError) as error:
            raise SettingError(str(error)) from error

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        root = config.get("default_root_dir") or "."
        if config.get("logger") in (None, True):
            loggers = [CSVLogger(root, name="csv")]
            try:
                from lightning.pytorch.loggers import TensorBoardLogger

                importlib.import_module("tensorboard")
                loggers.append(TensorBoardLogger(root, name="tensorboard"))
            except ImportError:
                pass
            config["logger"] = loggers
        callbacks = list(config.get("callbacks") or [])
        if not any(isinstance(c, DOSMonitor) for c in callbacks):
            callbacks.append(DOSMonitor())
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, DOSProgressBar) for c in callbacks
        ):
            callbacks.append(DOSProgressBar())
        if config.get("enable_model_summary", True) is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks
        ):
            callbacks.append(DOSModelSummary())  # Lightning's, less the columns that say nothing here
        for callback in callbacks:
            # A recipe's checkpoints go beside its logs, so that `--ckpt_path ROOT/checkpoints/last.ckpt` finds them.
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(Path(root) / "checkpoints")
        config["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)
