"""The callback that hands signals held during an update to their handlers once Lightning has recorded the step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl


class DeliverHeldSignals(Callback):
    """Runs first in ``on_train_batch_end``, where Lightning has recorded the optimizer step: delivers the
    signals held during the update (and raises what interrupted it, if anything)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        adapter = getattr(trainer.strategy, "dos_adapter", None)
        if adapter is not None:
            adapter.deliver()  # with an update still in flight (overlap), only if a signal is held

    def _settle(self, trainer: pl.Trainer, *args: Any) -> None:
        """An update still in flight (overlap) ends here, and what it held is delivered."""
        adapter = getattr(trainer.strategy, "dos_adapter", None)
        if adapter is not None:
            adapter.settle()

    # Evaluation reads the weights; the end of an epoch or of training may checkpoint them.
    on_validation_start = on_train_epoch_end = on_train_end = _settle
