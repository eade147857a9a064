"""The options ``lightning-dos plan`` and ``lightning-dos simulate`` share, declared once: the model (``--params`` or
``--recipe``), the node (``--profile``, ``--gpus-per-node``), how the strategy cuts and places it
(``--sub-group-size``, ``--budget``), the optimizer and its dtypes, the phases (``--forward-s``, ``--backward-s``)
and ``--json``. Defaults are the strategy's, so both commands describe what a default run does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from lightning_dos.model.iteration import Speculation, speculation_of
from lightning_dos.model.plan import auto_sub_group_size
from lightning_dos.model.update_rules import OPTIMIZER_RULES, Footprint


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Every option the two commands share (see the module's docstring)."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="model parameters, e.g. 20e9")
    model.add_argument("--recipe", help="a recipe YAML (its model's parameters are counted)")
    parser.add_argument("--profile", default="paper-h100x4", help="a named profile or a profile file")
    parser.add_argument(
        "--gpus-per-node", type=int, help="ranks the model is partitioned over (default: the profile's)"
    )
    parser.add_argument(
        "--sub-group-size", default="auto", help="elements per sub-group, or auto (as the strategy sizes them)"
    )
    parser.add_argument("--lp-bytes", type=int, default=2, choices=(2, 4), help="bytes per model parameter")
    add_footprint_options(parser)
    parser.add_argument(
        "--budget",
        type=float,
        help="device bytes per rank spare at the forward/backward peak, as the strategy's gpu_memory_budget: "
        "resident state (TwinFlow, ours) and the update's buffers must fit in it. Default: what the strategy "
        "does without one, nothing resident and the update's buffers in the profile's free memory after "
        "backward, less 10%%",
    )
    parser.add_argument("--forward-s", type=float, help="forward seconds per iteration and rank: time the iteration")
    parser.add_argument("--backward-s", type=float, help="backward seconds per iteration and rank (with --forward-s)")
    parser.add_argument(
        "--commit-rate",
        type=float,
        default=1.0,
        help="under overlap 'auto' (whose updates begun during backward are speculative): the share of steps "
        "neither clipped nor skipped, whose speculative updates are kept (default 1.0)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def sub_group_size_of(value: str | float, partition_numel: int) -> int:
    """``--sub-group-size`` for a rank's partition of ``partition_numel`` elements: ``auto`` as the strategy sizes
    sub-groups (:func:`~lightning_dos.model.plan.auto_sub_group_size`), else the number given.

    Raises ValueError naming the option when it is neither ``auto`` nor a positive number."""
    if value == "auto":
        return auto_sub_group_size(partition_numel)
    try:
        size = int(float(value))
    except (TypeError, ValueError):
        size = 0
    if size <= 0:
        raise ValueError(f"--sub-group-size must be 'auto' or a positive number, got {value!r}")
    return size


#: ``--master-dtype`` and ``--state-dtype`` choices, and their bytes per element.
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def footprint_of(optimizer: str = "adam", master_dtype: str = "fp32", state_dtype: str = "fp32") -> Footprint:
    """The bytes per element of ``optimizer`` with master weights and gradients in ``master_dtype`` and its
    states in ``state_dtype``, as ``plan`` and ``simulate`` take them.

    Raises ValueError naming the option and its valid values: an unknown optimizer or dtype, or bf16 states
    with fp32 master weights (DeepSpeed requires ``bf16_master_weights_and_grads`` for ``bf16_optimizer_states``).
    """
    if optimizer not in OPTIMIZER_RULES:
        raise ValueError(f"--optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_RULES)}")
    for option, value in (("--master-dtype", master_dtype), ("--state-dtype", state_dtype)):
        if value not in DTYPE_BYTES:
            raise ValueError(f"{option} {value!r} is not one of {', '.join(DTYPE_BYTES)}")
    if state_dtype == "bf16" and master_dtype != "bf16":
        raise ValueError(
            "--state-dtype bf16 needs --master-dtype bf16 (DeepSpeed's bf16_optimizer_states requires "
            "bf16_master_weights_and_grads); valid: --master-dtype bf16 --state-dtype bf16|fp32, or "
            "--master-dtype fp32 --state-dtype fp32"
        )
    # As the strategy's engine runs: resident sub-groups' gradients are kept on the device, never uploaded.
    rule = OPTIMIZER_RULES[optimizer]
    return Footprint(rule, DTYPE_BYTES[master_dtype], DTYPE_BYTES[state_dtype], grads_on_device=True)


def add_footprint_options(parser: argparse.ArgumentParser) -> None:
    """``--optimizer``, ``--master-dtype`` and ``--state-dtype`` (validated by :func:`footprint_of`)."""
    parser.add_argument(
        "--optimizer", default="adam", help=f"the optimizer whose state is offloaded: {', '.join(OPTIMIZER_RULES)}"
    )
    parser.add_argument(
        "--master-dtype",
        default="fp32",
        help="master weights and gradients: fp32, or bf16 (DeepSpeed's bf16_master_weights_and_grads)",
    )
    parser.add_argument(
        "--state-dtype",
        default="fp32",
        help="optimizer states: fp32, or bf16 (DeepSpeed's bf16_optimizer_states; needs --master-dtype bf16)",
    )


def _footprint_options(args: argparse.Namespace) -> tuple[str, str, str]:
    """``--optimizer``, ``--master-dtype``, ``--state-dtype`` (their defaults where ``args`` lacks them)."""
    return (
        getattr(args, "optimizer", "adam"),
        getattr(args, "master_dtype", "fp32"),
        getattr(args, "state_dtype", "fp32"),
    )


def footprint_summary(args: argparse.Namespace, footprint: Footprint) -> dict[str, Any]:
    """The optimizer, its dtypes and the bytes per element they give, for ``--json``."""
    optimizer, master, state = _footprint_options(args)
    return {
        "optimizer": optimizer,
        "master_dtype": master,
        "state_dtype": state,
        "bytes_per_element": {
            "host_state": footprint.optimizer_state,
            "streamed_up": footprint.streamed_up,
            "streamed_down": footprint.streamed_down,
            "resident_up": footprint.resident_up,
            "device": footprint.device,
        },
    }


def footprint_label(args: argparse.Namespace) -> str:
    """``Adam, fp32 master and states`` and the like, for titles."""
    optimizer, master, state = _footprint_options(args)
    name = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion"}[optimizer]
    if master == state:
        return f"{name}, {master} master and states"
    return f"{name}, {master} master, {state} states"


def recipe_parameters(path: str) -> int:
    """Parameters of the model a recipe YAML describes."""
    model = (yaml.safe_load(Path(path).read_text()) or {}).get("model", {})
    args = model.get("init_args", model)
    from lightning_dos.recipes.gpt import GPT

    return GPT.count_parameters(
        int(args.get("n_layer", 4)),
        int(args.get("n_embd", 128)),
        int(args.get("vocab_size", 256)),
        int(args.get("block_size", 128)),
        bool(args.get("tie_embeddings", True)),
    )


def speculation_option(args: argparse.Namespace, footprint: Footprint) -> Speculation:
    """``--commit-rate`` as the iteration model takes it: every update ``auto`` begins during backward is speculative
    (DeepSpeed skips a step whose gradient norm is not finite; clipping may change its factor). A commit rate outside
    [0, 1] raises ValueError."""
    if not 0.0 <= args.commit_rate <= 1.0:
        raise ValueError(f"--commit-rate={args.commit_rate:g} is not valid: use a share of steps in [0, 1]")
    return speculation_of(args.commit_rate, footprint)
