"""The one Lightning/DeepSpeed integration: the strategy, its ZeRO-3 adapter (the only module that reads
DeepSpeed's privates, checked at start-up), optimizers, the pre-flight memory check, iteration phases, the
LightningCLI, callbacks and the timeline trace."""
