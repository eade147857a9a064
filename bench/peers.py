"""The peers a user could switch on instead of us, and exactness beside speed (issue 55).

Systems (``bench/run.py --systems``):

- ``superoffload:R``: DeepSpeed's SuperOffload (``offload_optimizer.super_offload``), ``R`` its ``ratio`` (the share of
  sub-groups whose Adam runs on the CPU; the rest on the GPU). CUDA only: DeepSpeed 0.19.8 asserts the accelerator.
- ``zenflow:K:S``: DeepSpeed's ZenFlow, ``K`` its ``topk_ratio`` (gradient columns updated on the GPU at once), ``S``
  its ``update_interval`` (the rest updated on the CPU every S steps, a step late: ``overlap_step``), columns
  reselected every S steps (``select_strategy: "step"``). Its stage-3 path allocates on CUDA.
- ``fsdp-offload``: Lightning's ``FSDPStrategy(cpu_offload=True)``, torch's AdamW stepping on the CPU. Lightning
  refuses it without a CUDA accelerator, and torch's FSDP needs one for its offloaded flat parameters.

Each peer runs in a process of its own (``run_isolated``): SuperOffload pins the CPU affinity of the process that runs
it and leaves a worker process behind, ZenFlow sets thread counts and starts workers too. A system that cannot run
here is a row saying why (the exception its process raised), never a crash of the bench.

Exactness (``--exactness``): after the N measured steps, the last loss and ``||w - w_exact|| / ||w_exact||`` over the
fp32 master weights, against stock offload's run on the same batches (run first; exact AdamW), the steps skipped so
far, then one injected non-finite batch (its loss times infinity) and one finite batch after it: whether the engine
skipped the injected step, how many weights are not finite after the next one, and how far the weights are from
stock's after the same two batches.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch

GB = 1e9
PEERS = ("superoffload:", "zenflow:", "fsdp-offload")
#: torch.distributed's rendezvous variables an in-process fit leaves behind; a child process must pick its own.
_RENDEZVOUS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT"}  # fmt: skip


def is_peer(system: str) -> bool:
    return system.startswith(PEERS)


def peer_strategy(system: str, sub_group_size: int, stock_config: Any) -> tuple[L.pytorch.strategies.Strategy, str]:
    """The strategy for a peer's name, and the optimizer its model steps with: ``"deepspeed"`` (DeepSpeed's CPU Adam,
    as stock offload), ``"zenflow"`` (ZenFlow's CPU Adam) or ``"torch"`` (the recipe's own torch AdamW)."""
    from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy

    if system.startswith("superoffload:"):
        config = stock_config(sub_group_size, ratio=float(system.split(":")[1]))
        config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
        return DeepSpeedCPUStrategy(config=config), "deepspeed"
    if system.startswith("zenflow:"):
        _, topk, interval = system.split(":")
        config = stock_config(sub_group_size)
        config["zero_optimization"]["zenflow"] = {
            "topk_ratio": float(topk), "update_interval": int(interval), "select_strategy": "step",
            "select_interval": int(interval), "overlap_step": True,
        }  # fmt: skip
        return DeepSpeedCPUStrategy(config=config), "zenflow"
    if system == "fsdp-offload":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_dos.recipes.gpt import Block

        return FSDPStrategy(cpu_offload=True, auto_wrap_policy={Block}), "torch"
    raise ValueError(f"not a peer: {system!r}; one of superoffload:R, zenflow:K:S, fsdp-offload")


def cpu_adam(torch_opt: torch.optim.Optimizer, kind: str) -> torch.optim.Optimizer:
    """DeepSpeed's (or ZenFlow's) CPU Adam over the torch optimizer's groups, with its hyperparameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, ZenFlowCPUAdam

    groups = [
        {k: v for k, v in g.items() if k not in ("foreach", "fused", "capturable", "differentiable")}
        for g in torch_opt.param_groups
    ]
    if kind == "zenflow":
        return ZenFlowCPUAdam(groups, lr=torch_opt.defaults["lr"], adamw_mode=True, overlap_step=True)
    return DeepSpeedCPUAdam(groups, lr=torch_opt.defaults["lr"], adamw_mode=True)


def with_injection(model_cls: type) -> type:
    """``model_cls`` whose loss is multiplied by infinity at step ``inject_at`` (None: never): a non-finite batch."""

    class Injecting(model_cls):  # type: ignore[misc, valid-type]
        inject_at: int | None = None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.trainer.global_step == self.inject_at else loss

    Injecting.__name__ = model_cls.__name__
    return Injecting


class FSDPClipping:
    """Gradient clipping by global norm through FSDP's own ``clip_grad_norm_`` (Lightning's FSDP precision refuses
    ``gradient_clip_algorithm="norm"``: torch's clipping is wrong on sharded gradients); the norm kept for the table."""

    last_grad_norm: float | None = None

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, *args: Any) -> None:
        if gradient_clip_val:
            self.last_grad_norm = float(self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val))


def _master_weights(trainer: L.Trainer, module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's fp32 master weights, full size, on the CPU, one at a time."""
    strategy = trainer.strategy
    adapter = getattr(strategy, "dos_adapter", None)
    if adapter is not None:
        adapter.finish_update()  # an overlapped update still running is part of the step just taken
    if getattr(strategy, "deepspeed_engine", None) is not None:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in module.named_parameters():
            value = safe_get_full_fp32_param(param)
            if value is None:  # not trainable, or no fp32 master copy: the weights themselves
                with deepspeed.zero.GatheredParameters([param]):
                    value = param.detach()
            yield name, value.float().cpu()
        return
    wrapped = getattr(strategy, "model", None)
    if wrapped is not None and hasattr(wrapped, "summon_full_params"):  # FSDP: the original parameters, full size
        with wrapped.summon_full_params(wrapped, writeback=False):
            for name, param in module.named_parameters():
                yield name, param.detach().float().cpu().clone()
        return
    for name, param in module.named_parameters():
        yield name, param.detach().float().cpu()


class ExactnessProbe(L.Callback):
    """After ``steps`` optimizer steps: the loss, the steps skipped, the weights against the reference (or saved as
    it); two steps later, after the injected non-finite batch and a finite one: the same again."""

    def __init__(self, steps: int, reference: Path, save: bool) -> None:
        self.steps, self.reference, self.save = steps, reference, save
        self.found: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        step = trainer.global_step
        if step == self.steps:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.found.update(loss=float(loss), skipped=_skipped(trainer), engine_steps=_engine_steps(trainer))
            self.found.update(_against(trainer, module, self.reference / "after-steps.pt", self.save))
        elif step == self.steps + 2:
            after = _against(trainer, module, self.reference / "after-injection.pt", self.save)
            skipped = _skipped(trainer)
            self.found["injected"] = {
                "skipped": None if skipped is None else skipped > self.found["skipped"],
                "nonfinite": after["nonfinite"],
                "rel_err": after["rel_err"],
            }


def _skipped(trainer: L.Trainer) -> int | None:
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    return int(engine.skipped_steps) if engine is not None else None


def _engine_steps(trainer: L.Trainer) -> int | None:
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    return int(engine.global_steps) if engine is not None else None


def _against(trainer: L.Trainer, module: torch.nn.Module, path: Path, save: bool) -> dict[str, Any]:
    """Non-finite weights, and ``||w - w_ref|| / ||w_ref||`` (0 when saving the reference; None without one)."""
    weights = dict(_master_weights(trainer, module))
    nonfinite = sum(int((~torch.isfinite(w)).sum()) for w in weights.values())
    if save:
        torch.save(weights, path)
        return {"nonfinite": nonfinite, "rel_err": 0.0}
    if not path.exists():
        return {"nonfinite": nonfinite, "rel_err": None}
    reference = torch.load(path, mmap=True)
    diff = ref = 0.0
    for name, exact in reference.items():
        mine = weights.get(name)
        if mine is None or mine.shape != exact.shape:
            return {"nonfinite": nonfinite, "rel_err": None, "mismatch": name}
        diff += float((mine.double() - exact.double()).square().sum())
        ref += float(exact.double().square().sum())
    return {"nonfinite": nonfinite, "rel_err": (diff / ref) ** 0.5 if ref > 0 else None}


def one_line(error: BaseException) -> str:
    """An exception in one line: its type and first line, and where in DeepSpeed, Lightning or torch it was raised."""
    text = (str(error).strip().splitlines() or [""])[0][:200]
    where = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        parts = Path(frame.filename).parts
        for package in ("deepspeed", "lightning", "torch"):
            if "site-packages" in parts and package in parts:
                tail = Path(*parts[parts.index(package) :])
                where = f" (at {tail}:{frame.lineno})"
                break
        if where:
            break
    return f"{type(error).__name__}: {text}{where}"


def peak_host_gb() -> float:
    """This process's peak resident memory, and its largest child's (the peers' workers), GB (Linux: KiB units)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) * 1024 / GB


def run_isolated(system: str, argv: list[str], workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``system`` alone in a fresh process (``bench/run.py ARGV --one SYSTEM``) and return its result (asdict of
    a Result), or ``{"unavailable": why}`` in one line when it could not run. Whatever it left running is ended."""
    stem = "".join(c if c.isalnum() or c in ".-" else "_" for c in system)
    result, log = workdir / f"{stem}.json", workdir / f"{stem}.log"
    result.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p
    )
    cmd = [sys.executable, str(Path(__file__).with_name("run.py")), *argv, "--one", system, "--result", str(result)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:  # its session: the process, and the workers a peer leaves behind
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    if result.exists():
        return json.loads(result.read_text())
    if code is None:
        return {"unavailable": f"did not finish within {timeout_s:.0f} s (log: {log})"}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return {"unavailable": f"its process exited with code {code}: {(lines or [''])[-1][:200]} (log: {log})"}


def write_child_result(path: Path, result: dict[str, Any] | None, error: BaseException | None) -> None:
    payload = result if error is None else {"unavailable": one_line(error)}
    path.write_text(json.dumps(payload, default=float))


def _cell(value: Any, digits: int = 3, sci: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2e}" if sci else f"{value:.{digits}f}"


def injected_cell(injected: dict[str, Any] | None) -> str:
    if not injected:
        return "n/a"
    nonfinite, skipped = injected["nonfinite"], injected["skipped"]
    head = {True: "skipped", False: "not skipped", None: "no skip count"}[skipped]
    if nonfinite:
        return f"{head}, {nonfinite} non-finite weights after the next step"
    drift = injected["rel_err"]
    return f"{head}, finite; {_cell(drift, sci=True)} from stock after the next step" if drift else f"{head}, finite"


def exactness_table(results: list[Any]) -> str:
    """One row per system: loss and distance from exact AdamW after the measured steps, steps skipped, what the
    injected non-finite batch did, the last gradient norm, our speculation's commit rate, peak host memory."""
    lines = [
        "| system | loss | ‖w − w_exact‖ / ‖w_exact‖ | skipped steps | optimizer steps taken | injected non-finite "
        "batch | last grad norm | commit rate | peak host GB |",
        "|" + "---|" * 9,
    ]
    for r in results:
        e = r.extra
        if "unavailable" in e:
            lines.append(f"| {r.system} | not run here: {e['unavailable']} |" + " |" * 7)
            continue
        lines.append(
            f"| {r.system} | {_cell(e.get('loss'), 4)} | {_cell(e.get('rel_err'), sci=True)} "
            f"| {e.get('skipped', 'n/a') if e.get('skipped') is not None else 'n/a'} "
            f"| {e.get('engine_steps') if e.get('engine_steps') is not None else 'n/a'} "
            f"| {injected_cell(e.get('injected'))} | {_cell(e.get('last_grad_norm'), 3)} "
            f"| {_cell(e.get('commit_rate'), 2)} | {_cell(r.peak_host_gb, 2)} |"
        )
    return "\n".join(lines)


def versus_best_peer(results: list[Any]) -> list[str]:
    """A line naming the fastest peer by iteration (TwinFlow counted as one) and each of ours against it."""
    peer_rows = [r for r in results if is_peer(r.system) or r.system.startswith("twinflow:")]
    ours = [r for r in results if r.system == "auto" or r.system.startswith(("auto@", "stride:"))]
    if not peer_rows or not ours:
        return []
    best = min(peer_rows, key=lambda r: r.step_s)
    against = ", ".join(f"{r.system} {best.step_s / r.step_s:.2f}x" for r in ours)
    return [f"Fastest peer by iteration: {best.system} ({best.step_s:.3f} s); ours against it: {against}."]
