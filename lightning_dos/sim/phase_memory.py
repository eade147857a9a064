"""Naming the phases of a Trainer's iterations on the simulated accelerator's device-memory account.

The engine's update is one phase of an iteration; what it holds on the device outside that phase (through
the next forward and backward) is what a batch size tuned under stock ZeRO-3 offload has no room for. With
:class:`IterationMemory` among a Trainer's callbacks, the
:class:`~lightning_dos.sim.simstreams.DeviceMemoryAccount` of a strategy built with
``streams_factory=SimStreams`` records the peak of each phase of every iteration.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.pytorch import Callback

from lightning_dos.sim.simstreams import DeviceMemoryAccount, PhaseMemory, SimStreams

#: The phases, in the order a training iteration passes them.
FORWARD, BACKWARD, UPDATE, BETWEEN = "forward", "backward", "update", "between steps"


class IterationMemory(Callback):
    """Starts a phase of the simulated device's memory account at each of Lightning's hooks: ``forward`` at
    the batch's start, ``backward`` before backward, ``update`` before the optimizer step (DeepSpeed's step,
    the engine's update inside it), ``between steps`` once the batch has ended."""

    def __init__(self) -> None:
        self.account: DeviceMemoryAccount | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = getattr(trainer.strategy, "dos_engine", None)
        streams = getattr(engine, "streams", None)
        if not isinstance(streams, SimStreams):
            raise ValueError(
                "IterationMemory needs DeepOptimizerStatesStrategy(streams_factory=SimStreams) (a simulated "
                f"accelerator); the engine's streams are {type(streams).__name__}"
            )
        self.account = streams.memory

    def _enter(self, phase: str) -> None:
        if self.account is not None:
            self.account.enter(phase)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._enter(FORWARD)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._enter(BACKWARD)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._enter(UPDATE)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._enter(BETWEEN)

    def phases(self, *names: str) -> list[PhaseMemory]:
        """The recorded phases called ``names`` (every phase when none is named), in order."""
        recorded = self.account.phases if self.account is not None else []
        return [p for p in recorded if not names or p.name in names]

    def iteration_peak(self) -> int:
        """The most device bytes held at once by the engine and the model together (with :class:`ModelMemory`)."""
        return max((p.peak_total_bytes for p in self.phases()), default=0)

    def held_outside_updates(self) -> int:
        """The most device bytes held at any moment outside the update phases (forward, backward, between)."""
        return max((p.peak_bytes for p in self.phases(FORWARD, BACKWARD, BETWEEN)), default=0)


class _Saved:
    """A tensor autograd saved for backward, counted on the simulated device until autograd drops it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class ModelMemory(Callback):
    """Records the model's own device bytes on the simulated accelerator's account, beside the engine's, so that an
    iteration's device peak is the model's and the engine's together (``PhaseMemory.peak_total_bytes``).

    - **Activations**, recorded: every tensor autograd saves for backward during the training forward (a
      ``saved_tensors_hooks`` pair), counted once per storage from the moment it is saved until backward frees it.
    - **Gathered parameters**, modelled: ZeRO-3 gathers a module's parameters whole for its forward and for its
      backward and releases them after; each module's own parameters (at their full size, ``ds_numel``) are
      counted from its forward (backward) pre-hook to its forward (backward) hook. Parameters autograd saves are
      counted here, not as activations.

    Put it before :class:`IterationMemory` among the callbacks (either order works; both need
    ``streams_factory=SimStreams``)."""

    def __init__(self) -> None:
        self.account: DeviceMemoryAccount | None = None
        self._storages: dict[int, list[int]] = {}  # storage -> [holders alive, bytes]
        self._hooks: Any = None
        self._handles: list[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        streams = getattr(getattr(trainer.strategy, "dos_engine", None), "streams", None)
        if not isinstance(streams, SimStreams):
            raise ValueError("ModelMemory needs DeepOptimizerStatesStrategy(streams_factory=SimStreams)")
        self.account = streams.memory
        for module in pl_module.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            nbytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
            self._handles += [
                module.register_forward_pre_hook(lambda *_, n=nbytes: self._gathered(n)),
                module.register_forward_hook(lambda *_, n=nbytes: self._released(n)),
                module.register_full_backward_pre_hook(lambda *_, n=nbytes: self._gathered(n)),
                module.register_full_backward_hook(lambda *_, n=nbytes: self._released(n)),
            ]

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _gathered(self, nbytes: int) -> None:
        if self.account is not None and torch.is_grad_enabled():
            self.account.model_allocated(nbytes)

    def _released(self, nbytes: int) -> None:
        if self.account is not None and torch.is_grad_enabled():
            self.account.model_freed(nbytes)

    def _pack(self, tensor: Any) -> Any:
        if isinstance(tensor, torch.nn.Parameter) or self.account is None:
            return tensor
        key = tensor.untyped_storage().data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, tensor.untyped_storage().nbytes()]
            self.account.model_allocated(entry[1])
        entry[0] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._unsaved, key)
        return saved

    def _unsaved(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0 and self.account is not None:
            del self._storages[key]
            self.account.model_freed(entry[1])

    @staticmethod
    def _unpack(saved: Any) -> Any:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
