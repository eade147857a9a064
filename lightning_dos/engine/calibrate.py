"""Micro-benchmarks of this machine's update-phase rates, on buffers like the engine's.

Measures host Adam (torch's fused kernel, the one the engine runs), the host cast to 16 bits, and on CUDA
pinned upload and download bandwidth alone and both at once, and device Adam. On a CPU "device" the device
side is the CPU itself: its rates are the host's and ``shared_cpu`` is set, so the model adds host and device
work instead of overlapping them. Well under a second on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lightning_dos.engine.kernels import AdamHyper, adam_update, step_tensor
from lightning_dos.engine.perfmodel import HardwareRates


def _best_seconds(fn: Callable[[], None], repeats: int = 3, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()  # warm-up (allocations, kernel selection)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return min(samples)


def _adam(device: torch.device, numel: int) -> Callable[[], None]:
    """The engine's Adam kernel on ``numel`` elements of ``device``."""
    p, g, m, v = (torch.rand(numel, device=device) for _ in range(4))
    step = step_tensor(1, device)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    return lambda: adam_update(p, g, m, v, step, hyper)


def host_rates(numel: int = 2_000_000, lp_dtype: torch.dtype = torch.bfloat16) -> tuple[float, float, float]:
    """Host Adam elements/s, host cast elements/s, host memcpy bytes/s."""
    adam = numel / _best_seconds(_adam(torch.device("cpu"), numel))
    src, lp, dst = torch.rand(numel), torch.empty(numel, dtype=lp_dtype), torch.empty(numel)
    cast = numel / _best_seconds(lambda: lp.copy_(src))
    memcpy = 4 * numel / _best_seconds(lambda: dst.copy_(src))
    return adam, cast, memcpy


def calibrate(device: torch.device, numel: int = 2_000_000, lp_dtype: torch.dtype = torch.bfloat16) -> HardwareRates:
    """Measure the rates the performance model needs, for the engine on ``device``."""
    adam, cast, memcpy = host_rates(numel, lp_dtype)
    if device.type != "cuda":
        return HardwareRates(adam, cast, adam, memcpy, memcpy, memcpy / 2, memcpy / 2, shared_cpu=True)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    nbytes = 64 << 20
    host_up = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up_stream, down_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def upload() -> None:
        with torch.cuda.stream(up_stream):
            dev_a.copy_(host_up, non_blocking=True)

    def download() -> None:
        with torch.cuda.stream(down_stream):
            host_down.copy_(dev_b, non_blocking=True)

    def both() -> None:
        upload()
        download()

    h2d = nbytes / _best_seconds(upload, sync=sync)
    d2h = nbytes / _best_seconds(download, sync=sync)
    # Both at once: each direction moved nbytes in the time both took.
    duplex = nbytes / _best_seconds(both, sync=sync)
    device_adam = 8 * numel / _best_seconds(_adam(device, 8 * numel), sync=sync)
    return HardwareRates(adam, cast, device_adam, h2d, d2h, min(duplex, h2d), min(duplex, d2h))
