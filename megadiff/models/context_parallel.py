"""Context parallelism for the differential and softmax core attentions.

megatron splits each sequence into 2 x CP chunks and gives rank r the chunks
r and 2CP-1-r (balanced causal work). Each rank gathers the whole K and V
(backward: reduce-scatter), attends from its two query chunks to the keys up to
each chunk's end, and, for DINT, continues the running mean of A1 V from the
sums of all earlier chunks, which live on other ranks. With document masking, each
chunk's queries attend within their documents (the op's cu_seqlens over the keys up to
the chunk's end: masked in the fused kernel's tiles), and the running mean restarts at
each document.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megadiff.ops import differential_attention, softmax_attention
from megadiff.ops.common import copied_to, document_counts, lambda_per_head, sum_since
from megadiff.ops.documents import (
    DerivedPerTensor, document_bounds, document_spans, one_document_each, prefix_cu_seqlens,
)


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


# what a micro-batch's documents give every layer: read once (a host sync on CUDA), not per layer and chunk
_derived = DerivedPerTensor()


def _chunk_documents(cu_seqlens, batch: int, seq: int, ends: tuple[int, ...]):
    """(The documents' spans, the cu_seqlens of the keys up to each end as tensors), or None for one
    document per sample (plain causal attention). The tensors stay the same for every layer, so the
    fused kernel reads their bounds once."""
    spans = document_spans(cu_seqlens, batch, seq)
    if one_document_each(spans):
        return None
    return spans, [torch.tensor(prefix_cu_seqlens(spans, end), dtype=torch.int32) for end in ends]


def _gathered_context(keys: tuple[torch.Tensor, ...], query_length: int, cu_seqlens):
    """The whole sequences' `keys` (K and V, [s_local, b, ...] each) gathered as [b, S, ...], the
    documents' spans (None for one document per sample), and, per local query chunk, (its rows,
    the end of the keys it sees, those keys' cu_seqlens or None)."""
    group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    gathered = [_gather_in_sequence_order(t, group, cp_size).transpose(0, 1) for t in keys]
    batch, seq = gathered[0].shape[:2]
    chunk = query_length // 2
    # each chunk's queries are the last of the keys up to its end
    ends = tuple((global_chunk + 1) * chunk for global_chunk in rank_chunks(cp_rank, cp_size))
    documents = None if cu_seqlens is None else _derived(
        cu_seqlens, ("chunks", batch, seq, ends), lambda: _chunk_documents(cu_seqlens, batch, seq, ends))
    spans, prefixes = documents if documents is not None else (None, [None] * len(ends))
    pieces = [(slice(local * chunk, (local + 1) * chunk), end, prefix)
              for local, (end, prefix) in enumerate(zip(ends, prefixes))]
    return gathered, spans, pieces


def context_parallel_softmax_attention(q, k, v, *, softmax_scale, cu_seqlens=None):
    """Inputs [s_local, b, heads, d] (two local chunks); returns [b, s_local, heads, d].

    cu_seqlens: the documents of the whole sequences (ops/documents.py), or None for one each.
    """
    (k, v), _, pieces = _gathered_context((k, v), q.shape[0], cu_seqlens)
    return torch.cat([softmax_attention(q[rows].transpose(0, 1), k[:, :end], v[:, :end], causal=True,
                                        softmax_scale=softmax_scale, cu_seqlens=documents)
                      for rows, end, documents in pieces], dim=1)


def context_parallel_differential_attention(q1, k1, q2, k2, v, lam, *, integral: bool, softmax_scale, backend,
                                            cu_seqlens=None):
    """Inputs [s_local, b, heads, d] (two local chunks); returns [b, s_local, h, dv].

    cu_seqlens: the documents of the whole sequences (ops/documents.py), or None for one each.
    """
    (k1, k2, v), spans, pieces = _gathered_context((k1, k2, v), q1.shape[0], cu_seqlens)
    options = dict(causal=True, softmax_scale=softmax_scale, backend=backend, return_first_map=integral)
    outputs, first_map_outputs = [], []
    for rows, end, documents in pieces:
        result = differential_attention(q1[rows].transpose(0, 1), k1[:, :end], q2[rows].transpose(0, 1), k2[:, :end],
                                        v[:, :end], lam, cu_seqlens=documents, **options)
        if integral:  # the integral term needs A1 V of every chunk, which the attention computes anyway
            result, first_map = result
            first_map_outputs.append(first_map.float())
        outputs.append(result)
    if integral:
        batch, seq = k1.shape[:2]
        device = outputs[0].device  # made there, or copied once (queued: ops.common.copied_to)
        starts = (torch.zeros(batch, seq, dtype=torch.long, device=device) if spans is None
                  else _derived(cu_seqlens, ("starts", device), lambda: copied_to(document_bounds(spans)[0], device)))
        outputs = _add_integral_term(outputs, first_map_outputs, lam, starts, q1.shape[0] // 2)
    return torch.cat(outputs, dim=1)


def _add_integral_term(outputs, first_map_outputs, lam, starts, chunk):
    """out += lam * the running mean of A1 V over each position's document so far, across CP ranks.

    starts: [b, S] each position's document start. Each chunk's sum of A1 V since the last
    document start in it (its tail) is gathered; a chunk's carry is the sum over the positions
    before it of the document open at its start, built from the earlier chunks' tails.
    """
    group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    within, tails = [], []
    for first_map, global_chunk in zip(first_map_outputs, rank_chunks(cp_rank, cp_size)):
        local_starts = starts[:, global_chunk * chunk:(global_chunk + 1) * chunk] - global_chunk * chunk
        since_start = sum_since(first_map, local_starts.clamp(min=0))  # from max(document start, chunk start)
        within.append((since_start, local_starts))
        tails.append(since_start[:, -1])
    all_tails = _gather_in_sequence_order(torch.stack(tails), group, cp_size)  # [2CP, b, h, dv]
    carries = [torch.zeros_like(all_tails[0])]
    for c in range(1, 2 * cp_size):
        open_at_start = (starts[:, c * chunk] < c * chunk).float().view(-1, 1, 1)
        previous_carried = (starts[:, c * chunk - 1] < (c - 1) * chunk).float().view(-1, 1, 1)
        carries.append(open_at_start * (all_tails[c - 1] + previous_carried * carries[c - 1]))
    lam_h = lambda_per_head(lam, outputs[0].shape[2]).view(1, 1, -1, 1)
    result = []
    for out, (since_start, local_starts), global_chunk in zip(outputs, within, rank_chunks(cp_rank, cp_size)):
        carried = (local_starts < 0).float()[:, :, None, None] * carries[global_chunk].unsqueeze(1)
        running = (since_start + carried) / document_counts(local_starts, torch.float32)
        result.append((out.float() + lam_h * running).to(out.dtype))
    return result
