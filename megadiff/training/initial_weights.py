"""Initial weights that are the same whatever the parallel layout (`train.layout_invariant_init`).

megatron seeds each pipeline stage apart (train.seed + 100 x stage) and, on GPUs, draws each tensor-parallel
shard from its rank's own generator: the same config starts from another model under TP 2 than under PP 2.
Here every randomly initialised tensor is drawn again, whole, from a generator seeded by its checkpoint key
(and its layer, for the layers' stacked keys), and each rank keeps its slice: one layer's tensor at a time
on each rank, so a 13B model needs no whole copy anywhere.
"""
from __future__ import annotations

import functools
import zlib
from typing import Callable, Optional

import torch

from megadiff.checkpoint.gather import model_sharded_tensors

Init = Callable[[torch.Tensor], torch.Tensor]


def initializer(key: str, config) -> Optional[Init]:
    """How megatron and megadiff draw the tensor of `key`; None for a constant one (norm weights at one, biases
    and Shared DIFF's zero-initialised B factors at zero), which every layout already starts alike."""
    if key.endswith("bias") or any("norm" in part for part in key.split(".")):
        return None
    if ".lowrank_up_" in key and config.lowrank_zero_init:
        return None
    if ".lambda_" in key:
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=config.lambda_std)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return config.output_layer_init_method
    if key.endswith("embedding.word_embeddings.weight"):
        return config.embedding_init_method
    return config.init_method


def redraw_layout_invariant(chunks: list, config, seed: int) -> None:
    """Each random tensor of this rank's model chunks from a generator of `seed` and its key alone."""
    with torch.no_grad():
        for shard in model_sharded_tensors(chunks):
            init = initializer(shard.key, config)
            if init is None:
                continue
            where, stacked = shard.global_slice(), shard.prepend_axis_num  # stacked: the layer axis
            whole = torch.empty(shard.global_shape[stacked:], dtype=torch.float32, device=shard.data.device)
            name = ".".join([shard.key, *map(str, where[:stacked])])
            devices = [whole.device] if whole.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):  # the run's own generators go on as they were
                torch.manual_seed(seed + zlib.crc32(name.encode()))
                init(whole)
            shard.data.copy_(whole[where[stacked:]])
