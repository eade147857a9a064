"""A recipe's sub-groups as the strategy would cut them, in the order its model's forward needs them.

``plan`` and ``simulate --recipe`` build the recipe's model on the meta device (nothing allocated, at any size), cut
each rank's partition as ZeRO-3 and the engine do (the optimizer's param groups packed one after the other, each
parameter's share of ``1 / gpus`` in module order) and record one forward
(:class:`~lightning_dos.planning.forward_order.ForwardRecorder`), as the strategy records the first training
forward: the figures are then those of the order the engine really takes. ``--params`` alone has no model: index
order is assumed there.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from lightning_dos.model.need_order import need_order
from lightning_dos.model.plan import split_into_sub_groups
from lightning_dos.planning.forward_order import ForwardRecorder


@dataclass(frozen=True)
class RecipeLayout:
    """One rank's sub-groups of a recipe's model.

    Attributes:
        sizes: elements of each sub-group, in the engine's (index) order.
        order: the sub-groups in the order the next forward needs them (``Plan.order``).
    """

    sizes: list[int]
    order: tuple[int, ...]


def recipe_layout(path: str | Path, gpus: int, sub_group_size: int) -> RecipeLayout:
    """The sub-groups of the model ``path`` (a recipe YAML) describes, on each of ``gpus`` ranks, cut at
    ``sub_group_size`` elements, in the order its forward needs them."""
    from lightning_dos.recipes.gpt import GPT

    model_args = (yaml.safe_load(Path(path).read_text()) or {}).get("model", {})
    model_args = model_args.get("init_args", model_args)
    with torch.device("meta"):
        model = GPT(**model_args)
        model.configure_model()
    where: dict[int, tuple[int, int, int]] = {}  # parameter -> (param group, offset in the rank's flat, elements)
    numels = []
    for params in model.parameter_groups():
        offset = 0
        for param in params:
            share = math.ceil(param.numel() / gpus)  # ZeRO-3 pads each parameter to a whole share per rank
            where[id(param)] = (len(numels), offset, share)
            offset += share
        if offset:
            numels.append(offset)
    sub_groups = split_into_sub_groups(numels, list(range(len(numels))), sub_group_size)

    def sub_groups_of(params: list[torch.nn.Parameter]) -> set[int]:
        found = set()
        for param in params:
            flat, offset, numel = where[id(param)]
            found.update(
                sg.index
                for sg in sub_groups
                if sg.ds_group == flat and sg.ds_offset < offset + numel and offset < sg.ds_offset + sg.numel
            )
        return found

    recorder = ForwardRecorder(model)
    recorder.recording = True
    with torch.no_grad():
        model(torch.zeros((1, model.hparams.block_size), dtype=torch.long, device="meta"))
    recorder.remove()
    order = need_order(len(sub_groups), recorder.gathers(sub_groups_of))
    return RecipeLayout([sg.numel for sg in sub_groups], order)


def model_layout(
    args: argparse.Namespace, params: int, gpus: int, sub_group_size: int
) -> tuple[list[int], tuple[int, ...]]:
    """Per-rank sub-group sizes and the order the next forward needs them in: with ``--recipe`` (and no
    ``--params``) the recipe's model's own (:func:`recipe_layout`), else ``params`` cut evenly (as the engine cuts
    one flat partition), in index order."""
    if args.params is None and getattr(args, "recipe", None):
        layout = recipe_layout(args.recipe, gpus, sub_group_size)
        return layout.sizes, layout.order
    return [sg.numel for sg in split_into_sub_groups([params // gpus], [0], sub_group_size)], ()
