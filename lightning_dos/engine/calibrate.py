"""Micro-benchmarks of this machine's update-phase rates, on buffers like the engine's.

Measures the host update (the engine's one-pass unscale + Adam + cast), split into Adam and what the cast adds
to that pass, and on CUDA
pinned upload and download bandwidth alone and both at once, and device Adam. On a CPU "device" the device
side is the CPU itself: its rates are the host's and ``shared_cpu`` is set, so the model adds host and device
work instead of overlapping them. Well under a second on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lightning_dos.engine.kernels import AdamHyper, adam_update, fused_host_update, step_tensor
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


def _host_update(numel: int, lp_dtype: torch.dtype | None) -> Callable[[], None]:
    """The engine's host update on ``numel`` elements, unscale active, with the cast when ``lp_dtype`` is given."""
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    lp = torch.empty(numel, dtype=lp_dtype) if lp_dtype is not None else None
    step = step_tensor(1, torch.device("cpu"))
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    factor = [2.0]

    def run() -> None:
        # The unscale factor alternates so repeated samples neither shrink the gradient towards denormals nor grow it.
        factor[0] = 1.0 / factor[0]
        fused_host_update(p, g, m, v, step, hyper, factor[0], lp)

    return run


def host_rates(numel: int = 2_000_000, lp_dtype: torch.dtype = torch.bfloat16) -> tuple[float, float, float]:
    """Host Adam elements/s, host cast elements/s, host memcpy bytes/s.

    The engine's host update unscales, runs Adam and casts in one pass; the performance model charges
    ``n / host_adam_eps + n / host_cast_eps`` for it, so Adam's rate is that pass without the cast and the
    cast's rate is what the cast adds to the pass (far less than a cast on its own, which reads from memory).
    """
    adam_s = _best_seconds(_host_update(numel, None))
    full_s = _best_seconds(_host_update(numel, lp_dtype))
    # Noise must not make the cast look free: it always costs at least a small share of the pass.
    cast_s = max(full_s - adam_s, 0.02 * full_s)
    src, dst = torch.rand(numel), torch.empty(numel)
    memcpy = 4 * numel / _best_seconds(lambda: dst.copy_(src))
    return numel / adam_s, numel / cast_s, memcpy


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
