"""The ``lightning-dos`` command: LightningCLI for fit/validate/test/predict, plus calibrate, plan and report.

lightning-dos fit --config recipes/gpt-tiny.yaml
lightning-dos calibrate --out profile.yaml     # measure this machine's rates
lightning-dos plan --recipe recipes/gpt-7b.yaml --profile paper-h100x4
lightning-dos report runs/gpt-tiny             # PNG of a run's metrics
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lightning_dos  # noqa: F401 - registers the strategy name "dos"
from lightning_dos.callbacks import DOSMonitor, DOSProgressBar
from lightning_dos.data import ByteCorpusDataModule
from lightning_dos.recipes.gpt import GPT
from lightning_dos.strategy import DOSConfigError

DESCRIPTION = "Train with Deep Optimizer States (DeepSpeed ZeRO-3 offload, interleaved CPU/GPU updates)."

#: Subcommands that are not LightningCLI's: name -> (module, what it does).
EXTRA_COMMANDS = {
    "calibrate": ("lightning_dos.planner", "measure this machine's CPU/GPU/PCIe rates and write a profile"),
    "plan": ("lightning_dos.planner", "predict update and iteration time of each offload scheme for a model"),
    "report": ("lightning_dos.report", "draw a run's logged metrics (memory, PCIe, phase split) as a PNG"),
}


class SettingError(ValueError):
    """A setting given on the command line or in a recipe was refused while building the run."""


class DOSCLI(LightningCLI):
    """LightningCLI with the recipe GPT and byte corpus as defaults, the DOS monitor and progress bar on,
    and CSV (plus TensorBoard, when installed) logs under ``trainer.default_root_dir``."""

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
        for callback in callbacks:
            # A recipe's checkpoints go beside its logs, so that `--ckpt_path ROOT/checkpoints/last.ckpt` finds them.
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(Path(root) / "checkpoints")
        config["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


def _print_extra_commands() -> None:
    print("lightning-dos: Deep Optimizer States for PyTorch Lightning\n")
    print(
        "training (LightningCLI): fit, validate, test, predict   e.g. lightning-dos fit --config recipes/gpt-tiny.yaml"
    )
    for name, (_, what) in EXTRA_COMMANDS.items():
        print(f"  {name:<10} {what}   (lightning-dos {name} --help)")
    print()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTRA_COMMANDS:
        module_name = EXTRA_COMMANDS[argv[0]][0]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            print(
                f"lightning-dos {argv[0]} is unavailable: its module {module_name} cannot be imported ({error})",
                file=sys.stderr,
            )
            return 2
        rest = argv if module_name.endswith("planner") else argv[1:]
        try:
            return int(module.main(rest) or 0)
        except SystemExit as done:  # argparse's --help and usage errors
            return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    if not argv or argv[0] in ("-h", "--help"):
        _print_extra_commands()
    try:
        DOSCLI(
            GPT,
            ByteCorpusDataModule,
            args=None if from_command_line else argv,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": "lightning-dos",
                "description": DESCRIPTION,
                **({"parser_mode": "omegaconf"} if _has_omegaconf() else {}),
            },
        )
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    except (SettingError, DOSConfigError) as error:
        # A refused setting is one line naming it, not a traceback through Lightning.
        print(f"lightning-dos: error: {error}", file=sys.stderr)
        return 2
    return 0


def _has_omegaconf() -> bool:
    try:
        importlib.import_module("omegaconf")
    except ImportError:
        return False
    return True
