"""Process groups, megatron model-parallel state and seeds."""
from __future__ import annotations

import contextlib
import os
import random
from datetime import timedelta
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megadiff.config import ConfigError, ParallelConfig
from megadiff.parallel import cpu_mode


def init_process_group(timeout: timedelta) -> None:
    """Join the ranks of torchrun or Slurm (or form a group of one): idempotent."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_device())
    if "RANK" in os.environ:  # torchrun, Slurm tasks, spawned test ranks
        dist.init_process_group(backend, timeout=timeout)
    else:  # a plain `python` run: a group of one, leaving the environment of child processes alone
        # an in-process store, not a TCP one on a port seen free a moment before: another program could take
        # that port in between, and the run failed at its start with EADDRINUSE
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def local_device() -> int:
    """This process's CUDA device: its local rank's, modulo the devices it sees (where Slurm binds one GPU to
    each task, that GPU is device 0 whatever the local rank). More processes on a node than the GPUs each sees
    (several) would share GPUs: NCCL then hangs or fails at its first collective, after the start-up."""
    devices, processes = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if 1 < devices < processes:
        raise ConfigError(f"{processes} processes on this node, and {devices} GPUs visible to each: some would "
                          "share a GPU. Start one process per GPU (--nproc-per-node, or Slurm's --ntasks-per-node "
                          "equal to --gpus-per-node)")
    return int(os.environ.get("LOCAL_RANK", "0")) % devices


def tensor_parallel_across_nodes(parallel: ParallelConfig) -> str | None:
    """megatron gives a tensor-parallel group consecutive ranks: where a node's processes are no multiple of
    parallel.tensor, its groups span nodes and their all-reduces, several in every layer, cross the network.
    Said, not refused: a model may need it."""
    per_node, world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if per_node in (0, world) or per_node % parallel.tensor == 0:
        return None
    return (f"parallel.tensor={parallel.tensor} over {per_node} processes per node: tensor-parallel groups span "
            "nodes, and their all-reduces in every layer go over the network (a divisor of the processes per node "
            "keeps each group on one node)")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size; 0 of 1 without a process group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wait_for_ranks() -> None:
    """Every rank reaches this point before any goes on (nothing to wait for in one process)."""
    if rank_and_world()[1] > 1:
        dist.barrier()


def compute_device() -> torch.device:
    """Where megatron computes and where NCCL collectives need their tensors: this process's CUDA
    device when there is one (megatron's own layers and RoPE go there whatever else asks), else
    the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    """Same seed on tensor/data-parallel ranks (replicated weights agree); offset per pipeline stage."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize(parallel: ParallelConfig, seed: int) -> None:
    """Idempotent per process: call once before building models."""
    if not torch.cuda.is_available():
        cpu_mode.enable()
    init_process_group(timedelta(minutes=parallel.timeout_minutes))
    if parallel_state.model_parallel_is_initialized():
        refuse_another_layout(parallel)
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor,
            pipeline_model_parallel_size=parallel.pipeline,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
            context_parallel_size=parallel.context,
            distributed_timeout_minutes=parallel.timeout_minutes,
        )
    set_seed(seed)


def _layout(tensor: int, pipeline: int, virtual_pipeline: int | None, context: int) -> str:
    return f"TP {tensor}, PP {pipeline}{f' x {virtual_pipeline} chunks' if virtual_pipeline else ''}, CP {context}"


def refuse_another_layout(parallel: ParallelConfig) -> None:
    """The model-parallel groups an earlier call in this process formed (load_checkpoint's TP 1, an earlier run's)
    are kept: a run asking for another layout would have trained silently in theirs (its model built for its own
    sizes, its collectives over theirs) while its log named the one asked for."""
    formed = _layout(parallel_state.get_tensor_model_parallel_world_size(),
                     parallel_state.get_pipeline_model_parallel_world_size(),
                     parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                     parallel_state.get_context_parallel_world_size())
    asked = _layout(parallel.tensor, parallel.pipeline, parallel.virtual_pipeline, parallel.context)
    if formed != asked:
        raise ConfigError(f"parallel: {asked} asked, but this process holds the model-parallel groups of {formed}, "
                          "formed by an earlier call in it (load_checkpoint, a command run in-process): run this in "
                          "a process of its own, or release them first (megadiff.parallel.shutdown(), after which "
                          "the models built on them no longer run)")


@contextlib.contextmanager
def released_after() -> Iterator[None]:
    """The block, then the process group and model-parallel state that it formed released. What an earlier call in
    this process formed stays: a model load_checkpoint built reads its groups at every forward, and a pre-training
    run that released them all broke the models a notebook or sweep driver had loaded before it."""
    group_before, state_before = dist.is_initialized(), parallel_state.model_parallel_is_initialized()
    try:
        yield
    finally:
        if not state_before and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if not group_before and dist.is_initialized():
            dist.destroy_process_group()


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
