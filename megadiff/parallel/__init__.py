"""Distributed set-up: process groups, megatron parallel state, the CPU mode."""
from megadiff.parallel.initialize import initialize, set_seed, shutdown

__all__ = ["initialize", "set_seed", "shutdown"]
