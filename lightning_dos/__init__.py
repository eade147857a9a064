"""lightning-dos: Deep Optimizer States for PyTorch Lightning.

Importing the package registers the strategy name ``"dos"``, so ``Trainer(strategy="dos")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dos.engine.atomic import TornStateError, UpdateInFlightError, UpdateInterrupted
from lightning_dos.strategy import DeepOptimizerStatesStrategy, DOSConfigError

__version__ = "0.1.0.dev0"

if "dos" not in StrategyRegistry:
    DeepOptimizerStatesStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DOSConfigError",
    "DeepOptimizerStatesStrategy",
    "TornStateError",
    "UpdateInFlightError",
    "UpdateInterrupted",
    "__version__",
]
