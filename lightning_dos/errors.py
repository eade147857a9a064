"""The error every refused setting raises, before any work starts (low in the tree, so every layer can raise it)."""

from __future__ import annotations


class DOSConfigError(ValueError):
    """A setting of :class:`~lightning_dos.integration.strategy.DeepOptimizerStatesStrategy` (or its DeepSpeed
    config, or the optimizer ``configure_optimizers`` returned) cannot be honoured; the message names it and what
    would be valid."""
