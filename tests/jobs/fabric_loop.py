"""A user's own Lightning Fabric loop over TinyLM, with ``Fabric(strategy="dos")`` or plain Fabric and AdamW.

Imported by tests/test_fabric.py (``train``) and run by it as a script for what needs a process of its own: resuming
from a checkpoint in a fresh process, and two processes (Fabric's launcher re-runs the command line for rank 1).
Usage: python tests/jobs/fabric_loop.py SETTINGS.json OUT.pt (SETTINGS: ``train``'s keyword arguments).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_dos  # noqa: E402, F401  (registers "dos" with Fabric)
from tests.helpers import VOCAB, TinyLM, full_parameters, lm_data, make_optimizer  # noqa: E402

BATCH = 16
WARMUP = 4


@dataclass
class Run:
    """What a loop leaves: the gathered parameters, the training and evaluation losses, the last LR, the strategy."""

    params: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    lr: float = 0.0
    fabric: Any = None


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two sets of parameters are the same bits."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def train(
    dos: dict[str, Any] | None = None,
    *,
    steps: int = 6,
    accumulate: int = 1,
    clip: float = 0.0,
    clip_in_config: bool = False,
    precision: str = "32-true",
    devices: int = 1,
    save_at: int | None = None,
    checkpoint: str | None = None,
    resume: bool = False,
    close: bool = True,
    on_setup: Callable[[Any], None] | None = None,
) -> Run:
    """Train TinyLM for ``steps`` optimizer steps of ``accumulate`` micro-batches each, evaluating under ``no_grad``
    after every step, with ``Fabric(strategy=DOSFabricStrategy(**dos))`` (None: plain Fabric and AdamW).

    ``clip``: the max gradient norm (DOS: the strategy's ``gradient_clipping``, or the config's with
    ``clip_in_config``; plain: ``fabric.clip_gradients``). ``save_at``: save ``checkpoint`` after that step;
    ``resume``: load it first and continue after the step it holds. ``close``: close the strategy at the end;
    ``on_setup``: called with the strategy once set up."""
    L.seed_everything(0, verbose=False)
    if dos is None:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    else:
        from lightning_dos import DOSFabricStrategy

        kwargs = dict(dos)
        config: dict[str, Any] = {"gradient_accumulation_steps": accumulate, **kwargs.pop("config", {})}
        if clip_in_config:
            config["gradient_clipping"] = clip
        elif clip:
            kwargs["gradient_clipping"] = clip
        strategy = DOSFabricStrategy(config=config, **kwargs)
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=devices, precision=precision)
    fabric.launch()
    module = TinyLM()
    no_decay = [module.embed.weight, module.norm.weight, module.norm.bias]
    decay = [p for p in module.parameters() if all(p is not q for q in no_decay)]
    optimizer = make_optimizer(
        "adamw",
        [{"params": decay, "weight_decay": 0.1, "lr": 3e-3}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
    model, optimizer = fabric.setup(module, optimizer)
    if on_setup is not None:
        on_setup(fabric.strategy)
    data = lm_data()
    held_out = tuple(t[-BATCH:] for t in data.tensors)
    run, first = Run(params={}, fabric=fabric), 0
    if resume:
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        fabric.load(checkpoint, state)
        first = state["step"] + 1
    rank, world = fabric.global_rank, fabric.world_size
    for step in range(first, steps):
        for micro in range(accumulate):
            i = (step * accumulate + micro) * BATCH
            x, y = (t[i + rank : i + BATCH : world] for t in data.tensors)  # this rank's share of the batch
            loss = _loss(model, (x, y))
            run.losses.append(float(loss.detach()))
            if dos is None:
                fabric.backward(loss / accumulate)
            else:
                fabric.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
                optimizer.step()  # DeepSpeed steps at the accumulation boundary only
        if dos is None:
            if clip:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        with torch.no_grad():
            model.eval()
            run.eval_losses.append(float(_loss(model, held_out)))
            model.train()
        if step == save_at:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step})
    run.lr = optimizer.param_groups[0]["lr"]
    run.params = full_parameters(module)  # the same parameters, named as the user named them
    if close and dos is not None:
        fabric.strategy.close()
    return run


if __name__ == "__main__":
    settings, out = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    result = train(**settings)
    if result.fabric.global_rank == 0:
        torch.save({"params": result.params, "losses": result.losses, "lr": result.lr}, out)
