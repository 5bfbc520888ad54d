"""Document masking through megatron's model: a batch's document boundaries, found at its EOD
tokens, ride in a PackedSeqParams, which GPTModel hands unchanged to every layer's core attention.

The format is "sbhd" (megatron's THD packing would change every tensor's layout): q/k/v keep
their [s, b, heads, d] shape, RoPE keeps absolute positions (with document masking the scores
depend only on positions within a document, as RoPE is relative), and `cu_seqlens` counts over
the micro-batch's flattened [b * s] tokens, as in ops/documents.py.
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

FORMAT = "sbhd"


def document_cu_seqlens(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The documents of a [B, N] micro-batch as cumulative lengths over its flattened tokens
    (ops/documents.py): a document ends with its EOD token, and at the end of each sample."""
    batch, seq_len = tokens.shape
    after_eod = (tokens.reshape(-1) == eod).nonzero().flatten() + 1
    sample_bounds = torch.arange(0, batch * seq_len + 1, seq_len, device=tokens.device)
    return torch.cat([after_eod, sample_bounds]).unique().to(torch.int32)  # sorted, an EOD at a sample end once


def document_packing(cu_seqlens: torch.Tensor | None, seq_length: int) -> PackedSeqParams | None:
    """The model's packed_seq_params for a micro-batch's document boundaries (None: no masking).

    max_seqlen is the whole sample: megatron sizes the rotary table from it.
    """
    if cu_seqlens is None:
        return None
    return PackedSeqParams(qkv_format=FORMAT, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=seq_length, max_seqlen_kv=seq_length)


def packed_documents(packed_seq_params: PackedSeqParams | None) -> torch.Tensor | None:
    """The core attention's view: the document boundaries to mask with, or None."""
    if packed_seq_params is None:
        return None
    if packed_seq_params.qkv_format != FORMAT:
        raise NotImplementedError(f"megadiff's core attention takes document boundaries in the {FORMAT!r} packing "
                                  f"of models/documents.py, not {packed_seq_params.qkv_format!r}")
    return packed_seq_params.cu_seqlens_q
