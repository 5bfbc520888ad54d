"""Training: the engine (DDP + optimizer), the step, the pre-training loop."""
