"""Callbacks: the telemetry monitor and the rich progress display."""

from lightning_dos.callbacks.monitor import DOSMonitor
from lightning_dos.callbacks.progress import DOSProgressBar

__all__ = ["DOSMonitor", "DOSProgressBar"]
