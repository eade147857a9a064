"""The hook a tool watches the engine through (the race checker's model of DeepSpeed around it).

An :class:`EngineObserver` given to :meth:`~lightning_dos.engine.loop.InterleavedUpdate.watch` is called around each
of the engine's public entry points that the training loop drives, with the engine's own implementation to run: it
may model what the framework does before and after (DeepSpeed's accesses to the buffers the engine shares), and run
the engine's work inside a context of its own (a dispatch mode that checks every tensor access). The default passes
each call straight through. The engine's behaviour is its own: an observer never replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EngineObserver:
    """Pass-through hooks around the engine's entry points; a watcher overrides those it models."""

    def step(self, run: Callable[..., Any], plan: Any, inputs: Any, arrivals: Any) -> Any:
        """Around a step: ``run(plan, inputs, arrivals)`` is the engine's, returning its report."""
        return run(plan, inputs, arrivals)

    def flush(self, run: Callable[[], None]) -> None:
        """Around making the host slabs current for a reader (a checkpoint)."""
        run()

    def drop(self, run: Callable[[], None]) -> None:
        """Around forgetting state off the slabs after they were written (a checkpoint load)."""
        run()

    def start(self, run: Callable[[Callable[[], None]], None], work: Callable[[], None]) -> None:
        """Around starting ``work`` (an update) on the engine's background thread: ``run(work)``."""
        run(work)

    def wait_all(self, run: Callable[[], None]) -> None:
        """Around waiting for the update in flight."""
        run()
