"""Which parameters each module of a forward reads, in the order the forward reaches them.

ZeRO-3 gathers a module's own parameters as the forward enters it, so the modules' order is the order the gathers
need the parameters in. The framework records one training forward with this and hands the engine's sub-groups of
each module's parameters to :func:`~lightning_dos.model.need_order.need_order`; ``lightning-dos simulate --recipe``
records a recipe's model the same way, on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class ForwardRecorder:
    """Forward pre-hooks on every module of ``module`` that holds parameters of its own, recording while
    :attr:`recording` is on; :meth:`remove` takes them off (once recorded, they cost nothing more)."""

    def __init__(self, module: torch.nn.Module) -> None:
        #: Each module entered while recording, as the list of its own parameters, in the order entered.
        self.calls: list[list[torch.nn.Parameter]] = []
        self.recording = False
        self._handles = [
            m.register_forward_pre_hook(self._entered)
            for m in module.modules()
            if next(m.parameters(recurse=False), None) is not None
        ]

    def _entered(self, module: torch.nn.Module, _args: object) -> None:
        if self.recording:
            self.calls.append(list(module.parameters(recurse=False)))

    def gathers(self, sub_groups_of: Callable[[Iterable[torch.nn.Parameter]], Iterable[int]]) -> list[list[int]]:
        """The sub-groups each recorded module reads, by ``sub_groups_of`` (parameters to sub-group indices)."""
        return [list(sub_groups_of(params)) for params in self.calls]

    def remove(self) -> None:
        """Take the hooks off and stop recording."""
        self.recording = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
