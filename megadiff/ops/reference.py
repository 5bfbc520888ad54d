"""Naive differential attention: the numerical oracle for every fast path.

It materialises the N x N maps in fp32 (fp64 for fp64 inputs), so use it for
tests and small shapes only, and for what needs the maps themselves: the DIFF
paper's low-bit attention logits (its Figure 8), `logit_bits`.
"""
from __future__ import annotations

import math

import torch

from megadiff.ops.common import check_shapes, compute_dtype, lambda_per_head
from megadiff.ops.incremental import IntegralCarry, integral_mean


def absmax_quantized(scores: torch.Tensor, bits: int) -> torch.Tensor:
    """Dynamic symmetric absmax quantization of the scores [..., Nq, Nk] to `bits` bits, returned
    dequantized: each query's row in steps of max|score| / (2^(bits-1) - 1) over the keys it sees
    (masked scores stay -inf). Per row, as each row is its own softmax: a query's result does not
    depend on the queries batched or padded beside it."""
    if bits < 2:
        raise ValueError(f"logit_bits must be >= 2 (a sign and one level), got {bits}")
    finite = scores.isfinite()
    absmax = scores.masked_fill(~finite, 0.0).abs().amax(dim=-1, keepdim=True)
    step = (absmax / (2 ** (bits - 1) - 1)).clamp(min=torch.finfo(scores.dtype).tiny)
    return torch.where(finite, torch.round(scores / step) * step, scores)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                    logit_bits: int | None = None) -> torch.Tensor:
    """softmax(scale * q k^T + causal mask), q: [B, Nq, H, d], k: [B, Nk, H, d] -> [B, H, Nq, Nk];
    with `logit_bits`, the scores quantized first (absmax_quantized)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n_q, n_k = q.shape[1], k.shape[1]
        # bottom-right aligned, so a query block at the end of the keys (decode, CP) is causal too
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if logit_bits is not None:
        scores = absmax_quantized(scores, logit_bits)
    return torch.softmax(scores, dim=-1)


def softmax_attention_reference(q, k, v, *, causal=True, softmax_scale=None, logit_bits=None) -> torch.Tensor:
    """One softmax map's output A V through the materialised map ([B, N, H, d] layout, GQA)."""
    work = compute_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    k, v = (t.to(work).repeat_interleave(group, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    probs = attention_probs(q.to(work), k, scale, causal, logit_bits)
    return torch.einsum("bhqk,bkhe->bqhe", probs, v).to(q.dtype)


def differential_attention_reference(q1, k1, q2, k2, v, lam, *, causal=True, integral=False, softmax_scale=None,
                                     return_first_map=False, logit_bits=None,
                                     integral_carry: IntegralCarry | None = None):
    """`integral_carry` (decoding): the queries continue the positions it has seen, the integral's mean with them."""
    check_shapes(q1, k1, q2, k2, v, lam, integral and integral_carry is None)
    out_dtype = q1.dtype
    work = compute_dtype(q1.dtype)
    group = q1.shape[2] // k1.shape[2]
    q1, q2 = q1.to(work), q2.to(work)
    k1, k2, v = (t.to(work).repeat_interleave(group, dim=2) for t in (k1, k2, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q1.shape[-1])

    a1 = attention_probs(q1, k1, scale, causal, logit_bits)
    a2 = attention_probs(q2, k2, scale, causal, logit_bits)
    lam_h = lambda_per_head(lam, q1.shape[2]).to(work).view(1, -1, 1, 1)
    out = torch.einsum("bhqk,bkhe->bqhe", a1 - lam_h * a2, v)
    first_map_out = torch.einsum("bhqk,bkhe->bqhe", a1, v) if integral or return_first_map else None
    if integral:
        out = out + lam_h.view(1, 1, -1, 1) * integral_mean(first_map_out, causal, integral_carry)
    if return_first_map:
        return out.to(out_dtype), first_map_out.to(out_dtype)
    return out.to(out_dtype)
