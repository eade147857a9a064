"""lightning-dos: Deep Optimizer States for PyTorch Lightning."""

__version__ = "0.1.0.dev0"
