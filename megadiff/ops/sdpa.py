"""Differential attention composed of two `scaled_dot_product_attention` calls.

No N x N map is materialised where SDPA has a fused backend (flash / memory
efficient / cuDNN on GPU, flash on CPU). Some fused backends need V as wide as
Q/K: `split_v=True` then runs each map on the two halves of V (4 calls).
"""
from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megadiff.ops.common import check_shapes, compiled_on, compute_dtype, lambda_per_head
from megadiff.ops.documents import attend_by_document
from megadiff.ops.incremental import IntegralCarry, integral_mean
from megadiff.ops.reference import softmax_attention_reference

SDPA_KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sdpa_kernel_order(kernels: list[str] | None) -> AbstractContextManager:
    """Within it, SDPA runs the first of `kernels` (names of SDPA_KERNELS) that takes the call, and no
    other; None leaves torch's own order. The backward runs the forward's kernel, so the forward is
    what needs it."""
    if kernels is None:
        return nullcontext()
    return sdpa_kernel([SDPA_KERNELS[name] for name in kernels], set_priority=True)


def sdpa_kernels_refusal(kernels: list[str], *, heads: int, kv_heads: int, head_dim: int, value_dim: int,
                         dtype: torch.dtype, device: torch.device, rows: int, keys: int) -> str | None:
    """Why none of `kernels` takes training's SDPA calls (inputs needing gradients, which some kernels'
    backward limits turn down) of these widths and dtype on `device` (None: one does), as torch's dispatcher
    answers for `rows` causal queries over `keys` keys (the last ones; fewer queries than keys take a mask),
    with its reasons for each kernel it declines."""
    def zeros(heads_, length, width):
        return torch.zeros(1, heads_, length, width, dtype=dtype, device=device, requires_grad=True)

    q, k, v = zeros(heads, rows, head_dim), zeros(kv_heads, keys, head_dim), zeros(kv_heads, keys, value_dim)
    with sdpa_kernel_order(kernels), warnings.catch_warnings(record=True) as reasons, torch.enable_grad():
        warnings.simplefilter("always")
        try:
            torch._fused_sdp_choice(q, k, v, **_sdpa_call(q, k, causal=True, scale=None))
            return None
        except RuntimeError as error:
            said = [str(reason.message).split(" (Triggered internally")[0].strip() for reason in reasons]
            said = [reason for reason in said if not reason.endswith(":")]  # headings of the reasons that follow
            return "; ".join(dict.fromkeys(said + [str(error).splitlines()[0].strip()]))


_kernel_records: list[list[str]] = []  # the lists recording_sdpa_kernels is filling


@contextmanager
def recording_sdpa_kernels():
    """Yields a list to which every SDPA call of this module appends, while it lasts, the name of the
    kernel torch runs it with (its dispatcher's answer for the call): which kernel ran is otherwise unseen,
    and torch's default order differs between versions and GPUs."""
    record: list[str] = []
    _kernel_records.append(record)
    try:
        yield record
    finally:
        _kernel_records.remove(record)


_KERNEL_NAMES = {int(backend): name for name, backend in SDPA_KERNELS.items()}


def _sdpa_call(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> dict:
    """SDPA's keyword arguments for q [B, Hq, Nq, d] over k [B, Hkv, Nk, d]: causal masking aligned
    bottom-right (queries fewer than keys are the last ones), GQA by SDPA itself. A single query (a decoding
    step) sees every key: it takes no mask, which would keep it off CUDA's flash kernel, and grouped queries
    then on the math kernel, which repeats the cached keys and values for every query head, at every step."""
    n_q, n_k = q.shape[2], k.shape[2]
    mask = None
    if causal and 1 < n_q != n_k:  # SDPA's is_causal is top-left aligned; we need bottom-right
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
    return dict(attn_mask=mask, is_causal=causal and n_q == n_k, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _sdpa(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """[B, N, H, d] in and out; GQA handled by SDPA itself."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    call = _sdpa_call(q, k, causal, scale)
    if _kernel_records:
        kernel = torch._fused_sdp_choice(q, k, v, **call)
        for record in _kernel_records:
            record.append(_KERNEL_NAMES.get(kernel, f"kernel {kernel}"))
    return F.scaled_dot_product_attention(q, k, v, **call).transpose(1, 2)


def _one_map(q, k, v, causal, scale, split_v):
    if not split_v:
        return _sdpa(q, k, v, causal, scale)
    v_a, v_b = v.chunk(2, dim=-1)
    return torch.cat([_sdpa(q, k, v_a, causal, scale), _sdpa(q, k, v_b, causal, scale)], dim=-1)


def differential_attention_sdpa(q1, k1, q2, k2, v, lam, *, causal=True, integral=False, softmax_scale=None,
                                split_v=False, return_first_map=False, integral_carry: IntegralCarry | None = None):
    check_shapes(q1, k1, q2, k2, v, lam, integral and integral_carry is None)
    if split_v and v.shape[-1] % 2:
        raise ValueError(f"split_v needs an even V head width, got {v.shape[-1]}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q1.shape[-1])
    o1 = _one_map(q1, k1, v, causal, scale, split_v)
    o2 = _one_map(q2, k2, v, causal, scale, split_v)
    lam_h = lambda_per_head(lam, q1.shape[2])
    # compiled on CUDA, where eager torch makes fp32 copies of both maps and of the gradient, some eight passes
    # over [B, N, H, 2d] fp32 tensors a layer (0.4 ms at the 3B shape and 4K tokens, against the attention's
    # 2-4 ms), keeps an fp32 copy of O2 for the backward, and adds a dozen passes for DINT's running mean.
    # lam_h in memory: its expanded form would be another compiled variant
    combine = compiled_on(o1.device, differential_combination)
    if integral_carry is not None:  # decoding: the carry updates itself, outside a compiled graph; the rows are few
        combine = differential_combination
    out = combine(o1, o2, lam_h.contiguous(), integral, causal, integral_carry)
    return (out, o1) if return_first_map else out


def differential_combination(o1: torch.Tensor, o2: torch.Tensor, lam_h: torch.Tensor, integral: bool = False,
                             causal: bool = True, integral_carry: IntegralCarry | None = None) -> torch.Tensor:
    """O1 - lam O2 (+ lam R(O1) with DINT's `integral`, R the running mean over positions, causal or not, continued
    from `integral_carry`'s positions where given) ([B, N, H, e] maps, lam_h [H]), computed in fp32 for low
    precision: the two maps cancel (the point of the difference), and the result in the maps' dtype."""
    work = compute_dtype(o1.dtype)
    first, lam_h = o1.to(work), lam_h.to(work).view(-1, 1)
    out = first - lam_h * o2.to(work)
    if integral:
        out = out + lam_h * integral_mean(first, causal, integral_carry)
    return out.to(o1.dtype)


def softmax_attention(q, k, v, *, causal=True, softmax_scale=None, cu_seqlens=None,
                      logit_bits: int | None = None) -> torch.Tensor:
    """One softmax map's output A V ([B, N, H, d] layout, bottom-right causal when Nq < Nk).

    `cu_seqlens` (causal only) masks attention between documents, as in
    `differential_attention`; `logit_bits` quantizes the scores, through the materialised map.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    def attend(q, k, v):
        if logit_bits is None:
            return _sdpa(q, k, v, causal, scale)
        return softmax_attention_reference(q, k, v, causal=causal, softmax_scale=scale, logit_bits=logit_bits)

    if cu_seqlens is None:
        return attend(q, k, v)
    return attend_by_document(attend, cu_seqlens, q, k, v, causal=causal)
