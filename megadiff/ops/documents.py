"""Document masking: attention that does not cross the documents packed into one sequence.

Documents are given as `cu_seqlens`, the cumulative lengths over the batch's tokens taken sample
after sample (the flattened [B * N] stream), as flash-attention's varlen API and megatron's
PackedSeqParams give them: [0, end of document 1, ..., B * N], each sample boundary included.
Each document is attended on its own through the unchanged op, so every backend (and the DINT
running mean, which restarts with each document) supports it; samples without an inner
boundary run as one call.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

Span = tuple[int, int]


def document_spans(cu_seqlens: Sequence[int] | torch.Tensor, batch: int, seq_len: int) -> list[list[Span]]:
    """For each sample, its documents as (start, end) positions within the sample."""
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    total = batch * seq_len
    if not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to batch * seq_len = {total}, got {bounds[:3]}...{bounds[-3:]}")
    if any(later <= earlier for earlier, later in zip(bounds, bounds[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
    missing = sorted(set(range(0, total, seq_len)) - set(bounds))
    if missing:
        raise ValueError(f"cu_seqlens must contain every sample boundary (multiples of {seq_len}); "
                         f"missing {missing[:4]}: a document cannot continue into the next sample")
    spans: list[list[Span]] = [[] for _ in range(batch)]
    for start, end in zip(bounds, bounds[1:]):
        sample = start // seq_len
        spans[sample].append((start - sample * seq_len, end - sample * seq_len))
    return spans


def document_bounds(spans: list[list[Span]]) -> tuple[torch.Tensor, torch.Tensor]:
    """From document_spans(): [B, N] int64 (starts, ends), where each token's document begins and
    ends (exclusive) within its sample."""
    starts = torch.tensor([start for sample in spans for start, _ in sample])
    ends = torch.tensor([end for sample in spans for _, end in sample])
    lengths = ends - starts
    return (torch.repeat_interleave(starts, lengths).view(len(spans), -1),
            torch.repeat_interleave(ends, lengths).view(len(spans), -1))


def one_document_each(spans: list[list[Span]]) -> bool:
    """Whether no sample holds more than one document (masking changes nothing then)."""
    return all(len(sample) == 1 for sample in spans)


def check_self_attention(causal: bool, *tensors: torch.Tensor) -> None:
    """Document masking needs causal self-attention: every [B, N, ...] tensor of one batch and length."""
    if not causal or any(t.shape[:2] != tensors[0].shape[:2] for t in tensors):
        raise ValueError("document masking (cu_seqlens) needs causal self-attention: as many queries as keys")


def attend_by_document(attention: Callable, cu_seqlens, *tensors: torch.Tensor, causal: bool):
    """`attention(*tensors)` with each document of each sample attended separately.

    tensors: [B, N, ...], the queries, keys and values of one causal self-attention;
    `attention` returns a tensor or a tuple of tensors, all [B, N, ...].
    """
    check_self_attention(causal, *tensors)
    spans = document_spans(cu_seqlens, *tensors[0].shape[:2])
    if one_document_each(spans):
        return attention(*tensors)
    rows = []
    for sample, sample_spans in enumerate(spans):
        pieces = [attention(*(t[sample:sample + 1, start:end] for t in tensors)) for start, end in sample_spans]
        rows.append(concat_outputs(pieces, dim=1))
    return concat_outputs(rows, dim=0)


def concat_outputs(results: list, dim: int):
    """torch.cat of attention outputs, each a tensor or a tuple of tensors (concatenated pairwise)."""
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts, dim=dim) for parts in zip(*results))
    return torch.cat(results, dim=dim)
