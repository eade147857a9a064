"""``Fabric(strategy="dos")``: real Lightning Fabric loops (tests/jobs/fabric_loop.py) on real DeepSpeed ZeRO-3 on CPU.

Every overlap mode and placement gives the bits of ``overlap="off"`` (fp32 and bf16-mixed, clipped through the
strategy or the config, accumulated, an LR schedule the loop steps, evaluation under ``no_grad``), within float
tolerance of plain Fabric with AdamW; the NVMe tier; the race checker on a Fabric loop; nothing pinned nor on the drive
after ``close()``; a user's ``loss.backward()``, a second optimizer, ``fabric.clip_gradients`` refused in one line.
What needs processes of its own is in tests/test_fabric_processes.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dos import DOSFabricStrategy
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import disk
from tests.helpers import FP32_RTOL_PER_OP, max_relative_error
from tests.jobs.fabric_loop import same, train

SUB_GROUP = 700  # TinyLM's ~8k parameters: about a dozen sub-groups
#: A max norm TinyLM's gradients exceed in its first steps: speculative updates are redone, later ones kept.
CLIP = 0.5


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_overlap_mode_and_placement_is_bit_identical_to_off(precision: str) -> None:
    settings = dict(steps=4, accumulate=2, clip=CLIP, precision=precision)
    off = train({"overlap": "off", "gpu_fraction": 0.0, "sub_group_size": SUB_GROUP}, **settings)
    assert len(off.eval_losses) == 4 and off.eval_losses[-1] < off.eval_losses[0]
    for dos, in_config in (
        ({"overlap": "forward", "gpu_fraction": 0.5}, False),
        ({"overlap": "auto", "gpu_fraction": "stride:3"}, True),
    ):
        run = train({**dos, "sub_group_size": SUB_GROUP}, clip_in_config=in_config, **settings)
        assert same(run.params, off.params), dos
        assert run.losses == off.losses and run.eval_losses == off.eval_losses and run.lr == off.lr, dos


def test_within_float_tolerance_of_plain_fabric_with_adamw() -> None:
    settings = dict(steps=5, accumulate=2, clip=CLIP)
    plain = train(None, **settings)
    ours = train({"sub_group_size": SUB_GROUP, "gpu_fraction": 0.5}, **settings)
    assert ours.lr == plain.lr
    assert max_relative_error(ours.params, plain.params) < FP32_RTOL_PER_OP


@pytest.mark.skipif(disk.aio_unavailable() is not None, reason="libaio-dev is not installed (tests/test_disk.py)")
def test_nvme_tier_under_fabric_saved_restored_and_closed_leaves_nothing_pinned_nor_on_the_drive(
    tmp_path: Path,
) -> None:
    host = train({"sub_group_size": SUB_GROUP, "overlap": "off"}, steps=4, clip=CLIP)
    (tmp_path / "swap").mkdir()
    offload = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    nvme = {"config": {"zero_optimization": {"offload_optimizer": offload}}, "host_memory_budget": 0}
    ckpt = str(tmp_path / "ckpt")
    dos = {"sub_group_size": SUB_GROUP, "overlap": "forward", **nvme}
    run = train(dos, steps=4, clip=CLIP, close=False, save_at=1, checkpoint=ckpt)
    engine = run.fabric.strategy.dos_engine
    assert engine.files is not None and [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    assert same(run.params, host.params)
    run.fabric.strategy.close()
    assert not engine.pool.pinned and engine.pool.pinned_bytes == 0  # (a CPU run pins nothing: on a GPU, all of it)
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    run.fabric.strategy.close()  # a second close does nothing
    # The checkpoint holds the records that were in the file: loaded into a new one, the run continues bit for bit.
    assert same(train(dos, steps=4, clip=CLIP, checkpoint=ckpt, resume=True).params, host.params)
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]


def test_the_race_checker_on_a_fabric_loop() -> None:
    from lightning_dos.sim.sanitizer import SanitizerUnavailableError, StreamSanitizer

    try:
        checker = StreamSanitizer()
    except SanitizerUnavailableError as error:
        pytest.skip(f"needs torch.cuda._sanitizer's private classes: {error}")
    reference = train({"sub_group_size": SUB_GROUP, "overlap": "off"}, steps=3, clip=CLIP)
    # The checker models DeepSpeed's backward itself: the update begins after it ("forward"), as in the Trainer's test.
    run = train(
        {"sub_group_size": SUB_GROUP, "gpu_fraction": 0.5, "streams_factory": checker.streams, "overlap": "forward"},
        steps=3, clip=CLIP, close=False, on_setup=lambda strategy: checker.watch(strategy.dos_engine),
    )  # fmt: skip
    checker.check()
    lanes = {op.lane for op in checker.log if op.kind == "op"}
    assert {"upload", "device_adam", "download", "host_adam"} <= lanes
    assert max_relative_error(run.params, reference.params) < 1e-5
    # What the monitor logs per step under the Trainer, for fabric.log_dict: the (simulated) device's share, the bus.
    metrics = run.fabric.strategy.last_step_metrics()
    assert 0 < metrics["dos/gpu_fraction"] < 1 and metrics["dos/h2d_gb"] > 0 and metrics["dos/h2d_gbps"] > 0
    assert metrics["dos/engine_update_s"] > 0 and "dos/pinned_gb" in metrics
    run.fabric.log_dict(metrics)
    run.fabric.strategy.close()


def test_a_second_optimizer_loss_backward_and_clip_gradients_are_refused_in_one_line() -> None:
    fabric = L.Fabric(strategy=DOSFabricStrategy(sub_group_size=SUB_GROUP), accelerator="cpu", devices=1)
    fabric.launch()
    model = torch.nn.Linear(8, 8)
    one, two = (torch.optim.AdamW(model.parameters()) for _ in range(2))
    with pytest.raises(DOSConfigError, match=r"given 2 optimizers; strategy='dos' trains one model") as refused:
        fabric.setup(model, one, two)
    assert "\n" not in str(refused.value) and fabric.strategy.dos_adapter is None  # before any work
    model, one = fabric.setup(model, one)
    with pytest.raises(DOSConfigError, match="called again"):
        fabric.setup(torch.nn.Linear(8, 8), torch.optim.AdamW(torch.nn.Linear(8, 8).parameters()))
    loss = model(torch.randn(4, 8)).pow(2).mean()
    with pytest.raises(RuntimeError, match=r"fabric.backward\(loss\)") as refused:
        loss.backward()
    assert "\n" not in str(refused.value)
    with pytest.raises(DOSConfigError, match=r"gradient_clipping=<max norm>") as refused:
        fabric.clip_gradients(model, one, max_norm=1.0)
    assert "\n" not in str(refused.value)
    fabric.strategy.close()


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"gradient_clipping": -1.0}, r"gradient_clipping=-1.0 is not valid .*a positive max norm"),
        ({"gradient_clipping": 1.0, "config": {"gradient_clipping": 0.5}}, r"config sets gradient_clipping=0.5"),
        ({"overlap": "always"}, r"overlap='always' is not valid"),
    ],
)
def test_bad_settings_are_refused_before_any_work(arguments: dict, match: str) -> None:
    with pytest.raises(DOSConfigError, match=match):
        DOSFabricStrategy(**arguments)


def test_clipping_is_what_the_user_set_not_deepspeeds_default() -> None:
    assert DOSFabricStrategy().config["gradient_clipping"] == 0.0  # plain Fabric clips nothing either
    assert DOSFabricStrategy(gradient_clipping=2.0).config["gradient_clipping"] == 2.0
    assert DOSFabricStrategy(config={"gradient_clipping": 0.3}).config["gradient_clipping"] == 0.3
    assert L.Fabric(strategy="dos", accelerator="cpu", devices=1).strategy.__class__ is DOSFabricStrategy


def test_a_cuda_device_is_told_from_a_cpu_one_whichever_frameworks_accelerator_chose_it() -> None:
    """The pre-flight's and the CPU path's checks read the rank's device, not the Trainer's accelerator class."""
    from lightning_dos import DeepOptimizerStatesStrategy

    for strategy in (DOSFabricStrategy, DeepOptimizerStatesStrategy):
        assert strategy(parallel_devices=[torch.device("cuda", 0)]).dos_setup.on_cuda
        assert not strategy(parallel_devices=[torch.device("cpu")]).dos_setup.on_cuda
