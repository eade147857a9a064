"""Every recipe parses and instantiates its configuration; big models allocate nothing to be checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.recipes.gpt import GPT

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
SIZES = {"gpt-1.3b": 1.3e9, "gpt-7b": 7e9, "gpt-13b": 13e9, "gpt-20b": 20e9}


def test_there_are_recipes() -> None:
    assert {p.stem for p in RECIPES} >= {"gpt-tiny", *SIZES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_instantiates_without_allocating(recipe: Path) -> None:
    from lightning_dos.cli import DOSCLI
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
    from lightning_dos.cli import main

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "gpt-tiny.yaml")
    code = main(["fit", "--config", recipe, *args])
    assert code != 0
    assert fragment in capsys.readouterr().err
