"""A live model's shards as dist_checkpointing describes them (key, global shape, offset), whatever
its TP/PP/DP layout: what a checkpoint of it must hold."""
from __future__ import annotations

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories


def model_sharded_tensors(chunks: list) -> list[ShardedTensor]:
    """Unwrapped GPTModel chunks -> this rank's shards. Layers share a key (megatron stacks
    them along a prepended axis), so several shards may carry one key."""
    shards = []
    for chunk in chunks:
        sharded, _ = extract_sharded_tensors_and_factories(chunk.sharded_state_dict(prefix=""))
        apply_factories(sharded)
        # a factory (SwiGLU's fc1) expands into several shards
        shards.extend(tensor for tensor in nested_values(sharded)
                      if isinstance(tensor, ShardedTensor) and "_extra_state" not in tensor.key)
    return shards
