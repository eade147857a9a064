"""The host pre-flight figure (issue 19, point 2): every buffer DeepSpeed pins, rounded as its pinning rounds,
and the engine's slabs; compared with the host memory a real run adds.

Without CUDA nothing is pinned, so the real run checks the unrounded figure, and the rounding arithmetic of
torch's caching host allocator (and of DeepSpeed's native backend) is checked as a unit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dos.engine.pool import BufferPool
from lightning_dos.integration.preflight import (
    config_footprint,
    deepspeed_sub_groups,
    engine_host_bytes,
    figure_for,
    least_rounded_sub_group_size,
    pin_backend,
    pinned_block_bytes,
    power_of_two_ceil,
    rank_host_figure,
)
from lightning_dos.model.update_rules import ADAGRAD, ADAM, ADAM_FP32, LION, Footprint
from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]


def test_pinned_blocks_are_rounded_as_each_backend_rounds() -> None:
    # torch's caching host allocator: the next power of two (c10::llvm::PowerOf2Ceil), exact powers unchanged.
    assert [power_of_two_ceil(n) for n in (0, 1, 3, 4, 5, 4096, 4097)] == [0, 1, 4, 4, 8, 4096, 8192]
    # A 1e8-element fp32 sub-group (DeepSpeed's sub_group_size under "auto") asks for 400 MB and gets 512 MiB.
    assert pinned_block_bytes(400_000_000, "torch") == 1 << 29
    # DeepSpeed's native backend pins whole pages; unpinned memory is its own size.
    assert pinned_block_bytes(400_000_001, "native") % os.sysconf("SC_PAGE_SIZE") == 0
    assert 0 <= pinned_block_bytes(400_000_001, "native") - 400_000_001 < os.sysconf("SC_PAGE_SIZE")
    assert pinned_block_bytes(400_000_001, "none") == 400_000_001
    with pytest.raises(ValueError, match="pin backend"):
        pinned_block_bytes(1, "cuda")


def test_the_pin_backend_is_chosen_by_whether_pinning_really_happens() -> None:
    assert pin_backend(pins_on_cuda=True, env={}) == "torch"
    assert pin_backend(pins_on_cuda=False, env={}) == "none"  # DeepSpeed's CPU accelerator pins nothing
    assert pin_backend(pins_on_cuda=False, env={"DS_PIN_MEMORY_BACKEND": "native"}) == "native"


def test_deepspeed_sub_groups_close_once_they_reach_the_size() -> None:
    # As _create_fp16_sub_groups packs them: a sub-group closes at the parameter that reaches the size.
    assert deepspeed_sub_groups([[3, 3, 3, 3]], 5) == [6, 6]
    assert deepspeed_sub_groups([[3, 3, 3]], 5) == [6, 3]
    assert deepspeed_sub_groups([[3, 3], [10]], 100) == [6, 10]  # a group under the size stays whole


def test_a_7b_model_on_cuda_counts_deepspeeds_rounding() -> None:
    """Per rank of 8 on one node, bf16: DeepSpeed's 6 B/param nominal grows with torch's power-of-two blocks."""
    layer = 7_000_000_000 // 8 // 64
    groups = [[layer] * 64]
    common = dict(
        lp_dtype=torch.bfloat16,
        grad_accum_dtype=torch.bfloat16,
        deepspeed_sub_group_size=100_000_000,
        engine_sub_group_size=20_000_000,
        on_accelerator=True,
        params_on_host=False,
    )
    exact = rank_host_figure(groups, backend="none", **common)
    pinned = rank_host_figure(groups, backend="torch", **common)
    per_rank = 64 * layer
    items = dict(pinned.items)
    sub_groups = deepspeed_sub_groups(groups, 100_000_000)
    assert items["DeepSpeed fp32 gradients"] == sum(power_of_two_ceil(4 * n) for n in sub_groups)
    assert items["DeepSpeed gradient partitions"] == power_of_two_ceil(2 * per_rank)
    assert dict(exact.items)["DeepSpeed fp32 gradients"] == 4 * per_rank  # nominal: 4 + 2 B/param
    assert pinned.total > exact.total == exact.nominal == pinned.nominal
    # The engine's own slabs are registered exactly: no rounding on them.
    assert items["engine slabs"] == dict(exact.items)["engine slabs"]


def _pinned_fp32_gradients(groups: list[list[int]], size: int) -> tuple[int, int]:
    sizes = deepspeed_sub_groups(groups, size)
    return sum(power_of_two_ceil(4 * n) for n in sizes), sum(4 * n for n in sizes)


def test_under_auto_deepspeeds_sub_groups_are_sized_to_waste_the_least_pinned_memory() -> None:
    """Where torch pins DeepSpeed's fp32 gradient buffers, "auto" sizes DeepSpeed's sub-groups so that they land at
    or under a power of two: 4096x4096 layers in 1e8-element sub-groups take 1.33x their bytes, 1x once sized."""
    layers = [[4096 * 4096] * 128]
    size = least_rounded_sub_group_size(layers, 100_000_000)
    pinned, nominal = _pinned_fp32_gradients(layers, 100_000_000)
    assert pinned / nominal > 1.3  # six layers (402 MB) in a 512 MiB block, 21 times
    pinned, nominal = _pinned_fp32_gradients(layers, size)
    assert pinned == nominal
    # A 7B model's layers over 8 ranks (13.7M elements each): 1.23x at 1e8, 1.09x once sized.
    ranked = [[7_000_000_000 // 8 // 64] * 64]
    before, after = (
        _pinned_fp32_gradients(ranked, s) for s in (100_000_000, least_rounded_sub_group_size(ranked, 10**8))
    )
    assert before[0] / before[1] > 1.2 and after[0] / after[1] < 1.1
    # Never worse than the default, whatever the shapes (one huge parameter leaves no better choice).
    odd = [[16_000_000] * 200 + [65_000_000]]
    assert _pinned_fp32_gradients(odd, least_rounded_sub_group_size(odd, 10**8)) <= _pinned_fp32_gradients(odd, 10**8)


# -- every optimizer rule and dtype (issue 21) --------------------------------------------------------------------

BF16 = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def _figure(footprint: Footprint, state_owner: str = "engine", backend: str = "none") -> dict[str, int]:
    """One rank of a 1M-parameter model in 10 parameters, bf16 model, DeepSpeed sub-groups of 250k elements."""
    figure = rank_host_figure(
        [[100_000] * 10],
        lp_dtype=torch.bfloat16,
        grad_accum_dtype=torch.bfloat16,
        deepspeed_sub_group_size=250_000,
        engine_sub_group_size=500_000,
        on_accelerator=True,
        params_on_host=False,
        backend=backend,
        state_owner=state_owner,
        footprint=footprint,
    )
    return dict(figure.items)


def test_bf16_master_weights_and_states_halve_deepspeeds_gradients_and_the_engines_slabs() -> None:
    """Under bf16_master_weights_and_grads DeepSpeed's per-sub-group gradient buffers are bf16 (they take its
    master_weights_and_grads_dtype); under bf16_optimizer_states the states too: the engine's slabs hold 2 + 2 x 2
    bytes per element instead of 4 + 2 x 4. The gradient partitions keep the accumulation dtype; the 16-bit
    staging ring (two slots of the engine's largest sub-group) is the same."""
    n, ring = 1_000_000, 2 * 500_000 * 2
    fp32, bf16 = _figure(ADAM_FP32), _figure(Footprint(ADAM, 2, 2))
    assert fp32["DeepSpeed fp32 gradients"] == 4 * n and bf16["DeepSpeed bf16 gradients"] == 2 * n
    assert fp32["DeepSpeed gradient partitions"] == bf16["DeepSpeed gradient partitions"] == 2 * n
    assert fp32["engine slabs"] == 12 * n + ring and bf16["engine slabs"] == 6 * n + ring
    # bf16 master weights with fp32 states (DeepSpeed without bf16_optimizer_states): 2 + 2 x 4.
    assert _figure(Footprint(ADAM, 2, 4))["engine slabs"] == 10 * n + ring
    # Stock offload: DeepSpeed's own master partitions and its CPU Adam's moments, in the same dtypes.
    assert _figure(ADAM_FP32, "deepspeed")["DeepSpeed master weights and optimizer states"] == 12 * n
    assert _figure(Footprint(ADAM, 2, 2), "deepspeed")["DeepSpeed master weights and optimizer states"] == 6 * n
    # Pinned by torch, each bf16 gradient buffer is rounded: 300k elements (600 kB) to 1 MiB, 100k to 256 KiB.
    assert deepspeed_sub_groups([[100_000] * 10], 250_000) == [300_000] * 3 + [100_000]
    pinned = _figure(Footprint(ADAM, 2, 2), backend="torch")
    assert pinned["DeepSpeed bf16 gradients"] == 3 * (1 << 20) + (1 << 18)


def test_lion_and_adagrad_keep_one_state_tensor() -> None:
    """Lion's one moment and Adagrad's one sum: 4 + 4 bytes per element in fp32, 2 + 2 in bf16; stock offload
    holds the same."""
    n, ring = 1_000_000, 2 * 500_000 * 2
    for rule in (LION, ADAGRAD):
        assert _figure(Footprint(rule))["engine slabs"] == 8 * n + ring
        assert _figure(Footprint(rule, 2, 2))["engine slabs"] == 4 * n + ring
        assert _figure(Footprint(rule), "deepspeed")["DeepSpeed master weights and optimizer states"] == 8 * n


def test_adam_fp32_slabs_are_what_the_buffer_pool_plans() -> None:
    """The pre-flight's count of the engine's slabs for Adam in fp32 is the pool's own (``planned_host_bytes``)."""
    for lp_on_host in (True, False):
        for largest in (None, 1000, 4096):
            ours = engine_host_bytes(10_000, torch.bfloat16, lp_on_host, largest)
            assert ours == BufferPool.planned_host_bytes(10_000, torch.bfloat16, lp_on_host, largest)


def test_bf16_gradient_buffers_are_sized_to_waste_the_least_too() -> None:
    layers = [[4096 * 4096] * 128]
    size = least_rounded_sub_group_size(layers, 100_000_000, grad_bytes=2)
    sizes = deepspeed_sub_groups(layers, size)
    assert sum(power_of_two_ceil(2 * n) for n in sizes) == sum(2 * n for n in sizes)


def test_the_config_names_the_dtypes_and_a_combination_deepspeed_refuses_is_refused() -> None:
    assert config_footprint({}) == ADAM_FP32
    assert config_footprint({"bf16": {"enabled": True}}) == ADAM_FP32  # bf16 model, fp32 master and states
    assert config_footprint(BF16, LION) == Footprint(LION, 2, 2)
    master_only = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    assert config_footprint(master_only) == Footprint(ADAM, 2, 4)
    with pytest.raises(ValueError, match="bf16_optimizer_states needs bf16.bf16_master_weights_and_grads"):
        config_footprint({"bf16": {"enabled": True, "bf16_optimizer_states": True}})
    # figure_for reads them from the config, or takes the engine's footprint.
    model = torch.nn.Linear(100, 100, bias=False)
    groups = [{"params": list(model.parameters())}]
    config = {**BF16, "zero_optimization": {"stage": 3, "sub_group_size": 10**9}}
    kwargs = dict(world_size=1, on_accelerator=False, engine_sub_group_size="auto")
    from_config = dict(figure_for(model, groups, config, **kwargs).items)
    assert from_config["DeepSpeed bf16 gradients"] == 2 * 10_000
    assert from_config["engine slabs"] == 6 * 10_000  # the 16-bit parameters are the model itself: no ring
    lion = dict(figure_for(model, groups, config, rule=LION, **kwargs).items)
    assert lion["engine slabs"] == 4 * 10_000
    given = dict(figure_for(model, groups, config, footprint=ADAM_FP32, **kwargs).items)
    assert given["engine slabs"] == 12 * 10_000


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_pre_flight_figure_matches_what_a_real_run_holds(precision: str, tmp_path: Path) -> None:
    """A real fit (Lightning Trainer, DeepSpeed ZeRO-3, the engine) of a 21M-parameter model, in a process of its
    own: the host memory its optimizer state holds after the steps is the pre-flight figure within 10%
    (see tests/jobs/host_peak.py for what is measured, and why like this)."""
    out = tmp_path / "peak.json"
    job = [sys.executable, str(ROOT / "tests" / "jobs" / "host_peak.py"), precision, "20", "1024", str(out)]
    done = subprocess.run(job, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    # The figure's DeepSpeed sub-groups are DeepSpeed's own.
    assert result["mirrored_sub_groups"] == result["deepspeed_sub_groups"]
    params = result["params"]
    assert params == 20 * (1024 * 1024 + 1024)
    expected = {"32-true": 20, "bf16-mixed": 18}[precision]  # 4 + lp + 12 B/param, nothing pinned on CPU
    # Beside the state, overlap="auto" (the default) holds spare slots for its speculative updates, in the figure.
    assert result["spare"] > 0
    assert result["preflight"] - result["spare"] == expected * params
    assert abs(result["state_held"] / result["preflight"] - 1) < 0.10, result


# -- issue 32: bf16-mixed against stock offload, and start-up's peak ----------------------------------------------

#: 8 layers of 1024x1024 (8.4M parameters, three DeepSpeed sub-groups): over calibration's least buffer
#: (``MIN_HOST_NUMEL``, 8M elements), so the calibration buffers are sized to the partition, as in a real run.
SHAPE = ("8", "1024")


def _fit_in_own_process(precision: str, system: str, tmp_path: Path) -> dict:
    """tests/jobs/host_peak.py for ``system`` (ours, sim or stock), glibc returning every block over 128 kB to
    the kernel when freed (as bench/memory.py measures), so that peaks are the bytes held, not the heap kept."""
    out = tmp_path / f"{system}-{precision}.json"
    job = [sys.executable, str(ROOT / "tests" / "jobs" / "host_peak.py"), precision, *SHAPE, str(out), system]
    env = {**clean_env(), "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(job, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bf16_mixed_host_memory_is_no_more_than_stock_offloads(tmp_path: Path) -> None:
    """Issue 32: what a bf16-mixed fit adds to host memory at its peak is no more than stock ZeRO-3 offload's
    (same model, DeepSpeedCPUAdam, 3 steps). Calibration held its update's buffers beside the copy's, six fp32
    buffers and a bf16 one of the partition's size (26 B/param): set-up peaked above every step (26.2 B/param
    against stock's 24.4 measured here). 1% allows for noise (measured: ours 0.99-1.00x stock's once fixed)."""
    ours, stock = (_fit_in_own_process("bf16-mixed", system, tmp_path) for system in ("ours", "stock"))
    assert ours["params"] == stock["params"]
    # The spare slots of overlap="auto"'s speculative updates (issue 61: every update begun during backward is
    # speculative, clipping or not) are host memory stock does not hold, bounded by speculation_memory ("auto":
    # half the node's spare) and shown in the pre-flight figure; the rest is held to stock's.
    assert ours["spare"] > 0
    ours["peak_added"] -= ours["spare"]
    per_param = {name: r["peak_added"] / r["params"] for name, r in (("ours", ours), ("stock", stock))}
    assert per_param["ours"] <= 1.01 * per_param["stock"], (per_param, ours["trace"], stock["trace"])


def test_start_up_host_peak_on_the_simulated_accelerator_is_the_pre_flight_figure(tmp_path: Path) -> None:
    """Issue 32, point 5: on the simulated accelerator the slabs are registered by a registrar that faults in
    every page, as cudaHostRegister does. Start-up's peak (from where DeepSpeed allocates the optimizer's state
    to the end of set-up) is the pre-flight figure within 10%: registering them while DeepSpeed's fp32 master
    partitions still existed put it 4 B/param above (24 against 20 B/param in bf16)."""
    result = _fit_in_own_process("bf16-mixed", "sim", tmp_path)
    params = result["params"]
    # 4 (DeepSpeed's fp32 gradients) + 2 (its bf16 gradient partitions) + 12 (slabs) + the 16-bit ring: a slot of
    # the largest sub-group per sub-group, 2 B/param and a little more; and the spare slots of speculation.
    assert 20 <= (result["preflight"] - result["spare"]) / params < 20.5, result["items"]
    # The spare slots are allocated and written at set-up (so a node short of memory fails there, not steps in):
    # start-up holds the whole figure.
    assert abs(result["startup_added"] / result["preflight"] - 1) < 0.10, result
