"""``DOSCLI``: LightningCLI with the recipe GPT and byte corpus as defaults, the DOS monitor and progress bar on.

Kept apart from :mod:`lightning_dos.commands.main` so that the command's help and its other subcommands do not import
Lightning and torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy

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
            refusal = self._strategy_refusal(error)
            if refusal is not None:
                raise SettingError(str(refusal)) from refusal
            raise SettingError(str(error)) from error

    def _strategy_refusal(self, error: Exception) -> Exception | None:
        """The strategy's own refusal of its settings, when jsonargparse buried it in ``error``.

        ``trainer.strategy`` is typed ``str | Strategy``: when the strategy's constructor refuses a setting,
        jsonargparse reports that neither type of the union fits, with the refusal (one clean line from Python)
        between its list of subtypes and a dump of every init argument. Building the strategy again from the
        parsed settings gives the refusal itself; it is used only when ``error`` quotes it, so a strategy that
        fails differently outside jsonargparse never replaces the real message.
        """
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        spec = config.get("trainer.strategy") if isinstance(config, Namespace) else None
        if not isinstance(spec, Namespace) or not isinstance(spec.get("class_path"), str):
            return None
        module, _, name = spec.class_path.rpartition(".")
        try:
            strategy_class = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None
        if not (isinstance(strategy_class, type) and issubclass(strategy_class, Strategy)):
            return None
        init_args = spec.get("init_args")
        kwargs = init_args.as_dict() if isinstance(init_args, Namespace) else {}
        try:
            strategy_class(**kwargs)
        except Exception as refusal:  # noqa: BLE001 - whatever it raised is what jsonargparse quoted
            message = str(refusal)
            return refusal if message and "\n" not in message and message in str(error) else None
        return None

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
