"""GPU-only checks of the engine: CUDA streams, pinned memory and the memory budget.

These run in the CUDA pass (``pytest --accelerator cuda tests/test_gpu.py``, which ``scripts/test.sh`` and
``scripts/gpu-check.sh`` run where CUDA is present); on a machine with no GPU the same code paths are covered
by the CPU tests, minus the asynchrony.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.pool import STAGING_BYTES_PER_ELEMENT
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, max_relative_error, trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


#: Our engine against torch.optim.AdamW(fused=True) on the GPU over 20 steps. On CPU both compute the same formula
#: bit for bit (FP32_RTOL covers DeepSpeed's gradient path); here the reference's update runs in CUDA's fused kernel
#: and ours on the host's compiled one (or, on device sub-groups, torch's formula in separate CUDA kernels), which
#: round differently: 1.98e-5 with every sub-group on the host (an H100, 2026-11-26). A stale or overwritten tensor
#: is off by about lr (1e-3 here) per step.
CUDA_RTOL = 5e-5


def fit(strategy, steps: int = 20, callbacks=(), precision: str = "32-true", **kw) -> TinyLM:  # noqa: ANN001
    """``steps`` of TinyLM on the GPU. Plain Lightning (``"auto"``) runs torch.optim.AdamW(fused=True), whose
    formula the engine's kernels compute: the reference at CUDA_RTOL (the per-op AdamW is itself 1.09e-5 from the
    fused one). The engine reads only the optimizer's hyperparameters, as in tests/test_equivalence.py."""
    L.seed_everything(0, verbose=False)
    # Lightning refuses gradient clipping with a fused optimizer under mixed precision (it unscales internally).
    kw.setdefault("fused", strategy == "auto" and precision == "32-true")
    model = TinyLM(**kw)
    trainer(strategy, steps=steps, precision=precision, callbacks=callbacks, accelerator="cuda").fit(model, loader())
    return model


class PinnedWhileFitting(L.Callback):
    """Whether the host slabs are registered (pinned) at the end of each batch."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        self.seen.append(trainer.strategy.dos_engine.pool.pinned)


@pytest.mark.parametrize("fraction", [0, 0.25, 0.5, 1])
def test_cuda_placements_match_plain_adamw(fraction: float) -> None:
    reference = full_parameters(fit("auto"))
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=700)
    pinned = PinnedWhileFitting()
    model = fit(strategy, callbacks=[pinned])
    assert pinned.seen and all(pinned.seen)  # teardown unregisters the slabs: look while fitting
    assert max_relative_error(full_parameters(model), reference) < CUDA_RTOL


def test_stress_many_small_sub_groups_random_plan_every_step() -> None:
    """200 steps, ~130 sub-groups of 64 elements, a new random plan each step: a copy racing a kernel
    (stale upload, early download, reused buffer) would leave garbage far beyond float tolerance.

    The host's compiled kernel and CUDA's kernels round differently, and over 200 steps that compounds (2e-5
    after 20 steps): the bound is what the two fixed placements, every sub-group on the host and every one on the
    device, differ from the reference by over the same steps, not a fixed figure."""
    steps = 200
    reference = full_parameters(fit("auto", steps=steps))

    def error(strategy: DeepOptimizerStatesStrategy, callbacks=()) -> float:  # noqa: ANN001
        return max_relative_error(full_parameters(fit(strategy, steps=steps, callbacks=callbacks)), reference)

    rounding = max(error(DeepOptimizerStatesStrategy(gpu_fraction=f, sub_group_size=64)) for f in (0.0, 1.0))
    placement = RandomPlacement(seed=3)
    random_plans = error(DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=64), [placement])
    assert len(placement.plans) == steps
    # A mix of the two placements rounds like them; a stale tensor is off by about lr (1e-3) per step.
    assert random_plans <= 2 * rounding + CUDA_RTOL, (random_plans, rounding)


class UpdatePeak(L.Callback):
    def __init__(self) -> None:
        self.extra: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.extra.append(torch.cuda.max_memory_allocated() - self.base)


def test_update_phase_stays_within_the_memory_budget() -> None:
    budget = 2 * 700 * STAGING_BYTES_PER_ELEMENT  # two staging buffers of the largest sub-group
    peak = UpdatePeak()
    fit(DeepOptimizerStatesStrategy(gpu_fraction=1.0, sub_group_size=700, gpu_memory_budget=budget), callbacks=[peak])
    slack = 64 * 1024  # step tensors and the allocator's rounding of small blocks
    assert max(peak.extra) <= budget + slack, peak.extra


def test_bf16_on_cuda_learns_and_tracks_plain_adamw() -> None:
    plain = fit("auto", precision="bf16-mixed")
    ours = fit(DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700), precision="bf16-mixed")
    for mine, theirs in zip(ours.losses, plain.losses):
        assert mine == pytest.approx(theirs, rel=0.01)


def test_host_slabs_are_pinned_exactly_and_the_16_bit_staging_is_a_ring() -> None:
    seen = {}

    class WhileFitting(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
            pool = trainer.strategy.dos_engine.pool
            seen["pinned"] = (
                pool.param.is_pinned() and pool.state("exp_avg").is_pinned() and pool.lp_staging.storage.is_pinned()
            )
            seen["pinned_bytes"], seen["ring"] = pool.pinned_bytes, pool.lp_staging.storage.numel()
            seen["slots"], seen["slot_numel"] = pool.lp_staging.slots, pool.lp_staging.slot_numel

    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700)
    fit(strategy, steps=3, precision="bf16-mixed", callbacks=(WhileFitting(),))
    pool = strategy.dos_engine.pool
    assert seen["pinned"]
    # cudaHostRegister pins exactly the slabs' bytes: no power-of-two rounding to report.
    assert seen["pinned_bytes"] == pool.host_bytes
    # Slots of the largest sub-group, enough of them to hold the whole partition (pool.LP_STAGING_SLOTS is None):
    # sub-groups of uneven sizes share fewer slots than there are sub-groups, reusing one only after its upload.
    engine = strategy.dos_engine
    slots = -(-sum(engine.sizes) // max(engine.sizes))
    assert seen["slots"] == slots and seen["slot_numel"] == max(engine.sizes)
    assert seen["ring"] == slots * max(engine.sizes)
    # Device staging lives only during each update: three updates, three allocations, none held after.
    assert pool.staging_allocations == 3 and pool.device_bytes_in_use == 0
    # Teardown unregistered every slab (not left to the garbage collector) and the state is still readable.
    assert pool.pinned_bytes == 0 and not pool.param.is_pinned() and torch.isfinite(pool.param).all()


def test_parameter_offload_updates_on_the_gpu_and_matches_plain_adamw() -> None:
    reference = full_parameters(fit("auto"))
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=700, offload_parameters=True)
    model = fit(strategy)
    engine = strategy.dos_engine
    assert engine.device.type == "cuda" and engine.lp_downloads and engine.pool.lp_staging is None
    report = engine.last_report
    assert report.device_elements > 0
    # Device sub-groups' 16-bit results come down beside their fp32 state (12 B + 4 B fp32 per element).
    assert report.d2h_bytes == 16 * report.device_elements
    assert max_relative_error(full_parameters(model), reference) < CUDA_RTOL


def test_resuming_with_another_placement_on_cuda_agrees_to_float_precision(tmp_path) -> None:  # noqa: ANN001
    """What the README claims on a GPU: host and device fused kernels round differently, so a run resumed
    with another gpu_fraction continues to float precision (on CPU the same test is bit-exact:
    tests/test_engine_behaviour.py)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(fraction: float, ckpt_path=None, save: bool = False) -> dict:  # noqa: ANN001
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)] if save else []
        t = trainer(
            DeepOptimizerStatesStrategy(gpu_fraction=fraction, sub_group_size=700),
            steps=10,
            callbacks=callbacks,
            limit_train_batches=5,
            enable_checkpointing=save,
            accelerator="cuda",
        )
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return full_parameters(model)

    straight = run(0.5, save=True)
    resumed = run(0.0, ckpt_path=str(next(tmp_path.glob("*step=5*"))))
    assert max_relative_error(resumed, straight) < CUDA_RTOL


@pytest.mark.parametrize(("precision", "overlap"), [("32-true", "off"), ("bf16-mixed", "auto")])
def test_nvme_tier_on_cuda_gives_the_all_host_engines_bits(tmp_path, precision: str, overlap: str) -> None:  # noqa: ANN001
    """The NVMe tier's CUDA path: a random plan each step (host, streamed, resident sub-groups), all of the state in
    the swap file or half of it, against the same plans with everything in host memory. Records streamed to the GPU
    go file -> staging slab -> device and back. On CPU the bits match (tests/test_nvme_training.py); two fits on a
    GPU need not compute the same gradients bit for bit (atomic additions in backward kernels), so here the tier is
    held to CUDA_RTOL of the all-host run: a record read stale or written back late is off by about lr."""
    from tests.test_nvme_training import AIO_MISSING, _fit

    if AIO_MISSING is not None:
        pytest.skip(f"the NVMe tier needs libaio: {AIO_MISSING}")
    reference, want, _ = _fit(None, None, precision, overlap=overlap, accelerator="cuda")
    state_bytes = 12 * sum(getattr(p, "ds_numel", p.numel()) for p in reference.parameters())
    for budget in (0, state_bytes // 2):
        directory = tmp_path / str(budget)
        directory.mkdir()
        model, got, strategy = _fit(directory, budget, precision, overlap=overlap, accelerator="cuda")
        assert strategy.dos_engine.device.type == "cuda" and got.files is not None and got.files.read_bytes > 0
        assert max_relative_error(dict(enumerate(got.state)), dict(enumerate(want.state))) < CUDA_RTOL
        assert max_relative_error(full_parameters(model), full_parameters(reference)) < CUDA_RTOL
        assert list(directory.iterdir()) == [], "the swap file outlived teardown"


# -- a missing wait must fail on a real GPU -----------------------------------------------------------------


def test_delayed_streams_equal_adamw_under_torchs_cuda_sanitizer() -> None:
    """16M-element sub-groups, one stream at a time sleeping before each piece of work (tests/delayed_streams.py),
    in a process of its own with TORCH_CUDA_SANITIZER=1: torch's sanitizer checks every kernel and copy, and the
    result, the host slabs and the 16-bit parameters read right after each step equal AdamW(fused=True)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.delayed_streams"], cwd=root, env=env, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "equal to AdamW(fused=True) in every run" in done.stdout


def test_removing_any_wait_host_wait_or_tail_event_makes_the_delayed_streams_differ() -> None:
    """Each synchronisation of the engine's modules removed in turn (tests/test_stream_sanitizer.py's mutations): with
    the stream it orders against sleeping, the GPU result differs (tests/test_gpu_check.py shows on CPU that the
    harness's plans reach every one of them)."""
    from tests.delayed_streams import check
    from tests.test_stream_sanitizer import all_mutations, mutant_engine

    missed = []
    for module, line, what in all_mutations():
        if not check(mutant_engine(line, module), stop_at_first=True):
            missed.append(what)
    assert not missed, f"removing these went unnoticed on the GPU: {missed}"


def test_iteration_phases_time_the_device_not_the_launch() -> None:
    """On CUDA the phases are the GPU's time between events on the current stream: a backward of queued matrix
    products takes longer than its (asynchronous) launch on the host's clock."""
    from lightning_dos.integration.phases import IterationPhases

    a = torch.randn(4096, 4096, device="cuda")
    phases = IterationPhases(torch.device("cuda"))
    phases.forward_begins()
    a @ a
    phases.backward_begins()
    launched = time.perf_counter()
    for _ in range(20):
        a = (a @ a).tanh()
    launch_s = time.perf_counter() - launched
    phases.backward_ends()
    forward_s, backward_s = phases.seconds()
    assert 0 < forward_s < backward_s and backward_s > launch_s
