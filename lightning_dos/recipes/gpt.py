"""A GPT language model for the recipes: pre-norm transformer blocks, causal attention, AdamW.

The layers are built in :meth:`GPT.configure_model`, not in ``__init__``: Lightning calls that hook
inside DeepSpeed's ``zero.Init`` context, so ZeRO-3 partitions every weight as it is created and a
20B model never exists whole on one device; constructing ``GPT`` itself allocates nothing, which
is what lets the recipes of large models be parsed and checked on a laptop.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchmetrics.text import Perplexity

INIT_STD = 0.02


class _Linear(nn.Linear):
    """Linear with GPT-2 initialisation, done in ``reset_parameters`` so it runs before ZeRO-3 partitions it."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = _Linear(n_embd, 3 * n_embd)
        self.proj = _Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = _Linear(n_embd, 4 * n_embd)
        self.fc_proj = _Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), drop, self.training)
        return x + F.dropout(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))), drop, self.training)


#: What ``GPT(optimizer=...)`` accepts.
OPTIMIZERS = ("adamw", "deepspeed_adamw", "adagrad", "lion")


def _make_optimizer(name: str, groups: list[dict], h: Any) -> torch.optim.Optimizer:  # noqa: ANN401
    fp32_states = h.get("fp32_optimizer_states", True)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=h.lr, eps=h.eps)
    if name == "deepspeed_adamw":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            groups, lr=h.lr, betas=tuple(h.betas), eps=h.eps, adamw_mode=True, fp32_optimizer_states=fp32_states
        )
    if name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(groups, lr=h.lr, betas=tuple(h.betas), fp32_optimizer_states=fp32_states)
    return torch.optim.AdamW(groups, lr=h.lr, betas=tuple(h.betas), eps=h.eps)


class GPT(L.LightningModule):
    """A GPT for causal language modelling, trained with AdamW (or Adagrad, Lion) and a warm-up + cosine LR schedule.

    Args:
        vocab_size: number of token ids (256 for the byte-level corpus; the paper's models use 50304).
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``n_embd``).
        n_embd: model width.
        block_size: longest sequence the model accepts (size of the position embedding).
        dropout: dropout probability in attention and MLP outputs.
        tie_embeddings: share the token embedding with the output projection.
        activation_checkpointing: recompute each block in backward instead of keeping its activations.
        lr: peak learning rate, reached after ``warmup_steps``.
        weight_decay: decoupled weight decay of the weight matrices (norms, biases and embeddings get none).
        betas: AdamW's moment decay rates.
        eps: AdamW's epsilon.
        warmup_steps: linear warm-up length, in optimizer steps.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio`` on the last step.
        optimizer: ``"adamw"`` (``torch.optim.AdamW``), ``"deepspeed_adamw"`` (DeepSpeed's ``DeepSpeedCPUAdam`` in
            AdamW mode), ``"adagrad"`` (``torch.optim.Adagrad``: ``lr``, ``eps`` and weight decay) or ``"lion"``
            (DeepSpeed's ``DeepSpeedCPULion``: ``lr``, ``betas`` and weight decay; Lion wants a learning rate
            3-10x smaller than AdamW's).
        fp32_optimizer_states: keep DeepSpeed's CPU optimizers' state in fp32 (True) or in the parameters' dtype
            (False: bf16 moments under the DeepSpeed config's ``bf16.bf16_optimizer_states``; recipe
            ``gpt-tiny-bf16-states.yaml``). Only for the DeepSpeed optimizers.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        activation_checkpointing: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"GPT optimizer={optimizer!r} is not valid; use one of {', '.join(OPTIMIZERS)}")
        if not fp32_optimizer_states and optimizer not in ("deepspeed_adamw", "lion"):
            raise ValueError(
                f"GPT fp32_optimizer_states=False applies to DeepSpeed's CPU optimizers only; optimizer={optimizer!r} "
                "keeps fp32 state: use optimizer='deepspeed_adamw' or 'lion', or leave it True"
            )
        for name, value in (
            ("vocab_size", vocab_size),
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"GPT {name}={value} is not valid; use a positive integer")
        if n_embd % n_head:
            raise ValueError(f"GPT n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.save_hyperparameters()
        self.transformer: nn.ModuleDict | None = None
        self.lm_head: nn.Linear | None = None
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()

    # -- construction ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the layers (once). Lightning calls this inside ZeRO-3's partitioning context."""
        if self.transformer is not None:
            return
        h = self.hparams
        self.transformer = nn.ModuleDict(
            {
                "wte": _Embedding(h.vocab_size, h.n_embd),
                "wpe": _Embedding(h.block_size, h.n_embd),
                "blocks": nn.ModuleList(Block(h.n_embd, h.n_head, h.dropout) for _ in range(h.n_layer)),
                "ln_f": nn.LayerNorm(h.n_embd),
            }
        )
        self.lm_head = None if h.tie_embeddings else _Linear(h.n_embd, h.vocab_size, bias=False)

    @staticmethod
    def count_parameters(
        n_layer: int, n_embd: int, vocab_size: int, block_size: int, tie_embeddings: bool = True
    ) -> int:
        """Exact parameter count of this architecture, without building it."""
        d = n_embd
        per_block = 12 * d * d + 13 * d  # qkv, proj, fc, fc_proj weights and biases, two LayerNorms
        head = 0 if tie_embeddings else vocab_size * d
        return vocab_size * d + block_size * d + n_layer * per_block + 2 * d + head

    def num_parameters(self) -> int:
        """Parameters of this model once built (computed from the settings; nothing is allocated)."""
        h = self.hparams
        return self.count_parameters(h.n_layer, h.n_embd, h.vocab_size, h.block_size, h.tie_embeddings)

    # -- model -------------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits of shape (batch, time, vocab_size) for token ids of shape (batch, time)."""
        if self.transformer is None:
            self.configure_model()
        t = idx.shape[1]
        if t > self.hparams.block_size:
            raise ValueError(f"sequence of length {t} is longer than GPT block_size={self.hparams.block_size}")
        tr = self.transformer
        x = tr["wte"](idx) + tr["wpe"](torch.arange(t, device=idx.device))
        for block in tr["blocks"]:
            if self.hparams.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = tr["ln_f"](x)
        weight = tr["wte"].weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), logits

    # -- Lightning hooks ---------------------------------------------------------------------------

    def check_seq_len(self, seq_len: int | None) -> None:
        """Raise ``ValueError`` if the data's ``seq_len`` is longer than the model's ``block_size``."""
        if seq_len is not None and seq_len > self.hparams.block_size:
            raise ValueError(
                f"data.seq_len={seq_len} is longer than model.block_size={self.hparams.block_size}; "
                f"use a seq_len of at most {self.hparams.block_size} or a block_size of at least {seq_len}"
            )

    def setup(self, stage: str) -> None:
        """Refuse a data sequence length the model cannot take, before any work."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        self.check_seq_len(getattr(datamodule, "seq_len", None))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens_per_step", float(batch[1].numel()), reduce_fx="sum")
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_ppl.update(logits.float(), batch[1])
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_ppl)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.test_ppl.update(logits.float(), batch[1])
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/ppl", self.test_ppl)

    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """The most likely next token at every position, shape (batch, time)."""
        return self(batch[0]).argmax(-1)

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The parameters that decay (the weight matrices of linear layers) and those that do not (norms, biases,
        embeddings), in module order: the optimizer's two param groups, which ZeRO-3 packs in this order."""
        decay, no_decay = [], []
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(param)
        return decay, no_decay

    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams
        decay, no_decay = self.parameter_groups()
        groups = [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = _make_optimizer(h.get("optimizer", "adamw"), groups, h)
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else max(10 * h.warmup_steps, 1000)

        def schedule(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            progress = min(1.0, (step - h.warmup_steps) / max(1, total - h.warmup_steps))
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
