"""The pinned-buffer pool: host slabs the engine owns, and device staging that lives only in the update.

Host side, allocated once: three fp32 slabs (master weights, first and second moments) holding every
sub-group back to back, and, when the 16-bit parameters live on an accelerator, one staging slab of
the model's dtype into which host-updated sub-groups are cast before their asynchronous upload. A
few large slabs instead of a tensor per sub-group keep pinning cheap (one ``cudaHostAlloc`` each)
and let DeepSpeed's flat partitions and optimizer state be views into them.

Device side: N staging buffers, each able to hold one device sub-group's fp32 param, moments and
gradient, allocated at the start of an update and released at its end, so forward and backward get
that memory back through the caching allocator. Resident sub-groups keep their state on the device
across iterations instead, in blocks of their own.

Pinning needs CUDA; without it the slabs are ordinary pageable memory and the results are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP32_BYTES = 4
#: Device staging bytes per element of a streamed sub-group: param, exp_avg, exp_avg_sq, grad.
STAGING_BYTES_PER_ELEMENT = 4 * FP32_BYTES


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


@dataclass
class DeviceBuffer:
    """One device staging slot: fp32 param, exp_avg, exp_avg_sq and grad of up to ``capacity`` elements."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.param.numel()


class BufferPool:
    """Host slabs for every sub-group's fp32 state and 16-bit staging; device staging on demand.

    Args:
        total_numel: elements in the rank's fp32 partition (all sub-groups).
        lp_dtype: dtype of the model's parameters (bf16, fp16 or fp32), for the staging slab.
        device: where the 16-bit parameters live; a CPU device needs no 16-bit staging.
        pin: pin the host slabs (ignored, with pageable memory used instead, when CUDA is absent).
        stage_lp: keep a host staging slab for 16-bit uploads; None decides by the device (not on a CPU
            device). A simulated accelerator sets it so that its staging path runs on CPU.
        allocate: allocates ``(numel, dtype)`` of device memory; None uses ``torch.empty`` on ``device``.
    """

    def __init__(
        self,
        total_numel: int,
        lp_dtype: torch.dtype,
        device: torch.device,
        pin: bool = True,
        stage_lp: bool | None = None,
        allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self._allocate = allocate or (lambda numel, dtype: torch.empty(numel, dtype=dtype, device=device))
        self.pinned = bool(pin and torch.cuda.is_available())
        self.param = _host_empty(total_numel, torch.float32, self.pinned)
        self.exp_avg = _host_empty(total_numel, torch.float32, self.pinned).zero_()
        self.exp_avg_sq = _host_empty(total_numel, torch.float32, self.pinned).zero_()
        # The 16-bit copy of a host sub-group needs a host staging area only when it must cross PCIe.
        stage_lp = device.type != "cpu" if stage_lp is None else stage_lp
        self.lp_staging = _host_empty(total_numel, lp_dtype, self.pinned) if stage_lp else None
        self.device_bytes_in_use = 0
        #: Device bytes held across iterations by resident sub-groups (param, moments, gradient).
        self.resident_bytes = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (pinned when :attr:`pinned`)."""
        slabs = [self.param, self.exp_avg, self.exp_avg_sq, self.lp_staging]
        return sum(t.numel() * t.element_size() for t in slabs if t is not None)

    def allocate_device(self, count: int, capacity: int) -> list[DeviceBuffer]:
        """Allocate ``count`` device staging buffers of ``capacity`` elements (may raise OutOfMemoryError).

        One allocation per buffer, cut into four views, so an out-of-memory error leaves nothing
        half-allocated.
        """
        buffers = []
        for _ in range(count):
            block = self._allocate(4 * capacity, torch.float32)
            buffers.append(DeviceBuffer(*block.split(capacity)))
        self.device_bytes_in_use = count * capacity * STAGING_BYTES_PER_ELEMENT
        return buffers

    def allocate_resident(self, capacity: int) -> DeviceBuffer:
        """Persistent device state for one resident sub-group (may raise OutOfMemoryError)."""
        block = self._allocate(4 * capacity, torch.float32)
        self.resident_bytes += 4 * capacity * FP32_BYTES
        return DeviceBuffer(*block.split(capacity))

    def release_resident(self, buffer: DeviceBuffer) -> None:
        self.resident_bytes -= buffer.capacity * STAGING_BYTES_PER_ELEMENT

    def release_device(self) -> None:
        """Forget the device staging size (the tensors themselves are dropped by the caller)."""
        self.device_bytes_in_use = 0

    def describe(self) -> dict[str, int | bool]:
        """What the pool holds, for logs and the monitor."""
        return {
            "host_bytes": self.host_bytes,
            "pinned": self.pinned,
            "elements": self.param.numel(),
            "device_staging_bytes": self.device_bytes_in_use,
            "device_resident_bytes": self.resident_bytes,
        }
