"""lightning-dos: Deep Optimizer States for PyTorch Lightning.

Importing the package registers the strategy name ``"dos"`` with Lightning, so ``Trainer(strategy="dos")`` and
``Fabric(strategy="dos")`` work. Lightning (and with it torch) is imported only when it is needed: right away when it
is already loaded, else as soon as it is (the ``lightning-dos`` command's help and its calibrate/plan/report
subcommands stay fast this way).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0.dev0"

#: Public names, imported on first use.
_LAZY = {
    "DeepOptimizerStatesStrategy": "lightning_dos.integration.strategy",
    "DOSFabricStrategy": "lightning_dos.integration.fabric",
    "DOSConfigError": "lightning_dos.integration.strategy",
    "DOSMonitor": "lightning_dos.integration.callbacks",
    "DOSProgressBar": "lightning_dos.integration.callbacks",
    "DOSModelSummary": "lightning_dos.integration.callbacks",
    "TornStateError": "lightning_dos.engine.atomic",
    "UpdateInFlightError": "lightning_dos.engine.atomic",
    "UpdateInterrupted": "lightning_dos.engine.atomic",
}
#: Registration waits for these packages to have finished loading (the Trainer's and Fabric's registries live there).
_LIGHTNING = "lightning.pytorch"
_FABRIC = "lightning.fabric"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_dos' has no attribute {name!r}")


def _build_dos_strategy(**init_params: Any) -> Any:
    from lightning_dos.integration.strategy import DeepOptimizerStatesStrategy

    return DeepOptimizerStatesStrategy(**init_params)


def _register() -> None:
    # A builder that imports the strategy module when the name is used, not the module itself: Lightning may be
    # loading on behalf of one of this package's modules that the strategy module imports, still half-initialised
    # here. The strategy module puts its class in the builder's place when it loads.
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dos.integration.settings import DESCRIPTION

    if "dos" not in StrategyRegistry:
        StrategyRegistry.register("dos", _build_dos_strategy, description=DESCRIPTION)


def _build_dos_fabric_strategy(**init_params: Any) -> Any:
    from lightning_dos.integration.fabric import DOSFabricStrategy

    return DOSFabricStrategy(**init_params)


def _register_fabric() -> None:
    # As _register, in Fabric's registry: the Fabric strategy module puts its class in the builder's place.
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_dos.integration.settings import DESCRIPTION

    if "dos" not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register("dos", _build_dos_fabric_strategy, description=DESCRIPTION)


#: What registers ``"dos"`` once each package has loaded.
_REGISTRARS = {_FABRIC: _register_fabric, _LIGHTNING: _register}


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Registers ``"dos"`` right after ``lightning.fabric`` and ``lightning.pytorch`` have been imported, then steps
    aside."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        # Found by the finders after this one (not this one again: it answers None to a name no longer pending).
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, execute = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _REGISTRARS[fullname]()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_pending = set()
for _name, _registrar in _REGISTRARS.items():
    if _name in sys.modules:
        _registrar()
    else:
        _pending.add(_name)
if _pending and not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads(_pending))

__all__ = [
    "DOSConfigError",
    "DOSModelSummary",
    "DOSMonitor",
    "DOSFabricStrategy",
    "DOSProgressBar",
    "DeepOptimizerStatesStrategy",
    "TornStateError",
    "UpdateInFlightError",
    "UpdateInterrupted",
    "__version__",
]
