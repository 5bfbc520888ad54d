"""One entry point, `differential_attention`, over every implementation.

Order of preference: the fused Triton kernel (CUDA tensors), the SDPA-composed
path, the naive reference. `backend=` forces one.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from megadiff.ops.common import lambda_per_head, map_pairs, triton_supports
from megadiff.ops.documents import attend_by_document
from megadiff.ops.incremental import IntegralCarry
from megadiff.ops.reference import differential_attention_reference
from megadiff.ops.sdpa import differential_attention_sdpa

BACKENDS = ("auto", "triton", "sdpa", "sdpa_split_v", "reference")


NOT_IMPORTABLE = "triton (or the kernel module) is not importable"


def _kernel_module():
    """The fused kernel's module, or None where triton is missing (a CPU install need not have it)."""
    try:
        return importlib.import_module("megadiff.ops.triton_kernel")
    except ImportError:
        return None


def _triton_impl(name: str = "differential_attention_triton") -> Callable | None:
    kernel = _kernel_module()
    return None if kernel is None else getattr(kernel, name, None)


def triton_unavailable() -> str | None:
    """Why `backend='triton'` cannot run in this process (None when it can): asked before a run that names it."""
    kernel = _kernel_module()
    if kernel is None:
        return NOT_IMPORTABLE
    if not (torch.cuda.is_available() or kernel.INTERPRETED):
        return "the kernel needs a CUDA GPU (none is visible here), or TRITON_INTERPRET=1 to interpret it on the CPU"
    return None


def _triton_usable(q: torch.Tensor, value_dim: int) -> bool:
    return q.is_cuda and triton_supports(q.dtype, q.shape[-1], value_dim) and _triton_impl() is not None


def resolve_backend(backend: str, q: torch.Tensor, value_dim: int | None = None) -> str:
    """`auto`: the fused kernel for CUDA tensors it runs (dtype, head dims up to its tile's), else SDPA.
    `value_dim`: V's head width (default: q's)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "triton" if _triton_usable(q, value_dim or q.shape[-1]) else "sdpa"
    if backend == "triton" and _triton_impl() is None:
        raise RuntimeError(f"attention backend 'triton' requested but {NOT_IMPORTABLE}")
    return backend


def differential_attention(q1, k1, q2, k2, v, lam, *, causal: bool = True, integral: bool = False,
                           softmax_scale: float | None = None, backend: str = "auto",
                           return_first_map: bool = False, cu_seqlens=None, logit_bits: int | None = None,
                           integral_carry: IntegralCarry | None = None):
    """(A1 - lam A2) V, plus lam * running-mean(A1 V) when `integral` (DINT).

    q1, q2: [B, N, Hq, d]; k1, k2: [B, Nk, Hkv, d]; v: [B, Nk, Hkv, dv]; lam: [] or [Hq].
    Returns [B, N, Hq, dv], before the head-wise norm; with `return_first_map`, also the first
    map's output A1 V (same shape and dtype, differentiable), which every backend computes anyway:
    context parallelism continues the integral term across sequence chunks from it.
    `cu_seqlens` (causal only) masks attention between the documents it delimits among the keys,
    the queries being the last Nq of them (ops/documents.py); the integral's running mean then
    restarts with each document.
    `logit_bits` quantizes every map's scores before its softmax (the DIFF paper's Figure 8), which
    only the reference, materialising the maps, can do: it runs whatever `backend` says.
    `integral_carry` (with `integral`, incremental generation): the queries are the next positions
    after those the carry has seen, the keys all positions so far; the running mean includes them.
    """
    kwargs = dict(causal=causal, integral=integral, softmax_scale=softmax_scale, return_first_map=return_first_map)
    if logit_bits is not None:
        backend = "reference"
        kwargs["logit_bits"] = logit_bits
    chosen = resolve_backend(backend, q1, v.shape[-1])
    if integral and integral_carry is not None:
        if cu_seqlens is not None:
            raise ValueError("integral_carry continues one sequence: it takes no document boundaries")
        if chosen == "triton":
            return _kernel_continuing_the_integral(q1, k1, q2, k2, v, lam, integral_carry, **kwargs)
        # the backend adds the carried mean to O1 - lam O2 before rounding, as its whole-sequence forward does
        return _run(chosen, q1, k1, q2, k2, v, lam, integral_carry=integral_carry, **kwargs)
    if chosen == "triton":  # masks documents in its tiles
        return _triton_impl()(q1, k1, q2, k2, v, lam, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is not None:  # one call per document
        return attend_by_document(lambda *qkv: _run(chosen, *qkv, lam, **kwargs), cu_seqlens, q1, k1, q2, k2, v,
                                  causal=causal)
    return _run(chosen, q1, k1, q2, k2, v, lam, **kwargs)


def paired_differential_attention(q, k, v, lam, *, causal: bool = True, integral: bool = False,
                                  softmax_scale: float | None = None, backend: str = "auto",
                                  return_first_map: bool = False, cu_seqlens=None, logit_bits: int | None = None,
                                  integral_carry: IntegralCarry | None = None):
    """`differential_attention` over megatron's layout of the maps: q [B, N, 2Hq, d] and k [B, Nk, 2Hkv, d]
    whose heads 2i and 2i + 1 are head i's first and second map. The fused kernel then writes both
    maps' gradients into one tensor for q and one for k (the per-map views cost autograd a stack of
    them); every other path takes the views."""
    for name, paired in (("q", q), ("k", k)):
        if paired.dim() != 4 or paired.shape[2] % 2:  # the views of an odd count were told apart as two shapes
            raise ValueError(f"{name} must be [B, N, 2H, d], two maps a differential head, got {tuple(paired.shape)}")
    if resolve_backend(backend, q, v.shape[-1]) == "triton" and logit_bits is None and integral_carry is None:
        return _triton_impl("paired_differential_attention_triton")(
            q, k, v, lam, causal=causal, integral=integral, softmax_scale=softmax_scale,
            return_first_map=return_first_map, cu_seqlens=cu_seqlens)
    (q1, q2), (k1, k2) = map_pairs(q), map_pairs(k)
    return differential_attention(q1, k1, q2, k2, v, lam, causal=causal, integral=integral,
                                  softmax_scale=softmax_scale, backend=backend, return_first_map=return_first_map,
                                  cu_seqlens=cu_seqlens, logit_bits=logit_bits, integral_carry=integral_carry)


def _run(chosen: str, q1, k1, q2, k2, v, lam, **kwargs):
    if chosen == "sdpa":
        return differential_attention_sdpa(q1, k1, q2, k2, v, lam, **kwargs)
    if chosen == "sdpa_split_v":
        return differential_attention_sdpa(q1, k1, q2, k2, v, lam, split_v=True, **kwargs)
    return differential_attention_reference(q1, k1, q2, k2, v, lam, **kwargs)


def _kernel_continuing_the_integral(q1, k1, q2, k2, v, lam, carry: IntegralCarry, *, integral: bool,
                                    return_first_map: bool, **kwargs):
    """The fused kernel's rows continuing a sequence: its epilogue writes O1 - lam O2 in the inputs' dtype, to which
    the carried running mean is added in fp32, as the kernel's whole-sequence forward adds the integral."""
    out, first = _triton_impl()(q1, k1, q2, k2, v, lam, return_first_map=True, **kwargs)
    mean = carry.running_mean(first)
    lam_h = lambda_per_head(lam, q1.shape[2]).to(mean.dtype).view(1, 1, -1, 1)
    out = (out.to(mean.dtype) + lam_h * mean).to(out.dtype)
    return (out, first) if return_first_map else out
