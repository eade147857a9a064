"""The engine's host slabs (issue 19, points 3, 4 and 7): excluded from forks, unpinned at teardown, and a
refused registration falls back to pageable memory with one warning.

On CPU nothing is pinned for real; a registrar (what ``cudaHostRegister`` is on CUDA) is injected through
:func:`lightning_dos.engine.hostslab.use_registrar`, so the real Trainer builds, registers and releases the
slabs through the same code as on a GPU, and the registrar sees every registration.
"""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine import hostslab
from lightning_dos.engine.pool import BufferPool
from lightning_dos.sim.sanitizer import StreamSanitizer
from tests.helpers import TinyLM, full_parameters, loader, trainer


class RecordingRegistrar:
    """Registers nothing real (no CUDA here); keeps what is registered now, as the driver would."""

    name = "cudaHostRegister"

    def __init__(self, refuse_after: int | None = None, code: int = 2) -> None:
        self.live: dict[int, int] = {}
        self.calls = 0
        self.refuse_after, self.code = refuse_after, code

    def register(self, address: int, nbytes: int) -> int:
        self.calls += 1
        if self.refuse_after is not None and self.calls > self.refuse_after:
            return self.code  # cudaErrorMemoryAllocation, as a container runtime that refuses pinning returns
        assert address % mmap.PAGESIZE == 0 and address not in self.live
        self.live[address] = nbytes
        return 0

    def unregister(self, address: int) -> None:
        del self.live[address]


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` in this process (empty when none does)."""
    inside, flags = False, []
    for line in open("/proc/self/smaps").read().splitlines():  # noqa: SIM115 - read at once
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    return flags


def _child_rss_after_fork() -> tuple[int, bool]:
    """Fork; the child reports its resident set and whether it could read ``/proc/self/status``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: touches nothing of the parent's tensors, reports and leaves
        try:
            rss = hostslab_rss()
            os.write(write, str(rss).encode())
        finally:
            os._exit(0)
    os.close(write)
    text = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    return int(text), True


def hostslab_rss() -> int:
    for line in open("/proc/self/status").read().splitlines():  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# -- point 4: slabs are page-aligned mappings that forked children neither map nor copy -------------------


def check_fork_excludes_the_slabs() -> None:
    """The check itself, run in a fresh process: forking a long test session's large address space can fail
    with ENOMEM on a small machine, which says nothing about the slabs."""
    numel = 16 << 20  # 64 MB per fp32 slab, 192 MB for the three
    with hostslab.use_registrar(RecordingRegistrar()):
        pool = BufferPool(numel, torch.bfloat16, torch.device("cpu"))
    slabs = (pool.param, pool.state("exp_avg"), pool.state("exp_avg_sq"))
    for slab in slabs:
        assert slab.data_ptr() % mmap.PAGESIZE == 0
        assert "dc" in _vm_flags(slab.data_ptr()), "MADV_DONTFORK (VmFlags 'dc') must be set before registration"
        slab.fill_(1.0)  # resident now, as the state is during training
    assert pool.pinned and pool.pinned_bytes == 3 * 4 * numel
    # An ordinary tensor of the same size is copied-on-write into a child, and counted in its resident set ...
    ordinary = torch.ones(3 * numel)
    parent = hostslab_rss()
    child, _ = _child_rss_after_fork()
    slab_bytes = 3 * 4 * numel
    # ... the slabs are not mapped into the child at all: its resident set lacks them (and only them).
    assert child < parent - 0.9 * slab_bytes, (parent, child)
    assert child > 0.9 * ordinary.numel() * 4, "the control (an ordinary tensor) must still be in the child"
    pool.release_host()


def test_host_slabs_are_page_aligned_mappings_marked_dontfork_and_a_forked_child_does_not_hold_them() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    code = "from tests.test_host_slabs import check_fork_excludes_the_slabs as check; check(); print('checked')"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "checked" in done.stdout, done.stdout + done.stderr[-3000:]


# -- point 3: teardown unpins; repeated fits in one process do not accumulate pinned memory ---------------


def test_closing_a_slab_unpins_at_once_and_unmaps_with_its_last_view() -> None:
    registrar = RecordingRegistrar()
    slab = hostslab.HostSlab(3 * mmap.PAGESIZE, torch.float32)
    assert slab.pin(registrar) == 0 and registrar.live == {slab.address: slab.nbytes}
    view = slab.tensor[5:9]
    view.fill_(2.0)
    assert slab.close() is False  # a view still exports the mapping: it is not unmapped under that view ...
    assert registrar.live == {} and not slab.registered  # ... but it is unpinned now
    assert slab.mapped and view.sum().item() == 8.0  # and the view reads valid memory
    del view
    assert not slab.mapped  # the last view took the mapping with it
    lone = hostslab.HostSlab(1000, torch.bfloat16)
    assert lone.close() is True and not lone.mapped  # nothing views it: unmapped at once


class PinnedWhileFitting(L.Callback):
    def __init__(self) -> None:
        self.pinned_bytes: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.pinned_bytes.append(hostslab.registered_bytes())


def test_repeated_fits_in_one_process_do_not_accumulate_pinned_or_ring_memory() -> None:
    """Three fits, each with a new Trainer and strategy, every one of them kept alive (a notebook): what each
    fit pinned is unregistered by its teardown, its 16-bit ring unmapped, and its state still readable."""
    registrar, kept = RecordingRegistrar(), []
    gc.collect()  # slabs of earlier tests' dead objects go now, not in the middle of this count
    before = hostslab.live_bytes()
    with hostslab.use_registrar(registrar):
        for run in range(3):
            watch = PinnedWhileFitting()
            strategy = DeepOptimizerStatesStrategy(
                gpu_fraction=0.5, sub_group_size=700, streams_factory=StreamSanitizer().streams
            )
            L.seed_everything(run, verbose=False)
            fitted = trainer(strategy, steps=3, callbacks=(watch,))
            fitted.fit(TinyLM(), loader())
            pool = strategy.dos_engine.pool
            ring = pool._ring_slab
            assert pool.lp_staging is None and ring is not None and ring.closed and not ring.mapped  # unmapped
            ring_bytes = ring.nbytes
            # While fitting, exactly this fit's slabs were pinned (the ring included) ...
            assert watch.pinned_bytes and set(watch.pinned_bytes) == {pool.host_bytes}
            # ... and after it nothing is: not this fit's, nor any earlier one's.
            assert registrar.live == {} and hostslab.registered_bytes() == 0
            assert pool.pinned_bytes == 0 and not pool.pinned
            # The state of record stays readable after fit (a checkpoint saved then reads it).
            assert torch.isfinite(pool.param).all() and pool.state("exp_avg_sq").abs().sum() > 0
            kept.append(fitted)
            # What stays mapped is the fp32 state of the live trainers, never a ring.
            gc.collect()
            assert hostslab.live_bytes() - before == (run + 1) * (pool.host_bytes - ring_bytes)


# -- point 7: a refused registration falls back to pageable memory, with one warning ---------------------


def _fit_params(registrar: RecordingRegistrar | None) -> tuple[dict[str, torch.Tensor], list[str], object]:
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction=0.5, sub_group_size=700, streams_factory=StreamSanitizer().streams
    )
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    with warnings.catch_warnings(record=True) as caught, hostslab.use_registrar(registrar):
        warnings.simplefilter("always")
        trainer(strategy, steps=4).fit(model, loader())
    ours = [str(w.message) for w in caught if "lightning-dos" in str(w.message)]
    return full_parameters(model), ours, strategy.dos_engine.pool


@pytest.mark.parametrize("refuse_after", [0, 2], ids=["first slab refused", "third slab refused"])
def test_a_refused_registration_falls_back_to_pageable_memory_with_one_warning(refuse_after: int) -> None:
    registrar = RecordingRegistrar(refuse_after=refuse_after)
    params, warned, pool = _fit_params(registrar)
    assert len(warned) == 1, warned
    message = warned[0]
    assert "cudaHostRegister refused" in message and "pageable" in message and "ulimit -l" in message
    assert "synchronous" in message  # the cost is named
    # Nothing stays registered (the slabs pinned before the refusal were unpinned), and training went on ...
    assert registrar.live == {} and not pool.pinned and pool.pinned_bytes == 0
    # ... to the same parameters as with pinned slabs.
    pinned_params, quiet, _ = _fit_params(RecordingRegistrar())
    assert quiet == []
    for key, value in pinned_params.items():
        assert torch.equal(params[key], value), key


# -- issue 32, point 5: the simulated accelerator's registrar faults pages in, as cudaHostRegister does -----------


def test_the_simulated_accelerators_registrar_faults_in_every_page_and_keeps_their_contents() -> None:
    """``cudaHostRegister`` pins, so every page of the range becomes resident; the simulated accelerator's
    registrar does the same on CPU (and pins nothing), so start-up's host peak shows on CPU where a GPU node's
    would. An explicit ``use_registrar`` block still chooses its own."""
    from lightning_dos.sim.simstreams import SimStreams

    registrar = SimStreams(torch.device("cpu")).host_registrar()
    assert isinstance(registrar, hostslab.FaultingRegistrar)
    with hostslab.use_registrar(RecordingRegistrar()):
        assert isinstance(SimStreams(torch.device("cpu")).host_registrar(), RecordingRegistrar)
    slab = hostslab.HostSlab(32 << 20, torch.float32)  # 128 MB of zero pages: nothing resident yet
    written = torch.arange(0, slab.tensor.numel(), 12345)
    slab.tensor[written] = written.float()
    before = hostslab_rss()
    assert slab.pin(registrar) == 0 and slab.registered
    assert hostslab_rss() - before > 0.9 * slab.nbytes
    assert torch.equal(slab.tensor[written], written.float())  # the pages keep what they held ...
    assert torch.count_nonzero(slab.tensor) == torch.count_nonzero(written)  # ... and nothing else is written
    slab.close()
