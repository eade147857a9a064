"""Naming the phases of a Trainer's iterations on the simulated accelerator's device-memory account.

The engine's update is one phase of an iteration; what it holds on the device outside that phase (through
the next forward and backward) is what a batch size tuned under stock ZeRO-3 offload has no room for. With
:class:`IterationMemory` among a Trainer's callbacks, the
:class:`~lightning_dos.sim.simstreams.DeviceMemoryAccount` of a strategy built with
``streams_factory=SimStreams`` records the peak of each phase of every iteration.
"""

from __future__ import annotations

from typing import Any

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

    def held_outside_updates(self) -> int:
        """The most device bytes held at any moment outside the update phases (forward, backward, between)."""
        return max((p.peak_bytes for p in self.phases(FORWARD, BACKWARD, BETWEEN)), default=0)
