"""The strategy's settings: registration, config merging, and bad input refused before any work."""

from __future__ import annotations

import json
import logging
import re
import warnings

import lightning as L
import pytest
import torch

import lightning_dos
from lightning_dos import DeepOptimizerStatesStrategy, DOSConfigError
from lightning_dos.integration.optimizers import UnsupportedOptimizerError
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
    ({"offload_optimizer_device": "disk"}, "offload_optimizer_device", "'cpu', or 'nvme'"),
    ({"host_memory_budget": -1}, "host_memory_budget", "non-negative"),
    ({"host_memory_budget": "half"}, "host_memory_budget", "'auto'"),
    ({"offload_parameters": True, "offload_params_device": "nvme"}, "offload_params_device", "'cpu'"),
    ({"config": {"zero_optimization": {"stage": 2}}}, "zero_optimization.stage", "use 3"),
    (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}},
        "offload_optimizer.device",
        "needs nvme_path",
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
    (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}}},
        "offload_optimizer.pin_memory",
        "set it to true",
    ),
    (
        {"config": {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": False}}}},
        "offload_param.pin_memory",
        "set it to true",
    ),
    ({"config": {"zero_optimization": "yes"}}, "zero_optimization", "mapping"),
    ({"config": "/nonexistent/ds_config.json"}, "config", "does not exist"),
    ({"host_threads": 0}, "host_threads", "positive integer"),
    ({"host_threads": True}, "host_threads", "'auto'"),
    ({"host_threads": 2.5}, "host_threads", "positive integer"),
    ({"host_threads": "all"}, "host_threads", "'auto'"),
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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit_recording(strategy: DeepOptimizerStatesStrategy) -> tuple[list[str], list[str]]:
    """Fit TinyLM (with its LR scheduler) for 3 steps; return Lightning's info lines and every warning's text."""
    handler = _Lines()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy, steps=3).fit(TinyLM(), loader())
    finally:
        log.removeHandler(handler)
    return handler.lines, [str(w.message) for w in caught]


def test_auto_sub_groups_are_logged_once_and_an_unreachable_share_is_warned_naming_a_size() -> None:
    """TinyLM has a few thousand parameters: "auto" (never below 1M elements) gives one sub-group, so a fixed
    gpu_fraction=0.5 cannot be honoured; the warning names a size that can, and that size does."""
    info, warned = _fit_recording(DeepOptimizerStatesStrategy(gpu_fraction=0.5))
    chosen = [line for line in info if "sub_group_size='auto' chose" in line]
    assert len(chosen) == 1, info
    coarse = [w for w in warned if "gpu_fraction=0.5 asks for 50%" in w]
    assert len(coarse) == 1, warned
    suggested = int(re.search(r"use sub_group_size=(\d+)", coarse[0]).group(1))
    assert not any("lr_scheduler.step()" in w for w in warned), "the engine's step counts as the optimizer's"

    strategy = DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=suggested)
    info, warned = _fit_recording(strategy)
    assert not any("asks for" in w for w in warned) and not any("'auto' chose" in line for line in info)
    engine = strategy.dos_engine
    assert len(engine.sizes) >= 10
    assert engine.last_report.device_share == pytest.approx(0.5, abs=0.1), "gpu_fraction is a share of elements"


def test_default_sub_group_size_is_auto_and_deepspeed_packs_by_the_ceiling() -> None:
    strategy = DeepOptimizerStatesStrategy()
    assert strategy.engine_sub_group_size == "auto"
    assert strategy.config["zero_optimization"]["sub_group_size"] == 100_000_000
    assert DeepOptimizerStatesStrategy(sub_group_size=5000).config["zero_optimization"]["sub_group_size"] == 5000


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_dos; import lightning",
        "from lightning_dos import DeepOptimizerStatesStrategy",
        # A module the strategy module imports, first: Lightning then loads while it is half-initialised.
        "from lightning_dos.integration.cpu_strategy import DeepSpeedCPUStrategy",
    ],
    ids=["package-then-lightning", "strategy-class-first", "base-strategy-first"],
)
def test_the_name_dos_is_registered_whatever_the_import_order(imports: str) -> None:
    """The package imports Lightning lazily; the name is registered as soon as Lightning is loaded."""
    import subprocess
    import sys

    from tests.helpers import clean_env

    code = f"{imports}\nfrom lightning.pytorch.strategies import StrategyRegistry\nassert 'dos' in StrategyRegistry\n"
    code += "assert type(StrategyRegistry.get('dos')).__name__ == 'DeepOptimizerStatesStrategy'\n"
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
