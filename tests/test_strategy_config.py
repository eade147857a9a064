"""The strategy's settings: registration, config merging, and bad input refused before any work."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

import lightning_dos
from lightning_dos import DeepOptimizerStatesStrategy, DOSConfigError
from lightning_dos.optimizers import UnsupportedOptimizerError
from tests.helpers import TinyLM, loader, trainer


def test_trainer_accepts_the_registered_name() -> None:
    t = L.Trainer(strategy="dos", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, lightning_dos.DeepOptimizerStatesStrategy)
    zero = t.strategy.config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {**zero["offload_optimizer"], "device": "cpu", "pin_memory": True}
    assert zero["sub_group_size"] == 100_000_000
    assert t.strategy.fraction.mode == "auto"


def test_user_config_is_merged_with_what_the_engine_requires(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}, "wall_clock_breakdown": False}))
    strategy = DeepOptimizerStatesStrategy(config=str(path), sub_group_size=1234)
    zero = strategy.config["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_optimizer"]["pin_memory"] is True
    assert zero["sub_group_size"] == 1234
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False


# (arguments, the setting the message must name, a fragment of what it says is valid)
BAD_SETTINGS = [
    ({"gpu_fraction": 1.5}, "gpu_fraction", "[0, 1]"),
    ({"gpu_fraction": -0.1}, "gpu_fraction", "[0, 1]"),
    ({"gpu_fraction": "half"}, "gpu_fraction", "stride:K"),
    ({"gpu_fraction": "stride:0"}, "gpu_fraction", "K >= 1"),
    ({"gpu_fraction": "stride:x"}, "gpu_fraction", "stride:K"),
    ({"gpu_fraction": float("nan")}, "gpu_fraction", "[0, 1]"),
    ({"gpu_fraction": True}, "gpu_fraction", "'auto'"),
    ({"sub_group_size": 0}, "sub_group_size", "positive integer"),
    ({"sub_group_size": -5}, "sub_group_size", "positive integer"),
    ({"sub_group_size": 1.5}, "sub_group_size", "positive integer"),
    ({"gpu_memory_budget": -1}, "gpu_memory_budget", "non-negative"),
    ({"stage": 2}, "stage", "use 3"),
    ({"offload_optimizer": False}, "offload_optimizer", "use True"),
    ({"offload_optimizer_device": "nvme"}, "offload_optimizer_device", "'cpu'"),
    ({"offload_parameters": True, "offload_params_device": "nvme"}, "offload_params_device", "'cpu'"),
    ({"config": {"zero_optimization": {"stage": 2}}}, "zero_optimization.stage", "use 3"),
    (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}},
        "offload_optimizer.device",
        "'cpu'",
    ),
    (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "none"}}}},
        "offload_optimizer.device",
        "'cpu'",
    ),
    (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.7}}}},
        "offload_optimizer.ratio",
        "use 1.0",
    ),
    ({"config": {"zero_force_ds_cpu_optimizer": True}}, "zero_force_ds_cpu_optimizer", "leave it false"),
    ({"config": {"zero_optimization": "yes"}}, "zero_optimization", "mapping"),
    ({"config": "/nonexistent/ds_config.json"}, "config", "does not exist"),
]


@pytest.mark.parametrize(("kwargs", "setting", "valid"), BAD_SETTINGS, ids=[str(b[0])[:60] for b in BAD_SETTINGS])
def test_bad_strategy_settings_are_refused_at_construction(kwargs, setting, valid) -> None:  # noqa: ANN001
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type varies, the message is what matters
        DeepOptimizerStatesStrategy(**kwargs)
    message = str(info.value)
    assert setting in message and valid in message, message


class WithOptimizer(TinyLM):
    def __init__(self, make) -> None:  # noqa: ANN001
        super().__init__()
        self.make = make

    def configure_optimizers(self):  # noqa: ANN201
        return self.make(self)


BAD_OPTIMIZERS = [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), UnsupportedOptimizerError, "SGD"),
    (lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), UnsupportedOptimizerError, "amsgrad"),
    (lambda m: torch.optim.AdamW(m.parameters(), maximize=True), UnsupportedOptimizerError, "maximize"),
    (
        lambda m: [torch.optim.AdamW(m.head.parameters()), torch.optim.AdamW(m.embed.parameters())],
        DOSConfigError,
        "several optimizers",
    ),
]


@pytest.mark.parametrize(("make", "error", "fragment"), BAD_OPTIMIZERS, ids=["sgd", "amsgrad", "maximize", "two"])
def test_unsupported_optimizers_are_refused_before_the_first_step(make, error, fragment) -> None:  # noqa: ANN001
    model = WithOptimizer(make)
    with pytest.raises(error, match=fragment) as info:
        trainer(DeepOptimizerStatesStrategy(gpu_fraction=0.5), steps=2).fit(model, loader())
    assert "Adam" in str(info.value)
    assert model.losses == [], "no training step may run before the refusal"


def test_clipping_by_value_is_refused_before_the_first_step() -> None:
    model = TinyLM()
    with pytest.raises(Exception, match="clipping gradients by value"):  # noqa: PT011
        trainer(DeepOptimizerStatesStrategy(), steps=2, gradient_clip_algorithm="value").fit(model, loader())
    assert model.losses == []


def test_deepspeed_cpu_adam_is_accepted_and_matches_adamw() -> None:
    """DeepSpeed's own CPU Adam (AdamW mode) as the user's optimizer: the engine reproduces it."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from tests.helpers import full_parameters, max_relative_error

    def run(make, strategy):  # noqa: ANN001, ANN202
        L.seed_everything(0, verbose=False)
        model = WithOptimizer(make)
        trainer(strategy, steps=5, clip=None).fit(model, loader())
        return full_parameters(model)

    ours = run(
        lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-3, weight_decay=0.1), DeepOptimizerStatesStrategy(0.5, 700)
    )
    plain = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), "auto")
    assert max_relative_error(ours, plain) < 1e-5
