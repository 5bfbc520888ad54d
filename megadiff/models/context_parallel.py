"""Context parallelism for differential attention.

megatron splits each sequence into 2 x CP chunks and gives rank r the chunks
r and 2CP-1-r (balanced causal work). Each rank gathers the whole K and V
(backward: reduce-scatter), attends from its two query chunks to the keys up to
each chunk's end, and, for DINT, continues the running mean of A1 V from the
sums of all earlier chunks, which live on other ranks.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megadiff.ops import differential_attention


def rank_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _gather_in_sequence_order(local: torch.Tensor, group, cp_size: int) -> torch.Tensor:
    """[2 chunks x ..., rest] per rank -> [2CP chunks x ..., rest] in sequence order (dim 0)."""
    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=group)
    chunks = gathered.chunk(2 * cp_size, dim=0)  # rank order: (0, 2CP-1), (1, 2CP-2), ...
    order = [0] * (2 * cp_size)
    for rank in range(cp_size):
        first, second = rank_chunks(rank, cp_size)
        order[first], order[second] = 2 * rank, 2 * rank + 1
    return torch.cat([chunks[i] for i in order], dim=0)


def context_parallel_differential_attention(q1, k1, q2, k2, v, lam, *, integral: bool, softmax_scale, backend):
    """Inputs [s_local, b, heads, d] (two local chunks); returns [b, s_local, h, dv]."""
    group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    chunk = q1.shape[0] // 2
    k1, k2, v = (_gather_in_sequence_order(t, group, cp_size).transpose(0, 1) for t in (k1, k2, v))
    outputs, first_map_outputs = [], []
    for local, global_chunk in enumerate(rank_chunks(cp_rank, cp_size)):
        rows = slice(local * chunk, (local + 1) * chunk)
        end = (global_chunk + 1) * chunk
        q1_c, q2_c = q1[rows].transpose(0, 1), q2[rows].transpose(0, 1)
        # DINT: the integral term needs A1 V of every chunk, which the attention computes anyway
        result = differential_attention(q1_c, k1[:, :end], q2_c, k2[:, :end], v[:, :end], lam, causal=True,
                                        softmax_scale=softmax_scale, backend=backend, return_first_map=integral)
        if integral:
            result, first_map = result
            first_map_outputs.append(first_map.float())
        outputs.append(result)
    if integral:
        outputs = _add_integral_term(outputs, first_map_outputs, lam, group, cp_size, cp_rank, chunk)
    return torch.cat(outputs, dim=1)


def _add_integral_term(outputs, first_map_outputs, lam, group, cp_size, cp_rank, chunk):
    """out += lam * (sum of A1 V over all earlier positions) / position, across CP ranks."""
    local_sums = torch.stack([o.sum(dim=1) for o in first_map_outputs])            # [2, b, h, dv]
    all_sums = _gather_in_sequence_order(local_sums, group, cp_size)                # [2CP, b, h, dv]
    earlier = torch.cumsum(all_sums, dim=0) - all_sums                              # exclusive prefix
    lam_h = (lam.float().expand(outputs[0].shape[2]) if lam.dim() == 0 else lam.float()).view(1, 1, -1, 1)
    result = []
    for out, first_map, global_chunk in zip(outputs, first_map_outputs, rank_chunks(cp_rank, cp_size)):
        positions = torch.arange(global_chunk * chunk + 1, (global_chunk + 1) * chunk + 1,
                                 device=out.device, dtype=torch.float32).view(1, -1, 1, 1)
        running = (earlier[global_chunk].unsqueeze(1) + torch.cumsum(first_map, dim=1)) / positions
        result.append((out.float() + lam_h * running).to(out.dtype))
    return result
