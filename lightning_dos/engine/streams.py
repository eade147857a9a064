"""Transfer streams and events, with a synchronous stand-in on a CPU "device".

On CUDA the engine uses three side streams: ``h2d`` uploads device sub-groups' fp32 state,
``lp_h2d`` uploads host-cast 16-bit parameters, ``d2h`` downloads updated state. Host-side 16-bit
uploads get a stream of their own so that they never queue behind a device upload that is waiting
for a free staging buffer (a FIFO stream would hold them, and the PCIe link, idle). Kernels run on
the caller's current stream.

On a CPU device every operation is synchronous, so streams and events are no-ops; the engine's code
path is the same, which is how CI on a machine with no GPU exercises every branch of the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Streams:
    """The engine's side streams on ``device`` (no-ops on CPU)."""

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        self.timing = timing
        if self.is_async:
            self.h2d = torch.cuda.Stream(device)
            self.lp_h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.lp_h2d = self.d2h = None

    @property
    def compute(self) -> torch.cuda.Stream | None:
        """Kernels run on the caller's current stream, read at each use (the caller may change it)."""
        return torch.cuda.current_stream(self.device) if self.is_async else None

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Issue the enclosed work on ``stream`` (nothing to switch on CPU)."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Record an event at the current tail of ``stream``; None on CPU, where work is already done."""
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        """Make ``stream`` wait (on the device, not the host) for ``event``."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def host_wait(event: torch.cuda.Event | None) -> None:
        """Block the host until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def device_synchronize(self) -> None:
        """Wait for all work on the device, DeepSpeed's side streams included."""
        if self.is_async:
            torch.cuda.synchronize(self.device)
