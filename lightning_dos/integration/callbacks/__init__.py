"""Callbacks: the telemetry monitor, the rich progress display and the model summary."""

from lightning_dos.integration.callbacks.monitor import DOSMonitor
from lightning_dos.integration.callbacks.progress import DOSProgressBar
from lightning_dos.integration.callbacks.summary import DOSModelSummary

__all__ = ["DOSModelSummary", "DOSMonitor", "DOSProgressBar"]
