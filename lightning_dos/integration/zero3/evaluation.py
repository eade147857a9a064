"""Reading a ZeRO-3 checkpoint's weights for evaluation, without building an optimizer."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch

from lightning_dos.integration.zero3.compat import (
    _deepspeed_version,
)


@contextlib.contextmanager
def _bars_only_on_a_terminal(module: types.ModuleType) -> Iterator[None]:
    """Run a block with ``module``'s tqdm bars shown on a terminal only (tqdm's ``disable=None``): in a log file
    or a pipe each bar's frames, joined by carriage returns, would be one line of a few hundred columns."""
    original = module.tqdm
    module.tqdm = functools.partial(original, disable=None)
    try:
        yield
    finally:
        module.tqdm = original


def load_zero3_weights_for_evaluation(
    module: torch.nn.Module, checkpoint_dir: str, rank: int, strict: bool = True
) -> dict:
    """Load a ZeRO-3 checkpoint's fp32 master weights into ``module``'s ZeRO-3 partitions, with no optimizer.

    DeepSpeed 0.19's own ``load_checkpoint`` cannot do this for an inference engine (Lightning's
    ``validate/test/predict(ckpt_path=...)``): without optimizer states it falls back to
    ``optimizer._restore_from_bit16_weights()``, which the optimizer-less ``DeepSpeedZeRoOffload`` lacks,
    and the module states a ZeRO-3 checkpoint holds are empty placeholders. The weights live in the
    per-rank fp32 partitions, so they are read from there, one parameter at a time (memory-mapped, so a
    large model is never materialised whole), and each rank copies its own slice into ``param.ds_tensor``
    in ZeRO-3's layout (rank r holds elements ``[r * p, (r + 1) * p)`` of the flattened parameter). This
    works whatever world size wrote the checkpoint, and casts to the model's dtype exactly as training does.

    Args:
        module: the LightningModule whose parameters DeepSpeed partitioned (``ds_tensor`` set).
        checkpoint_dir: the checkpoint directory Lightning's DeepSpeed strategy wrote.
        rank: this process's rank in the data-parallel group.
        strict: refuse a checkpoint that lacks one of ``module``'s parameters or buffers.

    Returns:
        the checkpoint's client state (what Lightning stored beside the weights: loops, callbacks, ...).
    """
    import io
    from pathlib import Path

    from deepspeed.utils import zero_to_fp32

    root = Path(checkpoint_dir)
    latest = root / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    with contextlib.redirect_stdout(io.StringIO()), _bars_only_on_a_terminal(zero_to_fp32):  # it prints its progress
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag, lazy_mode=True)
    expected = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
    missing = [name for name in expected if name not in state]
    if strict and missing:
        raise KeyError(f"checkpoint {checkpoint_dir} lacks {', '.join(missing)} (DeepSpeed {_deepspeed_version()})")
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name not in state:
                continue
            full = state[name].contiguous().reshape(-1)
            if not hasattr(param, "ds_tensor"):
                param.data.copy_(full.view_as(param))
                continue
            part = param.ds_tensor
            start = min(rank * part.numel(), full.numel())
            piece = full[start : start + part.numel()]
            part.data[: piece.numel()].copy_(piece)
        for name, buffer in module.named_buffers():
            if name in state:
                buffer.copy_(state[name].contiguous())
    model_states = sorted((root / tag).glob("*model_states.pt"))
    if not model_states:
        raise FileNotFoundError(f"{root / tag} holds no DeepSpeed model states; is {checkpoint_dir} a checkpoint?")
    client = torch.load(model_states[0], map_location="cpu", weights_only=False)
    for key in ("module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments"):
        client.pop(key, None)  # the weights, read above; what remains is Lightning's client state
    return client
