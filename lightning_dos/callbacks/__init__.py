"""Callbacks: the telemetry monitor, the rich progress display and the model summary."""

from lightning_dos.callbacks.monitor import DOSMonitor
from lightning_dos.callbacks.progress import DOSProgressBar
from lightning_dos.callbacks.summary import DOSModelSummary

__all__ = ["DOSModelSummary", "DOSMonitor", "DOSProgressBar"]
