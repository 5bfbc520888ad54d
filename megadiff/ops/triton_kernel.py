"""Fused differential attention in Triton: forward, backward, and the maps for partial-result merging.

The kernels (triton_fwd, triton_bwd) compute both maps per query tile in one
pass over K/V. What is linear in O1 and O2 happens here, in torch:
    out = O1 - lam O2 + [integral] lam R(O1),   R = running mean over positions
(the kernel fuses O1 - lam O2 into its epilogue; `integral` adds DINT's term); O1 itself can be
returned too. Backward, with G = dL/dout: dO2 = -lam G, dO1 = G plus what `integral` derives, and
dlam_h = sum(-G O2) + [integral] sum(R^T(G) O1). With documents (cu_seqlens), the kernels mask
attention to each query's document and R runs within documents.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before
triton is first imported) -- how the tests exercise it.
"""
from __future__ import annotations

import math

import torch

from megadiff.ops import triton_bwd, triton_fwd
from megadiff.ops.common import (
    TRITON_DTYPES, TRITON_MAX_HEAD_DIM, check_shapes, compiled_on, copied_to, lambda_per_head, map_pairs, triton_fits,
)
from megadiff.ops.documents import DerivedPerTensor, document_bounds, document_lengths, document_spans
from megadiff.ops.integral import first_map_gradients, integral_added
from megadiff.ops.triton_bwd import attention_maps_backward, row_dots
from megadiff.ops.triton_fwd import (
    INTERPRETED, Documents, KernelConfig, attention_maps_forward, empty_bnhd, row_offsets_fit_int32,
    shared_layout,
)

__all__ = ["KernelConfig", "attention_maps_backward", "differential_attention_triton",
           "differential_attention_triton_maps", "paired_differential_attention_triton"]

def _check_supported(q1, k1, q2, k2, v) -> None:
    if any(t.dtype != q1.dtype for t in (k1, q2, k2, v)) or q1.dtype not in TRITON_DTYPES:
        raise TypeError(f"the Triton kernel needs q, k, v all of one dtype among {TRITON_DTYPES}, got "
                        f"{[t.dtype for t in (q1, k1, q2, k2, v)]}")
    if not triton_fits(q1.shape[-1], v.shape[-1]):
        raise ValueError(f"the Triton kernel supports head dims up to {TRITON_MAX_HEAD_DIM}, "
                         f"got d={q1.shape[-1]}, dv={v.shape[-1]}")
    (_, n_q, h_q, d), (_, n_k, h_kv, dv) = q1.shape, v.shape
    if max(n_q * h_q, n_k * h_kv) * max(d, dv) >= 2 ** 31:  # a dense (batch) slice, indexed in int32
        raise ValueError(f"the Triton kernel indexes one sequence's {max(n_q, n_k)} positions x heads x head dim in "
                         "int32, which this shape passes: split the sequence (parallel.context) or the heads "
                         "(parallel.tensor) over more ranks")
    if q1.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError("the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           f"imported to run on {q1.device.type} tensors")


def _kernel_layout(q1, k1, q2, k2, v):
    """One set of strides per pair (q1/q2, k1/k2) and a dense last dim everywhere; copies only if needed."""
    q1, q2 = shared_layout(q1, q2)
    k1, k2 = shared_layout(k1, k2)
    (v,) = shared_layout(v)
    return q1, k1, q2, k2, v


_documents_of_tensors = DerivedPerTensor()  # read once per micro-batch, not once per layer


def _documents(cu_seqlens, causal: bool, q: torch.Tensor, k: torch.Tensor) -> Documents:
    """The kernels' view of cu_seqlens (the keys' documents; the queries are the last keys)."""
    n_q, n_k = document_lengths(causal, q, k)

    def make() -> Documents:
        starts, ends = document_bounds(document_spans(cu_seqlens, k.shape[0], n_k))
        return Documents(*(copied_to(t.to(torch.int32).contiguous(), q.device) for t in (starts[:, n_k - n_q:], ends)))
    return _documents_of_tensors(cu_seqlens, (k.shape[0], n_q, n_k, q.device), make)


def _maps_forward(ctx, q1, k1, q2, k2, v, lam, causal, integral, scale, config, return_first_map, documents):
    """The autograd forward over both maps' queries and keys (either Function's)."""
    q1, k1, q2, k2, v = _kernel_layout(q1, k1, q2, k2, v)
    lam_h = lambda_per_head(lam, q1.shape[2]).to(q1.device, torch.float32).contiguous()
    # the output follows the queries' layout: megatron's [s, b, ...] queries get an output that is
    # [s, b, ...] in memory, which its output projection then reads without a copy
    out, o1, o2, lse1, lse2 = attention_maps_forward(
        q1, k1, q2, k2, v, lam_h, causal=causal, scale=scale, o_dtype=q1.dtype, config=config,
        documents=documents, sequence_major=q1.stride(0) < q1.stride(1))
    if integral:
        starts = documents.starts.long() if documents is not None else None
        out = compiled_on(out.device, integral_added)(out, o1, lam_h, causal, starts)
    ctx.save_for_backward(q1, k1, q2, k2, v, o1, o2, lse1, lse2, lam_h)
    ctx.causal, ctx.integral, ctx.scale, ctx.config, ctx.documents = causal, integral, scale, config, documents
    ctx.lam_meta = (lam.dim(), lam.dtype)
    ctx.tied = not (integral or return_first_map)
    return (out, o1) if return_first_map else out


def _maps_backward(ctx, grad_out, grad_first_map, grads: tuple | None = None):
    """(dq1, dk1, dq2, dk2, dv, dlam); `grads`: as attention_maps_backward's."""
    q1, k1, q2, k2, v, o1, o2, lse1, lse2, lam_h = ctx.saved_tensors
    (g,) = shared_layout(grad_out)  # a sequence-major gradient, as the output was, is read as it is
    g_o2 = row_dots(g, o2)
    grad_lam = -g_o2.sum(dim=(0, 2))
    delta2 = -lam_h.view(1, -1, 1) * g_o2  # rowsum(dO2 O2) with dO2 = -lam G
    if ctx.tied:  # dO1 = G, dO2 = -lam G: the kernels derive dO2, two matmuls fewer
        do1, do2 = g, None
        delta1 = row_dots(g, o1)
    else:
        documents = ctx.documents
        starts, ends = (None, None) if documents is None else (documents.starts.long(), documents.ends.long())
        do1, do2, delta1, grad_integral = compiled_on(g.device, first_map_gradients)(
            g, o1, lam_h, ctx.causal, ctx.integral, starts, ends, grad_first_map)
        grad_lam = grad_lam + grad_integral
        do1, do2 = shared_layout(do1, do2)  # the kernels read both with dO1's strides
    dq1, dk1, dq2, dk2, dv = attention_maps_backward(
        q1, k1, q2, k2, v, do1, do2, lam_h, lse1, lse2, delta1, delta2,
        causal=ctx.causal, scale=ctx.scale, config=ctx.config, documents=ctx.documents, grads=grads)
    lam_dim, lam_dtype = ctx.lam_meta
    grad_lam = (grad_lam.sum() if lam_dim == 0 else grad_lam).to(lam_dtype)
    return dq1, dk1, dq2, dk2, dv, grad_lam


def _refuse_a_graph_of_the_gradients() -> None:
    """A backward with create_graph (grad mode on: a gradient penalty, a Hessian product) would get gradients
    without a graph from the kernels, and autograd would silently take their own gradient for zero."""
    if torch.is_grad_enabled():
        raise RuntimeError("the Triton differential-attention kernel cannot differentiate twice (backward with "
                           "create_graph=True); use backend='reference' for higher-order gradients")


class _DifferentialAttention(torch.autograd.Function):
    forward = staticmethod(_maps_forward)

    @staticmethod
    def backward(ctx, grad_out, grad_first_map=None):
        _refuse_a_graph_of_the_gradients()
        return (*_maps_backward(ctx, grad_out, grad_first_map), None, None, None, None, None, None)


def _pairs_layout(t: torch.Tensor) -> tuple:
    """What a gradient for `t` ([B, N, 2H, d]) is made from: megatron's sequence-major layout when t has it."""
    return (*t.shape, t.device, t.dtype, t.stride(0) < t.stride(1))


class _PairedDifferentialAttention(torch.autograd.Function):
    """Over q [B, N, 2Hq, d] and k [B, Nk, 2Hkv, d] as megatron holds them (heads 2i, 2i + 1: head i's
    two maps): the backward writes both maps' gradients into one tensor for each, where the per-map
    form's gradients cost autograd a stack of the two."""

    @staticmethod
    def forward(ctx, q, k, v, lam, causal, integral, scale, config, return_first_map, documents):
        (q1, q2), (k1, k2) = map_pairs(q), map_pairs(k)
        ctx.pairs = (_pairs_layout(q), _pairs_layout(k))
        return _maps_forward(ctx, q1, k1, q2, k2, v, lam, causal, integral, scale, config, return_first_map,
                             documents)

    @staticmethod
    def backward(ctx, grad_out, grad_first_map=None):
        _refuse_a_graph_of_the_gradients()
        dq, dk = (empty_bnhd(*layout) for layout in ctx.pairs)
        (dq1, dq2), (dk1, dk2) = map_pairs(dq), map_pairs(dk)
        if row_offsets_fit_int32(dq1) and row_offsets_fit_int32(dk1):
            *_, dv, grad_lam = _maps_backward(ctx, grad_out, grad_first_map, grads=(dq1, dk1, dq2, dk2))
        else:  # a sequence too long for int32 offsets into the pairs: each map's own gradient, then stacked
            dq1, dk1, dq2, dk2, dv, grad_lam = _maps_backward(ctx, grad_out, grad_first_map)
            dq, dk = (torch.stack(maps, dim=3).flatten(2, 3) for maps in ((dq1, dq2), (dk1, dk2)))
        return dq, dk, dv, grad_lam, None, None, None, None, None, None


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def differential_attention_triton(q1, k1, q2, k2, v, lam, *, causal=True, integral=False, softmax_scale=None,
                                  return_first_map=False, cu_seqlens=None, config: KernelConfig | None = None):
    """(A1 - lam A2) V (+ lam running-mean(A1 V) when `integral`), differentiable in all inputs and lam.

    Shapes, `return_first_map` and `cu_seqlens` (document masking, in the kernels themselves) as
    `megadiff.ops.differential_attention`. config fixes the tiles (else autotuned on CUDA).
    """
    check_shapes(q1, k1, q2, k2, v, lam, integral)
    _check_supported(q1, k1, q2, k2, v)
    documents = None if cu_seqlens is None else _documents(cu_seqlens, causal, q1, k1)
    return _DifferentialAttention.apply(q1, k1, q2, k2, v, lam, causal, integral, _scale(q1, softmax_scale), config,
                                        return_first_map, documents)


def paired_differential_attention_triton(q, k, v, lam, *, causal=True, integral=False, softmax_scale=None,
                                         return_first_map=False, cu_seqlens=None,
                                         config: KernelConfig | None = None):
    """As differential_attention_triton, with each head's two maps adjacent heads of q [B, N, 2Hq, d]
    and k [B, Nk, 2Hkv, d] (heads 2i and 2i + 1: head i's first and second map), megatron's layout:
    their gradients come back as one tensor each, in q's and k's layout."""
    if q.dim() != 4 or q.shape[2] % 2 or k.dim() != 4 or k.shape[2] % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, N, 2H, d]: two maps a head")
    (q1, q2), (k1, k2) = map_pairs(q), map_pairs(k)
    check_shapes(q1, k1, q2, k2, v, lam, integral)
    _check_supported(q1, k1, q2, k2, v)
    documents = None if cu_seqlens is None else _documents(cu_seqlens, causal, q1, k1)
    return _PairedDifferentialAttention.apply(q, k, v, lam, causal, integral, _scale(q1, softmax_scale), config,
                                              return_first_map, documents)


def differential_attention_triton_maps(q1, k1, q2, k2, v, *, causal=True, softmax_scale=None,
                                       config: KernelConfig | None = None):
    """Per-map partial results for merging across key chunks (context parallelism); no autograd.

    Returns (o1, o2, lse1, lse2): o_j = A_j V as fp32 [B, N, Hq, dv], lse_j = the natural-log
    log-sum-exp of the scaled, masked scores, fp32 [B, Hq, N]. Chunks merge as in FlashAttention:
    lse = logaddexp(lse_a, lse_b), o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b. The backward
    of a chunk is `attention_maps_backward` fed the merged lse and delta.
    """
    check_shapes(q1, k1, q2, k2, v, q1.new_zeros(()), integral=False)
    _check_supported(q1, k1, q2, k2, v)
    q1, k1, q2, k2, v = _kernel_layout(q1, k1, q2, k2, v)
    _, o1, o2, lse1, lse2 = attention_maps_forward(
        q1, k1, q2, k2, v, None, causal=causal, scale=_scale(q1, softmax_scale), o_dtype=torch.float32,
        config=config)
    return o1, o2, lse1, lse2


def tuned_tiles() -> dict[str, dict[str, str]]:
    """The tiles each kernel's autotuner chose in this process, by tuning key (shapes, modes, length
    class): what a benchmark's timings were measured with."""
    kernels = {"fwd": triton_fwd._fwd_kernel, "dkdv": triton_bwd._dkdv_kernel, "dq": triton_bwd._dq_kernel}
    tuners = {kind: triton_fwd._autotuned(kernel, kind) for kind, kernel in kernels.items()}
    return {kind: {str(key): str(config) for key, config in tuner.cache.items()}
            for kind, tuner in tuners.items() if tuner.cache}
