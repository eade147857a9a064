"""Real-node resources (issue 12): the engine's device, host memory, device staging, DeepSpeed's accessors.

The engine-level tests run the loop on the CPU device; the integration tests drive real DeepSpeed ZeRO-3
through a real Lightning Trainer on CPU.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.engine.pool import BufferPool, StagingRing
from lightning_dos.host.hostmem import LIMIT_ENV, HostMemory, HostMemoryError, check_host_memory, host_memory
from lightning_dos.integration.zero3 import engine_device
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import Place, Plan, even_plan
from tests.helpers import TinyLM, full_parameters, loader, trainer

SUB_GROUP = 700
HYPER = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]


# -- 1. the engine's device ------------------------------------------------------------------------


def test_engine_device_is_the_accelerator_whatever_holds_the_16_bit_parameters() -> None:
    cpu, cuda1 = torch.device("cpu"), torch.device("cuda", 1)
    # Parameter offload: the 16-bit partitions are in host memory, training runs on the accelerator.
    assert engine_device("cuda:1", cpu) == cuda1
    assert engine_device(torch.device("cuda:0"), cpu) == torch.device("cuda", 0)
    # No parameter offload: where the partitions are is where DeepSpeed computes.
    assert engine_device("cuda:1", cuda1) == cuda1
    # No accelerator at all (DeepSpeed's CPU accelerator).
    assert engine_device("cpu", cpu) == cpu


def test_parameter_offload_runs_and_matches_without_it() -> None:
    """offload_parameters=True through a real Trainer: same parameters as without it, device side included."""

    def run(offload: bool) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        model = TinyLM()
        strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, offload_parameters=offload)
        trainer(strategy, steps=4).fit(model, loader())
        # DeepSpeed's ZeRO-3 ran with its 16-bit partitions offloaded to host memory (or not), as asked.
        assert (strategy.config["zero_optimization"].get("offload_param") or {}).get("device") == (
            "cpu" if offload else None
        )
        assert strategy.deepspeed_engine.optimizer.offload_param is offload
        assert strategy.dos_engine.device == torch.device("cpu")
        assert strategy.dos_engine.last_report.device_elements > 0
        return full_parameters(model)

    with_offload, without = run(True), run(False)
    for key, value in without.items():
        assert torch.equal(with_offload[key], value), key


def test_the_model_accounts_for_16_bit_parameters_in_host_memory() -> None:
    """With parameter offload host sub-groups upload nothing and device ones download their 16-bit result."""
    from lightning_dos.model.perfmodel import predict

    sizes, rates = [1000] * 4, _rates(10e9)
    plan = Plan((Place.DEVICE, Place.HOST, Place.RESIDENT, Place.HOST))
    on_device, on_host = predict(sizes, plan, rates, 2), predict(sizes, plan, rates, 2, lp_on_host=True)
    assert on_device.h2d_bytes - on_host.h2d_bytes == 2 * 2 * 1000  # the two host sub-groups' uploads
    assert on_host.d2h_bytes - on_device.d2h_bytes == 2 * 2 * 1000  # the two device sub-groups' downloads


# -- 3. host memory ----------------------------------------------------------------------------------


def test_16_bit_staging_is_a_ring_of_slots_only_where_the_16_bit_parameters_are_not_on_the_host() -> None:
    total, largest = 10_000, 700
    # 16-bit parameters on an accelerator: host sub-groups are cast into a ring, a slot per sub-group (a smaller
    # ring stalls host Adam behind the device uploads: see LP_STAGING_SLOTS).
    pool = BufferPool(total, torch.bfloat16, torch.device("cpu"), lp_on_host=False, largest_sub_group=largest)
    slots = -(-total // largest)
    assert pool.lp_staging is not None and pool.lp_staging.storage.numel() == slots * largest
    assert pool.host_bytes == 12 * total + 2 * slots * largest
    assert BufferPool.planned_host_bytes(total, torch.bfloat16, False, largest) == pool.host_bytes
    # 16-bit parameters in host memory: no staging at all.
    assert BufferPool.planned_host_bytes(total, torch.bfloat16, True, largest) == 12 * total
    # Nothing is pinned without CUDA, and the pool says so.
    assert pool.pinned_bytes == 0 or torch.cuda.is_available()


def test_host_sub_groups_cast_through_the_ring_give_the_same_16_bit_parameters() -> None:
    """16-bit parameters that live elsewhere than the host (``lp_device`` stands for the accelerator here):
    every host sub-group goes through a slot of the ring, and the result is what a direct cast gives."""
    numels, hypers = [1000, 300], [Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True)] * 2
    ringed = InterleavedUpdate(numels, [0, 1], 128, torch.device("cpu"), torch.bfloat16, lp_device=torch.device("meta"))
    direct = InterleavedUpdate(numels, [0, 1], 128, torch.device("cpu"), torch.bfloat16)
    assert ringed.pool.lp_staging.slots == len(ringed.sub_groups) and direct.pool.lp_staging is None
    start = torch.randn(sum(numels))
    ringed.pool.param.copy_(start)
    direct.pool.param.copy_(start)
    lp_ringed = [torch.zeros(n, dtype=torch.bfloat16) for n in numels]
    lp_direct = [torch.zeros(n, dtype=torch.bfloat16) for n in numels]
    plan = even_plan(len(ringed.sub_groups), 0.25)
    for step in (1, 2):
        grads = [torch.randn(n) for n in numels]
        ringed.step(plan, StepInputs([g.clone() for g in grads], lp_ringed, hypers, [step] * 2))
        direct.step(plan, StepInputs([g.clone() for g in grads], lp_direct, hypers, [step] * 2))
    for a, b in zip(lp_ringed, lp_direct, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ringed.pool.param, direct.pool.param)


def test_staging_ring_hands_back_a_slots_last_upload_before_reusing_it() -> None:
    """The ring returns the event of the upload that last read a slot; the engine host-waits on it through
    its streams (so the race checker sees the wait, and the mutation test removes it)."""
    ring = StagingRing(torch.empty(2 * 8, dtype=torch.bfloat16), slots=2)
    upload_0, upload_1 = object(), object()
    first, a, pending_a = ring.acquire(8)
    ring.release(first, upload_0)
    second, b, pending_b = ring.acquire(5)
    ring.release(second, upload_1)
    assert (first, second) == (0, 1) and pending_a is None and pending_b is None
    assert a.data_ptr() != b.data_ptr()
    third, c, pending_c = ring.acquire(8)  # slot 0 again: only after upload 0 has landed
    assert third == 0 and pending_c is upload_0 and c.data_ptr() == a.data_ptr()
    fourth, _, pending_d = ring.acquire(8)
    assert fourth == 1 and pending_d is upload_1
    with pytest.raises(ValueError, match="does not fit a staging slot"):
        ring.acquire(9)


def _write_cgroup_v2(root, limit: str, current: int) -> None:  # noqa: ANN001
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text("0::/job\n")
    (root / "proc" / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    (root / "proc" / "self" / "status").write_text("VmRSS: 100000 kB\n")
    group = root / "cg" / "job"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit)
    (group / "memory.current").write_text(str(current))


def test_host_memory_takes_the_tightest_of_cgroup_meminfo_and_the_setting(tmp_path) -> None:  # noqa: ANN001
    _write_cgroup_v2(tmp_path, "4000000000", 1_000_000_000)
    found = host_memory({}, tmp_path / "cg", tmp_path / "proc")
    assert (found.headroom, found.limit, found.in_use) == (3_000_000_000, 4_000_000_000, 1_000_000_000)
    assert "memory.max" in found.source
    # The setting caps the process's resident set (100000 kB here) when it is the tighter limit.
    found = host_memory({LIMIT_ENV: "1e9"}, tmp_path / "cg", tmp_path / "proc")
    assert found.source == LIMIT_ENV and found.headroom == 1_000_000_000 - 102_400_000
    with pytest.raises(ValueError, match=LIMIT_ENV):
        host_memory({LIMIT_ENV: "lots"}, tmp_path / "cg", tmp_path / "proc")


def test_host_memory_without_a_cgroup_limit_uses_mem_available(tmp_path) -> None:  # noqa: ANN001
    _write_cgroup_v2(tmp_path, "max", 1_000_000_000)
    found = host_memory({}, tmp_path / "cg", tmp_path / "proc")
    assert found.headroom == 6_000_000 * 1024 and "MemAvailable" in found.source


def test_pre_flight_error_names_the_figure_the_limit_and_what_to_change() -> None:
    memory = HostMemory(headroom=2_000_000_000, limit=16_000_000_000, in_use=14_000_000_000, source="cgroup")
    check_host_memory(2_000_000_000, "state", "fix it", memory)  # fits exactly
    with pytest.raises(HostMemoryError) as caught:
        check_host_memory(5_000_000_000, "the optimizer state", "Use more nodes.", memory)
    message = str(caught.value)
    assert "needs 5.00 GB" in message and "only 2.00 GB more" in message
    assert "limit 16.00 GB from cgroup" in message and "Use more nodes." in message


def test_fit_refuses_to_start_when_host_memory_is_short(monkeypatch) -> None:  # noqa: ANN001
    """An injected 1 MB limit: the fit stops before DeepSpeed or the engine allocate anything."""
    monkeypatch.setenv(LIMIT_ENV, "1e6")
    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP)
    with pytest.raises(HostMemoryError, match=f"limit 0.00 GB from {LIMIT_ENV}") as caught:
        trainer(strategy, steps=2).fit(TinyLM(), loader())
    assert "more nodes" in str(caught.value) and "parameters" in str(caught.value)
    from deepspeed import DeepSpeedEngine

    assert strategy.dos_adapter is None and not isinstance(strategy.model, DeepSpeedEngine)


# -- 5. device staging ---------------------------------------------------------------------------


def _inputs(numel: int, step: int = 1) -> StepInputs:
    return StepInputs([torch.randn(numel)], [torch.zeros(numel)], HYPER, [step])


def test_device_staging_is_freed_after_every_update_and_fits_the_budget() -> None:
    engine = InterleavedUpdate([1000], [0], 100, torch.device("cpu"), torch.float32)
    plan = even_plan(len(engine.sub_groups), 0.5, device_buffers=3)
    one_buffer = 16 * max(engine.sizes)
    for step in (1, 2, 3):
        report = engine.step(plan, _inputs(1000, step))
        assert report.device_staging_bytes == 3 * one_buffer, "three buffers during the update"
        assert engine.pool.device_bytes_in_use == 0 and not engine.pool.staging, "none held after it"
    assert engine.pool.staging_allocations == 3
    engine.budget.limit(one_buffer)  # room for one buffer now
    report = engine.step(plan, _inputs(1000, 4))
    assert report.device_staging_bytes <= one_buffer and report.plan.streamed_indices
    assert engine.pool.device_bytes_in_use == 0


def _rates(link_bps: float) -> HardwareRates:
    return HardwareRates(1e9, 4e9, 2e11, link_bps, link_bps, link_bps, link_bps)


def test_over_budget_the_model_chooses_between_fewer_buffers_and_fewer_device_sub_groups() -> None:
    engine = InterleavedUpdate([4096], [0], 1024, torch.device("cpu"), torch.float32)
    assert engine.sizes == (1024,) * 4
    plan = Plan((Place.DEVICE, Place.DEVICE, Place.HOST, Place.HOST), device_buffers=2)
    budget = 16 * max(engine.sizes)  # one staging buffer
    # A fast link: streaming through one buffer still beats the host, so the buffer goes.
    engine.use_rates(_rates(50e9))
    fast = engine.fit_to_budget(plan, budget)
    assert fast.streamed_indices == [0, 1] and fast.device_buffers == 1
    # A slow link: serialised streaming costs more than host Adam, so the sub-groups go.
    engine.use_rates(_rates(0.5e9))
    slow = engine.fit_to_budget(plan, budget)
    assert slow.streamed_indices == [] and slow.host_indices == [0, 1, 2, 3]
    # Without rates: buffers first, as before the model was calibrated.
    engine.use_rates(None)
    assert engine.fit_to_budget(plan, budget).device_buffers == 1


# -- 4. DeepSpeed's accessors and resident state ---------------------------------------------------------


class Resident(L.Callback):
    """Keeps every sub-group resident; at ``at`` reads DeepSpeed's accessors and at ``write_at`` writes."""

    def __init__(self, at: int, place: Place = Place.RESIDENT) -> None:
        self.at, self.place = at, place
        self.read: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        adapter = trainer.strategy.dos_adapter
        plan = Plan((self.place,) * len(adapter.engine.sub_groups))
        adapter.planner = lambda step: (plan, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        from deepspeed.utils import (
            safe_get_full_fp32_param,
            safe_get_full_optimizer_state,
            safe_get_local_fp32_param,
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
        )

        if trainer.global_step != self.at:
            return
        for name, p in pl_module.named_parameters():
            self.read[name] = safe_get_full_fp32_param(p).clone()
            self.read[name + ".exp_avg_sq"] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
            self.read[name + ".local"] = safe_get_local_fp32_param(p).clone()
        # Writes: one parameter's master weights and another's first moment.
        head, norm = pl_module.head.weight, pl_module.norm.weight
        safe_set_full_fp32_param(head, safe_get_full_fp32_param(head) * 0.5)
        safe_set_full_optimizer_state(norm, torch.ones_like(safe_get_full_fp32_param(norm)), "exp_avg")


def test_deepspeed_accessors_see_and_keep_resident_state() -> None:
    """With an explicit budget and every sub-group resident, DeepSpeed's safe_get_* read the current state and
    safe_set_* writes are used by the next step, exactly as when every sub-group is on the host."""

    def run(place: Place) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], InterleavedUpdate]:
        L.seed_everything(0, verbose=False)
        model, probe = TinyLM(), Resident(at=3, place=place)
        strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, gpu_memory_budget=1 << 30)
        trainer(strategy, steps=6, callbacks=[probe]).fit(model, loader())
        return probe.read, full_parameters(model), strategy.dos_engine

    host_read, host_final, _ = run(Place.HOST)
    resident_read, resident_final, engine = run(Place.RESIDENT)
    assert sorted(engine.last_report.plan.resident_indices) == list(range(len(engine.sub_groups)))
    assert host_read.keys() == resident_read.keys()
    for key, value in host_read.items():
        assert torch.equal(resident_read[key], value), f"stale read of {key}"
    for key, value in host_final.items():
        assert torch.equal(resident_final[key], value), f"write to {key} lost"
