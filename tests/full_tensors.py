"""Full (unsharded) tensors of a live model, whatever its TP/PP/DP layout, for comparing layouts.

Uses the model's own `sharded_state_dict()` metadata (global shape and offset of each local
shard), the same description dist_checkpointing saves, so every megatron layer, including
SwiGLU's split fc1, is assembled correctly.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

from megadiff.checkpoint.gather import model_sharded_tensors


def gather_full_tensors(chunks: list, value: Callable[[ShardedTensor], torch.Tensor] | None = None,
                        group=None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """All ranks get {key: full tensor} plus, per key, the largest difference between replicas.

    `value` picks what to gather for each shard (default: its data, i.e. the weights).
    A non-zero replica difference means ranks that should hold identical copies diverged.
    """
    value = value or (lambda shard: shard.data)
    local = [(shard.key, shard.global_shape, shard.global_slice(), is_main_replica(shard.replica_id),
              value(shard).detach().float().cpu().clone())
             for shard in model_sharded_tensors(chunks)]
    pieces: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local, group=group)
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for key, shape, where, main, data in rank_pieces:
            if main:
                full.setdefault(key, torch.zeros(shape))[where] = data
    replica_diff: dict[str, float] = {key: 0.0 for key in full}
    for rank_pieces in pieces:
        for key, _, where, main, data in rank_pieces:
            if not main:
                replica_diff[key] = max(replica_diff[key], float((full[key][where] - data).abs().max()))
    return full, replica_diff
