"""Distributed set-up: process groups, megatron parallel state, the CPU mode."""
from megadiff.parallel.initialize import compute_device, initialize, set_seed, shutdown

__all__ = ["compute_device", "initialize", "set_seed", "shutdown"]
