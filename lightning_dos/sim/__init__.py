"""A simulated accelerator for the engine: simulated streams, a stream-race checker, and a virtual-node replay.

Everything here imports the engine; the engine never imports it, so it costs nothing unless a test or a
tool selects it (``InterleavedUpdate(streams=...)`` or ``DeepOptimizerStatesStrategy(streams_factory=...)``).
Figures it produces are simulated, not measured.
"""
