"""Micro-benchmarks of this machine's update-phase rates, on buffers like the engine's.

Measures the host update (the engine's one-pass unscale + Adam + cast), split into Adam and what the cast adds
to that pass, and on CUDA pinned upload and download bandwidth alone and both at once, and device Adam. Host
rates are timed on buffers of :data:`HOST_BUFFER_BYTES` (far beyond any CPU cache, as the engine's slabs are)
and, on CUDA, while uploads and downloads run (they share the host's memory bandwidth, as during the update).
On a CPU "device" the device side is the CPU itself: its rates are the host's and ``shared_cpu`` is set, so the
model adds host and device work instead of overlapping them. About a second on CPU (some 1.2 GB touched once), and
some 0.5 s more for the contention below.

Contention (:func:`measure_contention`): the host update run over and over on a thread of its own, as the engine
runs it under ``overlap``, with beside it (one at a time) the training thread's launch-bound loop (tiny kernel
launches on a GPU, small torch ops on a CPU: what ZeRO-3's hooks are) and the copies (pinned, both ways at once, on
CUDA; a host memcpy of the same size on CPU, where there are no DMA copies); each side's rate is compared with its
rate alone. The shares fill :class:`~lightning_dos.model.perfmodel.HardwareRates`'s ``overlap_*_speed`` fields.

The update timed is the engine's own rule in its own dtypes (``footprint``), where the kernels run it: the
rates returned are converted to the unit :class:`~lightning_dos.model.perfmodel.HardwareRates` keeps (Adam
with fp32 state, :func:`~lightning_dos.model.perfmodel.adam_equivalent`), so the model gives back exactly the
rate measured for that rule and scales it for any other by the bytes each element touches.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lightning_dos.engine.kernels import Hyper, SubGroupTensors, UpdateStep, apply_update, host_update, step_tensor
from lightning_dos.model.perfmodel import HardwareRates, adam_equivalent
from lightning_dos.model.update_rules import ADAM_FP32, Footprint

#: Bytes of each fp32 buffer host rates are timed on: larger than the last-level cache of any CPU (1.1 GB
#: touched by Adam), so that the rates are those of the engine's slabs, which stream from memory.
HOST_BUFFER_BYTES = 256 << 20
#: Fewest elements per host buffer (32 MB of fp32: beyond a typical last-level cache).
MIN_HOST_NUMEL = 8 << 20


def calibration_numel(partition_numel: int) -> int:
    """Elements per host calibration buffer for a rank holding ``partition_numel`` optimizer elements.

    :data:`HOST_BUFFER_BYTES` worth, or the rank's whole partition when that is smaller (the update's real
    working set, so the rate is the one it will see), never below :data:`MIN_HOST_NUMEL`. Four 256 MB buffers
    would otherwise be the largest thing a small model's run ever holds: measured with bench/memory.py, they
    raised a 25M-parameter run's peak host memory to 1.12x (fp32) and 1.45x (bf16) stock offload's.
    """
    return max(MIN_HOST_NUMEL, min(HOST_BUFFER_BYTES // 4, int(partition_numel)))


#: Starts background work lasting about the given seconds; returns a function that waits for it to end.
Busy = Callable[[float], Callable[[], None]]


def _best_seconds(
    fn: Callable[[], None], repeats: int = 3, sync: Callable[[], None] = lambda: None, busy: Busy | None = None
) -> float:
    start = time.perf_counter()
    fn()
    sync()  # warm-up (allocations, kernel selection)
    # Contention covers every timed run; the warm-up (first touch of the pages) is the longest of them.
    wait = busy(2 * repeats * (time.perf_counter() - start)) if busy is not None else None
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    if wait is not None:
        wait()
    return min(samples)


#: Hyperparameters of the timed updates (AdamW's defaults; every rule reads the ones it uses).
HYPER = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def _buffers(footprint: Footprint, numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Master weights, gradient and state tensors of ``footprint`` on ``device``, in its dtypes."""
    master, state = _DTYPES[footprint.master], _DTYPES[footprint.state]
    # Filled, not random: generating a gigabyte of random numbers would take longer than the measurement.
    return (
        torch.full((numel,), 0.5, dtype=master, device=device),
        torch.full((numel,), 0.5, dtype=master, device=device),
        *(torch.full((numel,), 0.5, dtype=state, device=device) for _ in footprint.rule.states),
    )


def _update(
    footprint: Footprint, buffers: tuple[torch.Tensor, ...], lp: torch.Tensor | None = None, host: bool = True
) -> Callable[[], None]:
    """The engine's update of ``footprint``'s rule on ``buffers`` (master weights, gradient, states): on the host
    its one-pass update, unscale active, with the cast into ``lp`` when given; on a device its device kernel."""
    param, grad, *states = buffers
    step = step_tensor(1, param.device)
    # Made once, outside the timed calls: the engine makes one of each per sub-group, as large as these buffers.
    tensors = SubGroupTensors(param, grad, states, lp if host else None)
    factor = [2.0]

    def run() -> None:
        # The unscale factor alternates so repeated samples neither shrink the gradient towards denormals nor grow it.
        factor[0] = 1.0 / factor[0]
        if host:
            host_update(footprint.rule, tensors, UpdateStep(step, HYPER, factor[0]))
        else:
            apply_update(footprint.rule, tensors, UpdateStep(step, HYPER, step_number=1))

    return run


def _adam(device: torch.device, numel: int, footprint: Footprint = ADAM_FP32) -> Callable[[], None]:
    """The engine's device update of ``footprint`` on ``numel`` elements of ``device``."""
    return _update(footprint, _buffers(footprint, numel, device), host=False)


def host_rates(
    numel: int = HOST_BUFFER_BYTES // 4,
    lp_dtype: torch.dtype = torch.bfloat16,
    busy: Busy | None = None,
    *,
    footprint: Footprint = ADAM_FP32,
) -> tuple[float, float, float]:
    """Host update elements/s of ``footprint``'s rule and dtypes (as measured, not converted), host cast
    elements/s, host memcpy bytes/s, on buffers of ``numel`` elements, each timed while ``busy`` work
    (transfers) runs, when given.

    The engine's host update unscales, updates and casts in one pass; the performance model charges
    ``n / host_adam_eps + n / host_cast_eps`` for it, so the update's rate is that pass without the cast and the
    cast's rate is what the cast adds to the pass (far less than a cast on its own, which reads from memory).
    """
    # One set of buffers for every kernel, filled rather than random: first touches of fresh pages and random
    # numbers for a gigabyte would cost more than the kernels themselves.
    buffers = _buffers(footprint, numel, torch.device("cpu"))
    lp = torch.empty(numel, dtype=lp_dtype)
    adam_s = _best_seconds(_update(footprint, buffers), busy=busy)
    full_s = _best_seconds(_update(footprint, buffers, lp), busy=busy)
    # Noise must not make the cast look free: it always costs at least a small share of the pass.
    cast_s = max(full_s - adam_s, 0.02 * full_s)
    # The update's buffers go before the copy's are allocated: held together they were six fp32 buffers and the
    # cast's, 26 B per calibrated element, which for a partition under HOST_BUFFER_BYTES made set-up the run's
    # host peak (issue 32: bf16-mixed at 1.11x stock offload's). Apart, the peak is the update's 18 B.
    del buffers, lp
    p, m = (torch.full((numel,), 0.5) for _ in range(2))
    memcpy = 4 * numel / _best_seconds(lambda: m.copy_(p), busy=busy)
    return numel / adam_s, numel / cast_s, memcpy


#: Bytes of each timed copy between host and device.
COPY_BYTES = 64 << 20


class _PinnedCopies:
    """Pinned host buffers, device buffers and a stream per direction: an upload, a download, or both at once, as
    the engine's update moves its state (``device`` is a CUDA device)."""

    def __init__(self, device: torch.device, nbytes: int = COPY_BYTES) -> None:
        self.nbytes = nbytes
        self.host_up = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.up_stream, self.down_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def upload(self) -> None:
        with torch.cuda.stream(self.up_stream):
            self.dev_a.copy_(self.host_up, non_blocking=True)

    def download(self) -> None:
        with torch.cuda.stream(self.down_stream):
            self.host_down.copy_(self.dev_b, non_blocking=True)

    def both(self) -> None:
        self.upload()
        self.download()


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> tuple[float, float]:
    """Peak host-to-device and device-to-host copy rates (bytes/s): pinned copies on their own streams, timed as
    :func:`calibrate` times them. On a CPU "device" both directions are a host memcpy, which is what the engine's
    transfers are there."""
    if device.type != "cuda":
        src, dst = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        rate = nbytes / max(_best_seconds(lambda: dst.copy_(src)), 1e-9)
        return rate, rate
    copies = _PinnedCopies(device, nbytes)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    return nbytes / _best_seconds(copies.upload, sync=sync), nbytes / _best_seconds(copies.download, sync=sync)


#: Elements of each buffer contention is timed on, at most: beyond a typical last-level cache (the update then
#: streams from memory, as the engine's slabs do) and a few tens of milliseconds per pass on a CPU.
CONTENTION_NUMEL = MIN_HOST_NUMEL
#: Passes of the host update each side of the contention measurement is timed over (the first one dropped).
CONTENTION_PASSES = 4
#: Pairs of small ops in one sample of the training thread's loop (about a millisecond on a CPU).
LAUNCH_OPS = 100
#: Samples of the loop timed alone (their median is the reference).
LAUNCH_SAMPLES = 15
#: Lowest share a contended rate is taken at: below it the measurement is noise on a machine lent to other work.
MIN_SPEED = 0.05


@dataclass(frozen=True)
class Contention:
    """The host update and the training thread side by side, the update on ``threads`` intra-op threads of a thread
    of its own (as the engine runs it under ``overlap``).

    Attributes:
        threads: the update's intra-op threads.
        host_s_per_element: seconds per element of the update alone (unscale, update and cast in one pass).
        host_speed: its rate beside the training thread's loop, as a share of its rate alone.
        launch_speed: the training thread's loop's rate beside the update, as a share of its rate alone.
        copy_speed: the copies' rate beside the update, as a share of their rate alone.
    """

    threads: int
    host_s_per_element: float
    host_speed: float
    launch_speed: float
    copy_speed: float


class _Repeating:
    """Runs ``fn`` over and over on a thread of its own with ``threads`` intra-op threads, recording the seconds of
    each run, from ``with`` until its end."""

    def __init__(self, fn: Callable[[], None], threads: int) -> None:
        self.seconds: list[float] = []
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, threads), name="lightning-dos-calibrate")

    def _run(self, fn: Callable[[], None], threads: int) -> None:
        torch.get_num_threads()  # torch sets a thread's count lazily from the process-wide one: do it now ...
        torch.set_num_threads(threads)  # ... then this thread's own (OpenMP keeps it per thread)
        self._ready.set()
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                fn()
                self.seconds.append(time.perf_counter() - start)
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread by runs()
            self._error = error

    def __enter__(self) -> _Repeating:
        caller = torch.get_num_threads()
        self._thread.start()
        self._ready.wait()
        torch.set_num_threads(caller)  # the thread's call also set torch's process-wide default: the caller's back
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def runs(self) -> int:
        """Runs done so far; raises what ``fn`` raised, if it did."""
        if self._error is not None:
            raise self._error
        return len(self.seconds)

    def runs_after(self, done: int) -> list[float]:
        """The runs begun after the first ``done`` had ended (the one in progress then is left out)."""
        return self.seconds[done + 1 :]

    def wait_runs(self, count: int) -> None:
        while self.runs() < count:
            time.sleep(0.001)


def _launch_loop(device: torch.device) -> Callable[[], None]:
    """The training thread's launch-bound work: :data:`LAUNCH_OPS` pairs of small in-place ops, on CUDA tiny
    kernels (each launch costs far more than its work), then a synchronize; on a CPU small torch ops, whose
    dispatch costs far more than their arithmetic, as ZeRO-3's hooks' do."""
    x, y = torch.zeros(256, device=device), torch.ones(256, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def run() -> None:
        for _ in range(LAUNCH_OPS):
            x.mul_(0.5).add_(y)
        sync()

    return run


def _copy(device: torch.device, nbytes: int) -> Callable[[], None]:
    """One copy of ``nbytes``: pinned, both ways at once, on CUDA; a host memcpy on a CPU "device"."""
    if device.type == "cuda":
        copies = _PinnedCopies(device, nbytes)

        def both() -> None:
            copies.both()
            torch.cuda.synchronize(device)

        return both
    src, dst = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)  # noqa: E731 - one expression


def _median_seconds(fn: Callable[[], None], samples: int) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _share(alone_s: float, contended_s: float) -> float:
    # Contention never speeds anything up: a share above 1 is noise.
    return min(1.0, max(MIN_SPEED, alone_s / max(contended_s, 1e-12)))


def measure_contention(
    device: torch.device,
    numel: int = CONTENTION_NUMEL,
    threads: int | None = None,
    lp_dtype: torch.dtype = torch.bfloat16,
    *,
    footprint: Footprint = ADAM_FP32,
    sub_group: int | None = None,
) -> Contention:
    """Time the host update alone and beside the training thread's loop, the loop alone and beside the update, and
    the copies alone and beside the update (medians of each: the same statistic alone and contended).

    Args:
        device: the engine's device (the loop's and the copies' kind follow it).
        numel: elements of the update's buffers, at most (:data:`CONTENTION_NUMEL`, or one sub-group when larger).
        threads: the update's intra-op threads (None: torch's count on the calling thread).
        lp_dtype: the 16-bit type of the update's cast.
        footprint: the engine's rule and dtypes: its one-pass host update is the one run.
        sub_group: elements the engine updates per call (its sub-groups); None: the whole buffer at once. Between
            two calls the update's thread needs Python's lock, which the training thread's loop holds up to
            ``sys.getswitchinterval()`` (5 ms) at a time: the smaller the sub-groups, the more that costs.
    """
    threads = threads or torch.get_num_threads()
    numel = max(1, min(int(numel), max(CONTENTION_NUMEL, sub_group or 0)))
    # The copies' two buffers come out of the update's: together they hold no more host memory than the host
    # rates' buffers of ``numel`` elements (calibration must not raise a run's host peak: a bf16-mixed fit's went
    # from 27.9 to 34.9 B/param with 64 MB copies beside them).
    per_element = footprint.streamed_up + torch.empty((), dtype=lp_dtype).element_size()  # _buffers and lp
    copy_bytes = min(COPY_BYTES, 4 * numel)
    numel = max(1, numel - 2 * copy_bytes // per_element)
    chunk = max(1, min(sub_group or numel, numel))
    buffers, lp = _buffers(footprint, numel, torch.device("cpu")), torch.empty(numel, dtype=lp_dtype)
    parts = [
        _update(footprint, tuple(b[start : start + chunk] for b in buffers), lp[start : start + chunk])
        for start in range(0, numel, chunk)
    ]

    def update() -> None:
        for part in parts:
            part()

    loop, copy = _launch_loop(device), _copy(device, copy_bytes)
    loop(), copy()  # warm-up (allocations, first touches, kernel selection)
    loop_alone = _median_seconds(loop, LAUNCH_SAMPLES)
    copy_alone = _median_seconds(copy, 3)
    with _Repeating(update, threads) as alone:
        alone.wait_runs(CONTENTION_PASSES + 1)
    update_alone = statistics.median(alone.runs_after(0))
    with _Repeating(update, threads) as beside:
        beside.wait_runs(1)
        start, loops = beside.runs(), []
        while beside.runs() < start + 1 + CONTENTION_PASSES or len(loops) < LAUNCH_SAMPLES:
            began = time.perf_counter()
            loop()
            loops.append(time.perf_counter() - began)
        passes = beside.runs_after(start)
        copy_beside = _median_seconds(copy, 3)
    return Contention(
        threads,
        update_alone / numel,
        _share(update_alone, statistics.median(passes)),
        _share(loop_alone, statistics.median(loops)),
        _share(copy_alone, copy_beside),
    )


def calibrate(
    device: torch.device,
    numel: int = HOST_BUFFER_BYTES // 4,
    lp_dtype: torch.dtype = torch.bfloat16,
    *,
    footprint: Footprint = ADAM_FP32,
    contention: Contention | None = None,
    sub_group: int | None = None,
) -> HardwareRates:
    """Measure the rates the performance model needs, for the engine on ``device``.

    Args:
        device: the engine's device; on CUDA, transfers and device Adam are measured too.
        numel: elements of each buffer host rates are timed on.
        lp_dtype: the 16-bit type of the host cast.
        footprint: the engine's optimizer rule and dtypes: its update is the one timed, and the rates come back in
            Adam-with-fp32-state units (the unit profiles hold; the model scales them back per rule and dtype).
        contention: :func:`measure_contention` already run for this device and the update's thread count (the
            strategy measures it to choose ``host_threads``); None measures it here.
        sub_group: the engine's sub-group size, for the contention measured here (None: unknown).
    """
    timed = footprint
    if device.type != "cuda":
        adam, cast, memcpy = host_rates(numel, lp_dtype, footprint=timed)
        rates = HardwareRates(adam, cast, adam, memcpy, memcpy, memcpy / 2, memcpy / 2, shared_cpu=True)
        return _with_contention(adam_equivalent(rates, timed), device, numel, lp_dtype, timed, contention, sub_group)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    copies = _PinnedCopies(device)
    nbytes, upload, download, both = copies.nbytes, copies.upload, copies.download, copies.both

    h2d = nbytes / _best_seconds(upload, sync=sync)
    d2h = nbytes / _best_seconds(download, sync=sync)
    # Both at once: each direction moved nbytes in the time both took.
    duplex = nbytes / _best_seconds(both, sync=sync)
    device_numel = 16_000_000
    device_adam = device_numel / _best_seconds(_adam(device, device_numel, timed), sync=sync)

    def transfers(seconds: float) -> Callable[[], None]:
        # Queued copies run on their streams while the host works; enough of them to last `seconds`.
        for _ in range(max(1, math.ceil(seconds * min(h2d, d2h) / nbytes))):
            both()
        return sync

    adam, cast, _ = host_rates(numel, lp_dtype, busy=transfers, footprint=timed)
    rates = HardwareRates(adam, cast, device_adam, h2d, d2h, min(duplex, h2d), min(duplex, d2h))
    return _with_contention(adam_equivalent(rates, timed), device, numel, lp_dtype, timed, contention, sub_group)


def _with_contention(
    rates: HardwareRates,
    device: torch.device,
    numel: int,
    lp_dtype: torch.dtype,
    footprint: Footprint,
    contention: Contention | None,
    sub_group: int | None,
) -> HardwareRates:
    """``rates`` with the ``overlap_*_speed`` shares of ``contention`` (measured now when None)."""
    if contention is None:
        contention = measure_contention(device, numel, lp_dtype=lp_dtype, footprint=footprint, sub_group=sub_group)
    return replace(
        rates,
        overlap_copy_speed=contention.copy_speed,
        overlap_host_speed=contention.host_speed,
        overlap_launch_speed=contention.launch_speed,
    )
