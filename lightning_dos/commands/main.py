"""The ``lightning-dos`` command: LightningCLI for fit/validate/test/predict, plus calibrate, plan and report.

lightning-dos fit --config recipes/gpt-tiny.yaml
lightning-dos calibrate --out profile.yaml     # measure this machine's rates
lightning-dos plan --recipe recipes/gpt-7b.yaml --profile paper-h100x4
lightning-dos report runs/gpt-tiny             # PNG of a run's metrics

Only the standard library is imported here: the help and the extra subcommands start in well under a second,
and Lightning (with torch) is imported when a training subcommand runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import textwrap
from typing import Any

DESCRIPTION = "Train with Deep Optimizer States (DeepSpeed ZeRO-3 offload, interleaved CPU/GPU updates)."

#: LightningCLI's subcommands: name -> what it does.
TRAINING_COMMANDS = {
    "fit": "train a model (lightning-dos fit --config recipes/gpt-tiny.yaml)",
    "validate": "run one evaluation epoch over the validation set",
    "test": "run one evaluation epoch over the test set",
    "predict": "run inference on your data",
}

#: Subcommands that are not LightningCLI's: name -> ("module:function" taking the arguments after the name, what
#: it does).
EXTRA_COMMANDS = {
    "calibrate": (
        "lightning_dos.commands.plan:calibrate_main",
        "measure this machine's CPU/GPU/PCIe rates and write a profile",
    ),
    "plan": ("lightning_dos.commands.plan:plan_main", "predict update and iteration time of each offload scheme"),
    "report": ("lightning_dos.commands.report:main", "draw a run's metrics (loss, LR, phase split, memory) as a PNG"),
    "simulate": (
        "lightning_dos.commands.simulate:main",
        "time the engine's schedule on a virtual node (simulated figures)",
    ),
}


def usage() -> str:
    """The top-level help: every subcommand, LightningCLI's and the extra ones (in 80 columns)."""
    commands = {**TRAINING_COMMANDS, **{name: what for name, (_, what) in EXTRA_COMMANDS.items()}}
    width = max(len(name) for name in commands)
    lines = [
        "usage: lightning-dos SUBCOMMAND [options]",
        "",
        textwrap.fill(DESCRIPTION, 80),
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {what}" for name, what in commands.items()),
        "",
        textwrap.fill(
            "lightning-dos SUBCOMMAND --help shows a subcommand's options "
            "(for fit/validate/test/predict: LightningCLI's, e.g. --config, --trainer.*, --model.*, --data.*).",
            80,
        ),
    ]
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    # DOSCLI and SettingError live with LightningCLI, imported only when asked for.
    if name in ("DOSCLI", "SettingError"):
        return getattr(importlib.import_module("lightning_dos.integration.lightning_cli"), name)
    raise AttributeError(f"module 'lightning_dos.commands.main' has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from lightning_dos.host.extensions import use_own_extensions_dir

    use_own_extensions_dir()  # DeepSpeed's ops built once per install, not rebuilt by another sharing torch's folder
    if argv[0] in EXTRA_COMMANDS:
        module_name, _, function = EXTRA_COMMANDS[argv[0]][0].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            print(
                f"lightning-dos {argv[0]} is unavailable: its module {module_name} cannot be imported ({error})",
                file=sys.stderr,
            )
            return 2
        try:
            return int(getattr(module, function)(argv[1:]) or 0)
        except SystemExit as done:  # argparse's --help and usage errors
            return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    from lightning_dos.host import quiet

    quiet.install()  # before LightningCLI builds its parser, which already imports DeepSpeed
    from lightning_dos.data import ByteCorpusDataModule
    from lightning_dos.integration.lightning_cli import DOSCLI, SettingError
    from lightning_dos.integration.strategy import DOSConfigError
    from lightning_dos.recipes.gpt import GPT

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
        # A refused setting is one message naming it, wrapped at 80 columns, not a traceback through Lightning.
        print(refusal(error), file=sys.stderr)
        return 2
    return 0


def refusal(error: Exception) -> str:
    """How the command prints a refused setting: ``lightning-dos: error:`` and the refusal, each of its lines wrapped
    at 80 columns (continued lines indented two spaces). A quoted value or a bracketed range (``'stride:K'``,
    ``[0, 1]``) is not split across lines, and a word longer than a line (a path) is kept whole."""
    from lightning_dos.host.console import wrapped

    def unbroken(match: re.Match[str]) -> str:
        return match.group().replace(" ", _NO_BREAK)

    lines = f"lightning-dos: error: {error}".splitlines()
    return "\n".join(wrapped(_KEPT_TOGETHER.sub(unbroken, line)).replace(_NO_BREAK, " ") for line in lines)


#: What a refusal's wrapping keeps on one line: a quoted value, a bracketed range (at most 20 characters each).
_KEPT_TOGETHER = re.compile(r"'[^'\n]{1,20}'|\[[^\]\n]{1,20}\]")
#: A space textwrap does not break at (it breaks only at ASCII whitespace).
_NO_BREAK = "\u00a0"


def _has_omegaconf() -> bool:
    return importlib.util.find_spec("omegaconf") is not None
