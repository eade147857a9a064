"""Evaluate a checkpoint written by strategy="dos" in a fresh process: validate, test and predict.

Usage: python tests/jobs/evaluate.py CHECKPOINT PRECISION GPU_FRACTION OUT_JSON
The model starts from other random weights than the run that wrote the checkpoint, so only a real load
gives the fitted run's losses and predictions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_dos import DeepOptimizerStatesStrategy  # noqa: E402
from tests.helpers import TinyLM, loader, trainer  # noqa: E402


def main(checkpoint: str, precision: str, fraction: str, out: str) -> None:
    fraction_value: float | str = fraction if fraction == "auto" or fraction.startswith("stride") else float(fraction)
    L.seed_everything(123, verbose=False)
    model = TinyLM()

    def run() -> L.Trainer:
        strategy = DeepOptimizerStatesStrategy(gpu_fraction=fraction_value, sub_group_size=700)
        return trainer(strategy, steps=1, precision=precision)

    untrained = run().validate(model, loader(), verbose=False)[0]["val/loss"]
    result = {
        "untrained": untrained,
        "validate": run().validate(model, loader(), ckpt_path=checkpoint, verbose=False)[0]["val/loss"],
        "test": run().test(model, loader(), ckpt_path=checkpoint, verbose=False)[0]["test/loss"],
        "predict": torch.cat(run().predict(model, loader(), ckpt_path=checkpoint)).tolist(),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
