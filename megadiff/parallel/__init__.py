"""Distributed set-up: process groups, megatron parallel state, the CPU mode."""
from megadiff.parallel.initialize import (
    compute_device, init_process_group, initialize, rank_and_world, released_after, set_seed, shutdown,
    tensor_parallel_across_nodes, wait_for_ranks,
)

__all__ = ["compute_device", "init_process_group", "initialize", "rank_and_world", "released_after", "set_seed",
           "shutdown", "tensor_parallel_across_nodes", "wait_for_ranks"]
