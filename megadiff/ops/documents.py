"""Document masking: attention that does not cross the documents packed into one sequence.

Documents are given as `cu_seqlens`, the cumulative lengths over the batch's key positions taken
sample after sample (the flattened [B * Nk] stream), as flash-attention's varlen API and megatron's
PackedSeqParams give them: [0, end of document 1, ..., B * Nk], each sample boundary included.
The attention is causal and its Nq queries are the last Nq of the Nk key positions: self-attention
(Nq = Nk), or a context-parallel chunk of queries and the keys up to its end. The fused kernel
masks documents in its tiles; the other backends attend each document on its own through the
unchanged op (so the DINT running mean restarts with each document); samples without an inner
boundary run as one call.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Sequence

import torch

Span = tuple[int, int]


class DerivedPerTensor:
    """Values derived from the last few cu_seqlens tensors seen, by key. Every layer of a micro-batch
    masks the same documents: reading their bounds (a host sync on CUDA) and copying what is made of
    them to the device happens once per micro-batch, not once per layer. A weak reference and the
    tensor's version make a new or modified tensor derive anew; lists and inference tensors (no
    version counter) derive each time. Several tensors: a context-parallel layer's two query chunks
    have cu_seqlens of their own."""

    def __init__(self, tensors: int = 4):
        self._tensors = tensors
        self._recent: list[tuple[weakref.ref, int, dict]] = []

    def __call__(self, cu_seqlens, key: Hashable, make: Callable[[], Any]) -> Any:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_inference():
            return make()
        derived = next((values for source, version, values in self._recent
                        if source() is cu_seqlens and version == cu_seqlens._version), None)
        if derived is None:
            derived = {}
            kept = [entry for entry in self._recent if entry[0]() is not None and entry[0]() is not cu_seqlens]
            self._recent = kept[max(0, len(kept) + 1 - self._tensors):] + [
                (weakref.ref(cu_seqlens), cu_seqlens._version, derived)]
        if key not in derived:
            derived[key] = make()
        return derived[key]


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


def prefix_cu_seqlens(spans: list[list[Span]], length: int) -> list[int]:
    """cu_seqlens of every sample's first `length` positions (its documents cut there)."""
    bounds = [0]
    for sample, sample_spans in enumerate(spans):
        bounds += [sample * length + min(end, length) for start, end in sample_spans if start < length]
    return bounds


def document_lengths(causal: bool, *tensors: torch.Tensor) -> tuple[int, int]:
    """(Nq, Nk) of a document-masked attention's [B, N, ...] queries, keys and values; refuses what
    document masking cannot mean: non-causal attention, or tensors of other batches or lengths."""
    lengths = {t.shape[1] for t in tensors}
    if not causal or len({t.shape[0] for t in tensors}) > 1 or len(lengths) > 2:
        raise ValueError("document masking (cu_seqlens) needs causal attention whose queries are the last "
                         "of its keys (self-attention, or a context-parallel chunk and the keys up to its end)")
    return min(lengths), max(lengths)


def attend_by_document(attention: Callable, cu_seqlens, *tensors: torch.Tensor, causal: bool):
    """`attention(*tensors)` with each document of each sample attended separately.

    tensors: [B, Nq, ...] queries and [B, Nk, ...] keys and values of one causal attention, the
    queries being the last Nq key positions; cu_seqlens delimits the keys' documents. `attention`
    returns a tensor or a tuple of tensors, all [B, Nq, ...].
    """
    n_q, n_k = document_lengths(causal, *tensors)
    spans = document_spans(cu_seqlens, tensors[0].shape[0], n_k)
    if one_document_each(spans):
        return attention(*tensors)
    shift = n_k - n_q
    rows = []
    for sample, sample_spans in enumerate(spans):
        pieces = []
        for start, end in sample_spans:
            if end > shift:  # the document holds queries: they see its keys up to them (bottom-right causal)
                queries, keys = slice(max(start, shift) - shift, end - shift), slice(start, end)
                pieces.append(attention(*(t[sample:sample + 1, queries if t.shape[1] == n_q else keys]
                                          for t in tensors)))
        rows.append(concat_outputs(pieces, dim=1))
    return concat_outputs(rows, dim=0)


def concat_outputs(results: list, dim: int):
    """torch.cat of attention outputs, each a tensor or a tuple of tensors (concatenated pairwise)."""
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts, dim=dim) for parts in zip(*results))
    return torch.cat(results, dim=dim)
