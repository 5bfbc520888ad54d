"""Triton backward of both maps (FlashAttention-2 scheme, no atomics, so deterministic).

Given dO1, dO2 (the gradients reaching O1 = A1 V and O2 = A2 V), the saved
log-sum-exps and delta_j = rowsum(dOj * Oj), per map j:
    P = exp(scale Q K^T - lse),  dP = dO V^T,  dS = P * (dP - delta),
    dV = sum_j Pj^T dOj,  dKj = scale dSj^T Qj,  dQj = scale dSj Kj.
One kernel owns a key tile and loops over query tiles (dK1, dK2, dV); for GQA
it also loops over the query heads of its K/V head, so the group's sum
happens in registers. A second kernel owns a query tile and loops over key
tiles (dQ1, dQ2). Both maps share every K/V/dO tile load.

"Tied" mode is plain DIFF: dO2 = -lam dO1, so dP2 = -lam dP1 and
dV = (P1 - lam P2)^T dO1 -- two fewer matmuls per tile pair.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megadiff.ops.triton_fwd import (
    LOG2E, Documents, KernelConfig, bnh_strides, document_key_tiles, dot_precision, in_document, key_range, launch,
    load_tile, padded_dim, store_tile, tuning_lengths, visible,
)


@triton.jit
def _query_range(start_n, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For a key tile: query tiles [lo, mid) and [max(mid, tail), n_q) need the mask, [mid, tail) not."""
    tail = n_q // BLOCK_M * BLOCK_M  # the partial last tile is masked
    if CAUSAL:
        shift = n_k - n_q
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M  # first tile that sees a key of ours
        full = (tl.maximum(start_n + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # sees all
        mid = tl.maximum(lo, tl.minimum(full, tail))
    else:
        lo = 0
        mid = 0
    return lo, mid, tail


@triton.jit
def document_query_ends(DOC_END, offs_n, n_q, n_k, BLOCK_M: tl.constexpr):
    """For a key tile: (the end of the queries that see any of its keys, the end of the whole query
    tiles inside all of its keys' documents), as query indices (the queries are the last keys)."""
    valid = offs_n < n_k
    shift = n_k - n_q
    ends = tl.load(DOC_END + offs_n, mask=valid, other=0)
    # >= 0: a tile whose documents all end before the first query (a context-parallel chunk's early keys) has
    # no query that sees it, and its ranges must come out empty rather than reach before the queries
    last = tl.maximum(tl.max(ends, 0) - shift, 0)
    first = tl.min(tl.where(valid, ends, n_k), 0) - shift
    return last, tl.maximum(first, 0) // BLOCK_M * BLOCK_M


@triton.jit
def _dkdv_tiles(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO1, DO2, LSE1, LSE2, DELTA1, DELTA2, DOC_START, lam,
                stride_qn, stride_don, offs_n, offs_d, offs_dv, lo, hi, n_q, n_k, qk_scale,
                HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, DOCUMENTS: tl.constexpr, TIED: tl.constexpr, DOT_PREC: tl.constexpr,
                WANT_DK: tl.constexpr, WANT_DV: tl.constexpr):
    # transposed orientation: rows are our keys, columns the query tile
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_q = offs_m < n_q
        q1 = load_tile(Q1, offs_m, stride_qn, offs_d, n_q, HEAD_D)
        q2 = load_tile(Q2, offs_m, stride_qn, offs_d, n_q, HEAD_D)
        do1 = load_tile(DO1, offs_m, stride_don, offs_dv, n_q, HEAD_DV)
        lse1 = tl.load(LSE1 + offs_m, mask=in_q, other=0.0) * LOG2E
        lse2 = tl.load(LSE2 + offs_m, mask=in_q, other=0.0) * LOG2E
        p1 = tl.exp2(tl.dot(k1, tl.trans(q1), input_precision=DOT_PREC) * qk_scale - lse1[None, :])
        p2 = tl.exp2(tl.dot(k2, tl.trans(q2), input_precision=DOT_PREC) * qk_scale - lse2[None, :])
        if MASKED:
            ok = visible(offs_m[None, :], offs_n[:, None], n_q, n_k, CAUSAL)
            if DOCUMENTS:
                q_start = tl.load(DOC_START + offs_m, mask=in_q, other=n_k)
                ok = in_document(ok, q_start[None, :], offs_n[:, None], DOCUMENTS)
            p1 = tl.where(ok, p1, 0.0)
            p2 = tl.where(ok, p2, 0.0)
        if WANT_DK:  # the fused program's order: dP1, dV, then dP2 (fewer registers spilled than dV first)
            dp1 = tl.dot(v, tl.trans(do1), input_precision=DOT_PREC)
        do2 = do1  # placeholder: tied mode derives dP2 from dP1 and never reads dO2
        if not TIED:
            do2 = load_tile(DO2, offs_m, stride_don, offs_dv, n_q, HEAD_DV)
        if WANT_DV:
            if TIED:
                dv = tl.dot((p1 - lam * p2).to(do1.dtype), do1, dv, input_precision=DOT_PREC)
            else:
                dv = tl.dot(p1.to(do1.dtype), do1, dv, input_precision=DOT_PREC)
                dv = tl.dot(p2.to(do2.dtype), do2, dv, input_precision=DOT_PREC)
        if WANT_DK:
            if TIED:
                dp2 = -lam * dp1
            else:
                dp2 = tl.dot(v, tl.trans(do2), input_precision=DOT_PREC)
            ds1 = p1 * (dp1 - tl.load(DELTA1 + offs_m, mask=in_q, other=0.0)[None, :])
            ds2 = p2 * (dp2 - tl.load(DELTA2 + offs_m, mask=in_q, other=0.0)[None, :])
            dk1 = tl.dot(ds1.to(q1.dtype), q1, dk1, input_precision=DOT_PREC)
            dk2 = tl.dot(ds2.to(q2.dtype), q2, dk2, input_precision=DOT_PREC)
    return dk1, dk2, dv


@triton.jit
def _dkdv_key_tile(Q1, Q2, K1, K2, V, DO1, DO2, LSE1, LSE2, DELTA1, DELTA2, LAM, DOC_START, DOC_END, DK1, DK2, DV,
                   stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                   stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                   stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                   n_q, n_k, n_heads, group, qk_scale, scale,
                   HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TIED: tl.constexpr,
                   DOCUMENTS: tl.constexpr, DOT_PREC: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr):
    """dK1 and dK2 (WANT_DK) and/or dV (WANT_DV) of the program's key tile."""
    start_n = tl.program_id(0) * BLOCK_N
    n_kv = n_heads // group
    b = (tl.program_id(1) // n_kv).to(tl.int64)
    h_kv = (tl.program_id(1) % n_kv).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_off = b * stride_kb + h_kv * stride_kh
    k1 = load_tile(K1 + k_off, offs_n, stride_kn, offs_d, n_k, HEAD_D)
    k2 = load_tile(K2 + k_off, offs_n, stride_kn, offs_d, n_k, HEAD_D)
    v = k1  # placeholder: only dK's dP = dO V^T reads V
    if WANT_DK:
        v = load_tile(V + b * stride_vb + h_kv * stride_vh, offs_n, stride_vn, offs_dv, n_k, HEAD_DV)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, mid, tail = _query_range(start_n, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_end = n_q
    if DOCUMENTS:  # our keys' queries end with the last of their documents; before the first's end, no mask
        q_end, whole_end = document_query_ends(DOC_END + b * n_k, offs_n, n_q, n_k, BLOCK_M)
        mid = tl.minimum(mid, q_end)
        tail = tl.maximum(mid, tl.minimum(tail, whole_end))
    DOCSb = DOC_START + b * n_q
    for g in range(group):
        h = h_kv * group + g
        q_off = b * stride_qb + h * stride_qh
        do_off = b * stride_dob + h * stride_doh
        row_off = (b * n_heads + h) * n_q
        lam = tl.load(LAM + h)
        Q1h, Q2h, DO1h, DO2h = Q1 + q_off, Q2 + q_off, DO1 + do_off, DO2 + do_off
        LSE1h, LSE2h, DELTA1h, DELTA2h = LSE1 + row_off, LSE2 + row_off, DELTA1 + row_off, DELTA2 + row_off
        dk1, dk2, dv = _dkdv_tiles(
            dk1, dk2, dv, k1, k2, v, Q1h, Q2h, DO1h, DO2h, LSE1h, LSE2h, DELTA1h, DELTA2h, DOCSb, lam,
            stride_qn, stride_don, offs_n, offs_d, offs_dv, lo, mid, n_q, n_k, qk_scale,
            HEAD_D, HEAD_DV, BLOCK_M, CAUSAL, True, DOCUMENTS, TIED, DOT_PREC, WANT_DK, WANT_DV)
        dk1, dk2, dv = _dkdv_tiles(
            dk1, dk2, dv, k1, k2, v, Q1h, Q2h, DO1h, DO2h, LSE1h, LSE2h, DELTA1h, DELTA2h, DOCSb, lam,
            stride_qn, stride_don, offs_n, offs_d, offs_dv, mid, tail, n_q, n_k, qk_scale,
            HEAD_D, HEAD_DV, BLOCK_M, CAUSAL, False, DOCUMENTS, TIED, DOT_PREC, WANT_DK, WANT_DV)
        dk1, dk2, dv = _dkdv_tiles(
            dk1, dk2, dv, k1, k2, v, Q1h, Q2h, DO1h, DO2h, LSE1h, LSE2h, DELTA1h, DELTA2h, DOCSb, lam,
            stride_qn, stride_don, offs_n, offs_d, offs_dv, tl.maximum(mid, tail), q_end, n_q, n_k, qk_scale,
            HEAD_D, HEAD_DV, BLOCK_M, CAUSAL, True, DOCUMENTS, TIED, DOT_PREC, WANT_DK, WANT_DV)

    if WANT_DK:
        dk_off = b * stride_dkb + h_kv * stride_dkh
        store_tile(DK1 + dk_off, dk1 * scale, offs_n, stride_dkn, offs_d, n_k, HEAD_D)
        store_tile(DK2 + dk_off, dk2 * scale, offs_n, stride_dkn, offs_d, n_k, HEAD_D)
    if WANT_DV:
        store_tile(DV + b * stride_dvb + h_kv * stride_dvh, dv, offs_n, stride_dvn, offs_dv, n_k, HEAD_DV)


@triton.jit(do_not_specialize=["n_q", "n_k"])  # as the forward kernel: one compile per tile for every length
def _dkdv_kernel(Q1, Q2, K1, K2, V, DO1, DO2, LSE1, LSE2, DELTA1, DELTA2, LAM, DOC_START, DOC_END, DK1, DK2, DV,
                 stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                 stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                 n_q, n_k, n_heads, group, qk_scale, scale, tune_n_q, tune_n_k,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TIED: tl.constexpr,
                 DOCUMENTS: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr = False):
    """SPLIT: two programs per key tile (grid axis 2), one for dK1 and dK2, one for dV, each holding half the
    accumulators of one doing both (at the 3B shape 256 columns per key instead of 512), so that key tiles of 64
    rows and more fit the registers, at the cost of computing the scores in both."""
    args = (Q1, Q2, K1, K2, V, DO1, DO2, LSE1, LSE2, DELTA1, DELTA2, LAM, DOC_START, DOC_END, DK1, DK2, DV,
            stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
            stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
            n_q, n_k, n_heads, group, qk_scale, scale)
    if not SPLIT:
        _dkdv_key_tile(*args, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, TIED, DOCUMENTS, DOT_PREC,
                       True, True)
    elif tl.program_id(2) == 0:
        _dkdv_key_tile(*args, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, TIED, DOCUMENTS, DOT_PREC,
                       True, False)
    else:
        _dkdv_key_tile(*args, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, TIED, DOCUMENTS, DOT_PREC,
                       False, True)


@triton.jit
def _dq_tiles(dq1, dq2, q1, q2, do1, do2, lse1, lse2, delta1, delta2, lam, K1, K2, V, stride_kn, stride_vn,
              offs_m, q_start, offs_d, offs_dv, lo, hi, n_q, n_k, qk_scale,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              MASKED: tl.constexpr, DOCUMENTS: tl.constexpr, TIED: tl.constexpr, DOT_PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1 = load_tile(K1, offs_n, stride_kn, offs_d, n_k, HEAD_D)
        k2 = load_tile(K2, offs_n, stride_kn, offs_d, n_k, HEAD_D)
        v = load_tile(V, offs_n, stride_vn, offs_dv, n_k, HEAD_DV)
        p1 = tl.exp2(tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale - lse1[:, None])
        p2 = tl.exp2(tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale - lse2[:, None])
        if MASKED:
            ok = in_document(visible(offs_m[:, None], offs_n[None, :], n_q, n_k, CAUSAL), q_start[:, None],
                             offs_n[None, :], DOCUMENTS)
            p1 = tl.where(ok, p1, 0.0)
            p2 = tl.where(ok, p2, 0.0)
        dp1 = tl.dot(do1, tl.trans(v), input_precision=DOT_PREC)
        if TIED:
            dp2 = -lam * dp1
        else:
            dp2 = tl.dot(do2, tl.trans(v), input_precision=DOT_PREC)
        ds1 = p1 * (dp1 - delta1[:, None])
        ds2 = p2 * (dp2 - delta2[:, None])
        dq1 = tl.dot(ds1.to(k1.dtype), k1, dq1, input_precision=DOT_PREC)
        dq2 = tl.dot(ds2.to(k2.dtype), k2, dq2, input_precision=DOT_PREC)
    return dq1, dq2


@triton.jit(do_not_specialize=["n_q", "n_k"])
def _dq_kernel(Q1, Q2, K1, K2, V, DO1, DO2, LSE1, LSE2, DELTA1, DELTA2, LAM, DOC_START, DOC_END, DQ1, DQ2,
               stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
               stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
               stride_dqb, stride_dqn, stride_dqh,
               n_q, n_k, n_heads, group, qk_scale, scale, tune_n_q, tune_n_k,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TIED: tl.constexpr,
               DOCUMENTS: tl.constexpr, DOT_PREC: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    h_kv = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = offs_m < n_q

    q_off = b * stride_qb + h * stride_qh
    q1 = load_tile(Q1 + q_off, offs_m, stride_qn, offs_d, n_q, HEAD_D)
    q2 = load_tile(Q2 + q_off, offs_m, stride_qn, offs_d, n_q, HEAD_D)
    do_off = b * stride_dob + h * stride_doh
    do1 = load_tile(DO1 + do_off, offs_m, stride_don, offs_dv, n_q, HEAD_DV)
    if TIED:
        do2 = do1  # placeholder: tied mode derives dP2 from dP1 and never reads dO2
    else:
        do2 = load_tile(DO2 + do_off, offs_m, stride_don, offs_dv, n_q, HEAD_DV)
    row = bh * n_q + offs_m
    lse1 = tl.load(LSE1 + row, mask=in_q, other=0.0) * LOG2E
    lse2 = tl.load(LSE2 + row, mask=in_q, other=0.0) * LOG2E
    delta1 = tl.load(DELTA1 + row, mask=in_q, other=0.0)
    delta2 = tl.load(DELTA2 + row, mask=in_q, other=0.0)
    lam = tl.load(LAM + h)
    k_off = b * stride_kb + h_kv * stride_kh
    v_off = b * stride_vb + h_kv * stride_vh
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full, end = key_range(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_start, inner = offs_m, 0
    if DOCUMENTS:  # as the forward
        q_start, lo, inner = document_key_tiles(DOC_START + b * n_q, offs_m, n_q, n_k, BLOCK_N)
        inner = tl.minimum(inner, end)
        dq1, dq2 = _dq_tiles(dq1, dq2, q1, q2, do1, do2, lse1, lse2, delta1, delta2, lam,
                             K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn, offs_m, q_start, offs_d,
                             offs_dv, lo, inner, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, True, True,
                             TIED, DOT_PREC)
        full = tl.maximum(full, inner)
    dq1, dq2 = _dq_tiles(dq1, dq2, q1, q2, do1, do2, lse1, lse2, delta1, delta2, lam,
                         K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn, offs_m, q_start, offs_d,
                         offs_dv, inner, full, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, False, DOCUMENTS,
                         TIED, DOT_PREC)
    dq1, dq2 = _dq_tiles(dq1, dq2, q1, q2, do1, do2, lse1, lse2, delta1, delta2, lam,
                         K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn, offs_m, q_start, offs_d,
                         offs_dv, full, end, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, True, DOCUMENTS,
                         TIED, DOT_PREC)

    dq_off = b * stride_dqb + h * stride_dqh
    store_tile(DQ1 + dq_off, dq1 * scale, offs_m, stride_dqn, offs_d, n_q, HEAD_D)
    store_tile(DQ2 + dq_off, dq2 * scale, offs_m, stride_dqn, offs_d, n_q, HEAD_D)


@triton.jit
def _row_dots_kernel(A, B, OUT, stride_ab, stride_an, stride_ah, stride_bb, stride_bn, stride_bh, n, n_heads, width,
                     BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_E)
    a = load_tile(A + b * stride_ab + h * stride_ah, rows, stride_an, cols, n, width).to(tl.float32)
    x = load_tile(B + b * stride_bb + h * stride_bh, rows, stride_bn, cols, n, width).to(tl.float32)
    tl.store(OUT + bh * n + rows, tl.sum(a * x, axis=1), mask=rows < n)


ROW_DOTS_ROWS = 16  # rows per program: two 16 x 256 fp32 tiles in registers at the 3B shape


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_e a * b over the last dim, accumulated in fp32: [B, N, H, e] twice -> [B, H, N] fp32 (the
    layout of delta). Reads a and b once in their own dtype: no fp32 copies of them (FlashAttention's
    backward preprocessing)."""
    batch, n, heads, width = a.shape
    out = torch.empty(batch, heads, n, device=a.device, dtype=torch.float32)
    _row_dots_kernel[(triton.cdiv(n, ROW_DOTS_ROWS), batch * heads)](
        a, b, out, *bnh_strides(a), *bnh_strides(b), n, heads, width,
        BLOCK_ROWS=ROW_DOTS_ROWS, BLOCK_E=triton.next_power_of_2(width))
    return out


def attention_maps_backward(q1, k1, q2, k2, v, do1, do2, lam_h, lse1, lse2, delta1, delta2, *,
                            causal: bool, scale: float, config: KernelConfig | None = None,
                            documents: Documents | None = None, grads: tuple | None = None):
    """Returns (dq1, dk1, dq2, dk2, dv) given the gradients dO1, dO2 reaching each map's output.

    do2=None means dO2 = -lam_h dO1 (plain DIFF); lam_h: fp32 [Hq]. do1/do2 and q1/q2, k1/k2 must share
    layouts. lse1, lse2 (natural log) and delta_j = rowsum(dOj * Oj) are [B, Hq, N] fp32, contiguous.
    A context-parallel caller passes the merged (global) lse and delta of its rows. `documents`: as
    in attention_maps_forward. `grads`: (dq1, dk1, dq2, dk2) to write into (dq1/dq2 and dk1/dk2
    sharing their layouts, a dense last dim), else new contiguous tensors.
    """
    b, n_q, n_heads, d = q1.shape
    n_k, n_kv, dv_dim = k1.shape[1], k1.shape[2], v.shape[-1]
    tied = do2 is None
    if grads is None:  # new_empty: contiguous even for strided inputs
        grads = (q1.new_empty(q1.shape), k1.new_empty(k1.shape), q1.new_empty(q1.shape), k1.new_empty(k1.shape))
    dq1, dk1, dq2, dk2 = grads
    dv = v.new_empty(v.shape)
    inputs = (q1, q2, k1, k2, v, do1, do1 if tied else do2, lse1, lse2, delta1, delta2, lam_h,
              *((documents.starts, documents.ends) if documents is not None else (lse1, lse1)))  # placeholders
    in_strides = (*bnh_strides(q1), *bnh_strides(k1), *bnh_strides(v), *bnh_strides(do1))
    sizes = (n_q, n_k, n_heads, n_heads // n_kv, scale * math.log2(math.e), scale, *tuning_lengths(n_q, n_k))
    meta = dict(HEAD_D=d, HEAD_DV=dv_dim, BLOCK_D=padded_dim(d), BLOCK_DV=padded_dim(dv_dim), CAUSAL=causal,
                TIED=tied, DOCUMENTS=documents is not None, DOT_PREC=dot_precision(q1.dtype))
    launch(_dkdv_kernel, "dkdv", n_k, b * n_kv,
           (*inputs, dk1, dk2, dv, *in_strides, *bnh_strides(dk1), *bnh_strides(dv), *sizes), meta, config)
    launch(_dq_kernel, "dq", n_q, b * n_heads,
           (*inputs, dq1, dq2, *in_strides, *bnh_strides(dq1), *sizes), meta, config)
    return dq1, dk1, dq2, dk2, dv

