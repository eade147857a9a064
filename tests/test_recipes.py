"""Every recipe parses and instantiates its configuration; big models allocate nothing to be checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.recipes.gpt import GPT

TINY = Path(__file__).resolve().parents[1] / "recipes" / "gpt-tiny.yaml"
ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SIZES = {"gpt-1.3b": 1.3e9, "gpt-7b": 7e9, "gpt-13b": 13e9, "gpt-20b": 20e9}


def test_there_are_recipes() -> None:
    assert {p.stem for p in RECIPES} >= {"gpt-tiny", *SIZES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_instantiates_without_allocating(recipe: Path) -> None:
    from lightning_dos.commands.main import DOSCLI
    from lightning_dos.data import ByteCorpusDataModule

    # GPU recipes are checked here on whatever hardware runs the tests.
    cpu = ["--trainer.accelerator", "cpu"] if not torch.cuda.is_available() else []
    cli = DOSCLI(GPT, ByteCorpusDataModule, args=["--config", str(recipe), *cpu], run=False)
    assert isinstance(cli.trainer.strategy, DeepOptimizerStatesStrategy)
    assert cli.trainer.strategy.config["zero_optimization"]["stage"] == 3
    model = cli.model
    assert model.transformer is None, "layers are built in configure_model, not at construction"
    assert sum(p.numel() for p in model.parameters()) == 0
    if recipe.stem in SIZES:
        assert model.num_parameters() == pytest.approx(SIZES[recipe.stem], rel=0.15)
    raw = yaml.safe_load(recipe.read_text())
    assert raw["trainer"]["strategy"]["class_path"] == "lightning_dos.DeepOptimizerStatesStrategy"


def test_count_parameters_is_exact() -> None:
    for tie in (True, False):
        model = GPT(vocab_size=50, n_layer=2, n_head=2, n_embd=16, block_size=12, tie_embeddings=tie)
        model.configure_model()
        assert sum(p.numel() for p in model.parameters()) == GPT.count_parameters(2, 16, 50, 12, tie)


def test_model_learns_and_refuses_sequences_longer_than_its_block() -> None:
    model = GPT(n_layer=1, n_head=2, n_embd=16, block_size=8)
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256)
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.randint(0, 256, (1, 9)))


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model.n_layerz", "3"], "n_layerz"),
        (["--model.n_head", "3"], "n_head=3"),
        (["--trainer.strategy.init_args.gpu_fraction", "2"], "gpu_fraction"),
    ],
)
def test_bad_recipe_settings_are_refused_before_training(args: list[str], fragment: str, capsys) -> None:  # noqa: ANN001
    from lightning_dos.commands.main import main

    code = main(["fit", "--config", str(TINY), *args])
    assert code != 0
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SIZES))
def test_big_recipe_models_allocate_nothing_and_have_their_size(name: str) -> None:
    recipe = next(p for p in RECIPES if p.stem == name)
    init_args = yaml.safe_load(recipe.read_text())["model"]
    model = GPT(**init_args)
    assert model.transformer is None and sum(p.numel() for p in model.parameters()) == 0
    counted = GPT.count_parameters(
        init_args["n_layer"], init_args["n_embd"], init_args["vocab_size"], init_args["block_size"]
    )
    assert counted == model.num_parameters()
    assert counted == pytest.approx(SIZES[name], rel=0.15)


def test_unknown_key_in_a_recipe_file_is_refused_naming_it(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from lightning_dos.commands.main import main

    extra = tmp_path / "typo.yaml"
    extra.write_text("model:\n  n_layer: 2\n  n_embdd: 64\n")
    code = main(["fit", "--config", str(TINY), "--config", str(extra), "--trainer.default_root_dir", str(tmp_path)])
    assert code != 0
    assert "n_embdd" in capsys.readouterr().err
    assert not list(tmp_path.rglob("metrics.csv")), "nothing was trained"


def test_sequence_longer_than_the_block_is_refused_before_training(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from lightning_dos.commands.main import main

    code = main(["fit", "--config", str(TINY), "--data.seq_len", "256", "--trainer.default_root_dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "data.seq_len=256 is longer than model.block_size=128" in err
    assert "at most 128" in err
    assert not list(tmp_path.rglob("metrics.csv")), "nothing was trained"
    # The model's own check refuses it in setup too, for runs that do not go through the CLI.
    model = GPT(n_layer=1, n_head=2, n_embd=16, block_size=8)
    with pytest.raises(ValueError, match="model.block_size=8"):
        model.check_seq_len(9)


def test_param_groups_schedule_test_and_predict_on_a_plain_trainer(tmp_path: Path) -> None:
    """The recipe model on its own (no DeepSpeed): AdamW groups, warm-up + cosine per step, test and predict."""
    import lightning as L

    from lightning_dos.data import ByteCorpusDataModule

    L.seed_everything(0, verbose=False)
    model = GPT(n_layer=1, n_head=2, n_embd=16, block_size=16, warmup_steps=3, min_lr_ratio=0.1, lr=1e-2)
    data = ByteCorpusDataModule(seq_len=16, batch_size=4, max_bytes=40_000)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=1,
        val_check_interval=6,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]), "only weight matrices decay"
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.transformer["wte"].weight) in no_decay_ids and id(model.transformer["wpe"].weight) in no_decay_ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    schedule = trainer.lr_scheduler_configs[0]
    assert schedule.interval == "step"
    factor = schedule.scheduler.lr_lambdas[0]
    assert [factor(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    after = [factor(s) for s in range(3, 13)]
    assert all(a >= b for a, b in zip(after, after[1:])), "cosine decays"
    assert factor(12) == pytest.approx(0.1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * factor(12)), "stepped once per step"
    assert "val/ppl" in trainer.callback_metrics and "train/tokens_per_step" in trainer.callback_metrics
    assert float(trainer.callback_metrics["train/tokens_per_step"]) == 4 * 16

    (tested,) = trainer.test(model, data, verbose=False)
    assert set(tested) >= {"test/loss", "test/ppl"}
    assert tested["test/ppl"] == pytest.approx(torch.tensor(tested["test/loss"]).exp().item(), rel=1e-3)
    (predicted,) = trainer.predict(model, data)
    assert predicted.shape == (4, 16) and predicted.dtype == torch.long


def test_the_bf16_states_recipe_trains_with_bf16_master_weights_and_moments(tmp_path: Path) -> None:
    """``recipes/gpt-tiny-bf16-states.yaml`` through the CLI: the engine keeps bf16 master weights and moments, and
    the loss falls."""
    from lightning_dos.commands.main import DOSCLI
    from lightning_dos.data import ByteCorpusDataModule

    args = [
        "--config", str(ROOT / "recipes" / "gpt-tiny-bf16-states.yaml"), "--trainer.accelerator", "cpu",
        "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--model.n_layer", "1", "--model.n_embd", "32",
        "--model.warmup_steps", "2", "--data.max_bytes", "100000", "--data.seq_len", "32", "--model.block_size", "32",
    ]  # fmt: skip
    cli = DOSCLI(GPT, ByteCorpusDataModule, args=args, run=False)
    cli.trainer.callbacks = [c for c in cli.trainer.callbacks if type(c).__name__ != "ModelCheckpoint"]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    pool = cli.trainer.strategy.dos_engine.pool
    assert pool.param.dtype == torch.bfloat16 and {s.dtype for s in pool.states} == {torch.bfloat16}
    assert cli.trainer.callback_metrics["train/loss"] < 5.5  # ln(256): uniform prediction


def test_gpt_refuses_an_unknown_optimizer_or_bf16_states_for_torch_optimizers() -> None:
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        GPT(optimizer="sgd")
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        GPT(optimizer="adamw", fp32_optimizer_states=False)
