"""Run-time planning: the scheduler that plans each step, the online rate estimator, the calibration, the
ranks' agreement on one plan, and the stored hardware profiles. Imports the model and the engine, never the
integration."""
