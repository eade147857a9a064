"""Small models and run helpers shared by the tests (real Lightning, real DeepSpeed, on CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dos.engine import native
from lightning_dos.model.plan import Place, random_plan

VOCAB = 61


class TinyLM(L.LightningModule):
    """A small causal-LM-shaped model with several sub-groups' worth of parameters and two param groups.

    The embedding and the norm get no weight decay and a different learning rate; the rest decays.
    LR warms up linearly over ``warmup`` steps.
    """

    def __init__(
        self,
        width: int = 32,
        seq: int = 8,
        warmup: int = 5,
        optimizer: str = "adamw",
        fused: bool = False,
        one_group: bool = False,
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )
        self.head = torch.nn.Linear(width, VOCAB)
        self.warmup = warmup
        self.optimizer_name = optimizer
        self.one_group = one_group  # every parameter in one param group (decay 0.1, lr 3e-3)
        self.fused = fused  # torch's fused implementation of the optimizer (the engine's formula)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.mlp(self.norm(h))
        return self.head(h)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = self.loss(batch)
        self.losses.append(float(loss.detach()))
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        self.log("val/loss", self.loss(batch))

    def test_step(self, batch, batch_idx):  # noqa: ANN001
        self.log("test/loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):  # noqa: ANN001
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):  # noqa: ANN201
        no_decay = [self.embed.weight, self.norm.weight, self.norm.bias]
        ids = {id(p) for p in no_decay}
        decay = [p for p in self.parameters() if id(p) not in ids]
        groups = [
            {"params": decay, "weight_decay": 0.1, "lr": 3e-3},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3},
        ]
        if self.one_group:
            groups = [{"params": list(self.parameters()), "weight_decay": 0.1, "lr": 3e-3}]
        opt = make_optimizer(self.optimizer_name, groups, self.fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


#: The optimizers TinyLM can be trained with (``TinyLM(optimizer=...)``).
OPTIMIZERS = ("adam", "adamw", "adagrad", "ds_adam", "ds_adam_bf16_states", "ds_adagrad", "ds_lion")


def make_optimizer(name: str, groups: list[dict], fused: bool = False) -> torch.optim.Optimizer:
    """One of :data:`OPTIMIZERS` over ``groups`` (``fused``: torch's fused implementation, where it has one)."""
    if name == "adam":
        return torch.optim.Adam(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
    if name == "adamw":
        return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-10)
    if name in ("ds_adam", "ds_adam_bf16_states"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            groups, betas=(0.9, 0.95), eps=1e-8, adamw_mode=True, fp32_optimizer_states=name == "ds_adam"
        )
    if name == "ds_adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(groups, eps=1e-10)
    if name == "ds_lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(groups, betas=(0.9, 0.99))
    raise ValueError(f"optimizer={name!r}; one of {OPTIMIZERS}")


def lm_data(n: int = 320, seq: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    # A learnable pattern: the next token is a fixed function of the current one, plus noise.
    x = torch.randint(0, VOCAB, (n, seq), generator=g)
    y = (x * 7 + 3) % VOCAB
    noise = torch.rand(n, seq, generator=g) < 0.1
    y = torch.where(noise, torch.randint(0, VOCAB, (n, seq), generator=g), y)
    return TensorDataset(x, y)


def loader(batch_size: int = 16, seed: int = 0) -> DataLoader:
    return DataLoader(lm_data(seed=seed), batch_size=batch_size, shuffle=False)


class RandomPlacement(L.Callback):
    """Replace the engine's planner with a fresh random plan every step (placement must not matter)."""

    def __init__(self, seed: int = 0, places: tuple = (Place.HOST, Place.DEVICE), after_backward: bool = False) -> None:
        self.rng = random.Random(seed)
        self.places = places
        #: Also leave a random half of the host sub-groups for after backward (what ``overlap="auto"`` reads).
        self.after_backward = after_backward
        self.plans: list = []
        self.requested: list = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        adapter = trainer.strategy.dos_adapter
        self.engine = adapter.engine
        self._last = None
        n = len(adapter.engine.sub_groups)

        def planner(step: int) -> tuple:
            self._record()  # the previous update is over by the time the next step plans
            plan = random_plan(n, self.rng, places=self.places)
            if self.after_backward:
                late = frozenset(i for i in plan.host_indices if self.rng.random() < 0.5)
                plan = dataclasses.replace(plan, after_backward=late)
            self.requested.append(plan)
            return plan, None

        adapter.planner = planner

    def _record(self) -> None:
        """The plan of each step's report, once issued (under overlap, after the step's batch has ended)."""
        report = self.engine.last_report
        if report is not None and report is not self._last:
            self.plans.append(report.plan)
            self._last = report

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._record()  # the strategy's own on_train_end (first) waited for the last update


def trainer(
    strategy, steps: int = 20, precision: str = "32-true", clip: float | None = 0.5, callbacks=(), **kw
) -> L.Trainer:  # noqa: ANN001
    settings = dict(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # same batches in the same order as the plain reference
        callbacks=list(callbacks),
    )
    settings.update(kw)
    return L.Trainer(**settings)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to full size (ZeRO-3 keeps only partitions between steps), as fp32."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: p.detach().float().clone() for k, p in params.items()}
    return {k: p.detach().float().clone() for k, p in params.items()}


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for key in b:
        denom = b[key].abs().clamp_min(1e-3)
        worst = max(worst, float(((a[key].to(denom.device) - b[key]).abs() / denom).max()))
    return worst


LN_VOCAB = math.log(VOCAB)

#: Largest relative difference (denominators clamped at 1e-3, see max_relative_error) accepted between the
#: engine and torch.optim.AdamW(fused=True) over the 20-step fp32 equivalence runs. The engine's kernels compute
#: torch's fused formula bit for bit (tests/test_native_kernel.py) and placement changes nothing (bitwise);
#: what is left is DeepSpeed's gradient path (gradient norm and clipping over flat partitions): 5.9e-6 here.
FP32_RTOL = 1e-5
#: The same against torch.optim.AdamW's default (per-op) implementation, which rounds differently from torch's
#: own fused one (its square root kernel differs from the correctly rounded one on 664 of 4,096 elements in
#: one measured step): the two torch implementations are 1.09e-5 apart on this run, the engine 1.26e-5 from
#: the per-op one, and stock DeepSpeed ZeRO-3 offload 1.16e-5.
FP32_RTOL_PER_OP = 2e-5

#: torch.distributed's variables, which in-process fits leave in os.environ.
_DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env() -> dict[str, str]:
    """The environment for a child process that must start its own (CPU) distributed run."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env["DS_ACCELERATOR"] = "cpu"
    return env


#: Libraries built in this test session, by (compiler, flags): several tests load the same x86-64 levels, and each
#: build of host_adam.c takes 10-20 s on two cores. (Here, not in a test module: pytest imports a test module under
#: its own name, and another module importing it as ``tests.<name>`` would get a second copy of this dict.)
_BUILT: dict[tuple[str, tuple[str, ...]], Path] = {}


def _build_key(compiler: str, flags: list[str]) -> tuple[str, tuple[str, ...]]:
    return os.path.realpath(shutil.which(compiler) or compiler), tuple(flags)


def built_once(compiler: str, flags: list[str], directory: Path) -> Path:
    """host_adam.c built by ``compiler`` with ``flags`` (added to ``native.FLAGS``, as ``native.compile_library``
    adds them) into ``directory``, or the library an earlier test of this session built so."""
    key = _build_key(compiler, flags)
    if key not in _BUILT or not _BUILT[key].exists():
        target = directory / f"host_adam-{len(_BUILT)}.so"
        native.compile_library(compiler, flags, target)
        _BUILT[key] = target
    return _BUILT[key]


def remember_build(compiler: str, flags: list[str], library: Path) -> None:
    """Let :func:`built_once` reuse ``library``, built by ``compiler`` with ``flags`` and options that do not change
    the code generated (GCC's ``-fopt-info`` remarks)."""
    _BUILT.setdefault(_build_key(compiler, flags), library)


@contextlib.contextmanager
def block_4k_filesystem(scratch: Path, size_mb: int = 96) -> Iterator[Path | None]:
    """A directory on an ext4 filesystem whose drive has 4096-byte logical blocks (a loop device made with
    ``losetup --sector-size 4096`` over a file in ``scratch``), removed after; None where this machine cannot make
    one (not root, no loop devices, no losetup or mkfs.ext4), for the caller to skip by name. Many NVMe drives are
    formatted so, and O_DIRECT there refuses any offset or length that is not whole 4096-byte blocks, where this
    machine's own disk (512-byte blocks) takes them."""
    tools = [shutil.which(tool) for tool in ("losetup", "mkfs.ext4", "mount", "umount")]
    if os.geteuid() != 0 or None in tools or not os.path.exists("/dev/loop-control"):
        yield None
        return
    image, mount = scratch / "block-4k.img", scratch / "block-4k"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    run = functools.partial(subprocess.run, capture_output=True, text=True, check=False)
    made = run(["losetup", "--find", "--show", "--sector-size", "4096", str(image)])
    device = made.stdout.strip()
    if made.returncode != 0 or not device:
        yield None
        return
    try:
        if run(["mkfs.ext4", "-q", "-b", "4096", device]).returncode or run(["mount", device, str(mount)]).returncode:
            yield None
            return
        try:
            yield mount
        finally:
            # A file still open there (a strategy not yet collected keeps its swap file open after fit) makes the
            # filesystem busy: detached lazily then, so that no mount or loop device outlives the test.
            if run(["umount", str(mount)]).returncode:
                run(["umount", "--lazy", str(mount)])
    finally:
        run(["losetup", "-d", device])
