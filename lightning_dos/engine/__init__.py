"""The Deep Optimizer States engine: framework-free pieces of the interleaved update phase."""
