"""The NVMe drive as the race checker sees it: each request of the tier's staging slabs on a pseudo-stream of its
own, from its issue until the host waits for it (a part of :class:`~lightning_dos.sim.sanitizer.StreamSanitizer`,
which holds the synchronisation state, the log and ``_launch``)."""

from __future__ import annotations

import torch

from lightning_dos.sim.findings import DRIVE, LoggedOp, _caller


class DriveModel:
    """The drive's requests and waits (:class:`~lightning_dos.sim.simdrive.SimSwapFile` reports them)."""

    def drive_request(self, lane: str, buffer: torch.Tensor, sub_group: int = -1) -> int:
        """The host starts an asynchronous request of the drive on ``buffer`` (a staging slab's record):
        ``nvme_read`` fills it, ``nvme_write`` reads it. The request runs beside everything the host does after
        issuing it, and beside every other request, until the host waits for it (:meth:`drive_wait`): a host access
        to the slab, or a second request on it, before that wait is a race. Returns the request's event."""
        if lane not in ("nvme_read", "nvme_write"):
            raise ValueError(f"a drive request is nvme_read or nvme_write, not {lane!r}")
        stream = next(self._drive_requests)
        self.syncs.create_stream(stream)
        reads, writes = ([buffer], []) if lane == "nvme_write" else ([], [buffer])
        self._launch(stream, lane, reads, writes, where=_caller())
        event = next(self._drive_events)
        self.syncs.create_event(event)
        self.syncs.record_state(event, stream)
        nbytes = buffer.numel() * buffer.element_size()
        self._log(LoggedOp("op", DRIVE, lane, buffer.numel(), nbytes, sub_group=sub_group))
        self._log(LoggedOp("record", DRIVE, event=event))
        return event

    def drive_wait(self, event: int) -> None:
        """The host blocks until the drive's request ``event`` is done (``aio_handle.wait``)."""
        self.syncs.stream_wait_for_event(self.host, event)
        self._log(LoggedOp("host_wait", event=event))
