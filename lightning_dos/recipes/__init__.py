"""Recipe models: LightningModules the CLI and the benchmarks train."""

from lightning_dos.recipes.gpt import GPT

__all__ = ["GPT"]
