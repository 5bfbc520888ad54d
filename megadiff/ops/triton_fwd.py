"""Triton forward: both maps' outputs O1 = A1 V and O2 = A2 V in one pass over K/V.

One program owns a query tile of one (batch, query head). It runs two online
softmaxes (FlashAttention-2 style) that share every V tile it loads, then
writes O1, O2, both log-sum-exps and, optionally, O1 - lam O2.

Also home of what the backward kernels share: tile loads, the causal mask
(bottom-right aligned, like the reference), the document mask, tile ranges and the launcher.
Layout: q, k, v, o are [B, N, H, dim] with any batch/sequence/head strides and
a dense last dim; log-sum-exps are [B, H, N] fp32 in natural-log units.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from megadiff.ops.common import triton_candidates_limit

# softmax runs in base 2 (exp2 is the fast instruction); stored log-sum-exps stay natural
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class Documents:
    """Document masking for the kernels, int32 contiguous device tensors in key positions (the
    queries are the last Nq of the Nk keys): each query's document start, [B, Nq], and each key's
    document end (exclusive), [B, Nk]."""
    starts: torch.Tensor
    ends: torch.Tensor


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options; block_m tiles queries, block_n tiles keys. split: the dK/dV kernel runs
    two programs per key tile, one for dK1 and dK2, one for dV (the other kernels ignore it)."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1
    split: bool = False


# Candidates (block_m, block_n, num_warps, num_stages[, split]) for triton.autotune on CUDA; those whose fp32
# accumulators would not fit in registers are pruned first. At the 3B head shape (d=128, dv=256)
# most candidates hold 128 fp32 accumulators per thread and ptxas spills some registers, the larger
# tiles most (bench/kernel_resources.py prints each one's registers, spills and shared memory for
# sm_90 without a GPU). Which is fastest is for the autotuner to measure. Each list starts
# with the tile that won at the 3B shape when every candidate was measured (H200, 2026-11-27, N = 4K to 64K
# alike), so that $MEGADIFF_TRITON_CANDIDATES=3 measures it. The split dK/dV tiles (KernelConfig.split) hold
# half the accumulators, so 128 keys fit (a warp-group MMA's rows on Hopper, where the fused kernel's 32-key tile
# is not one), for computing the scores twice; they are to be measured on a GPU.
CANDIDATES = {
    "fwd": [(64, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2),
            (32, 64, 8, 2), (32, 32, 8, 2)],
    "dkdv": [(64, 32, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2), (64, 64, 8, 2), (32, 128, 8, 2), (16, 64, 4, 2),
             (64, 128, 8, 2), (32, 32, 8, 2), (16, 32, 8, 2), (32, 128, 8, 2, True), (32, 64, 8, 2, True)],
    "dq": [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
           (64, 32, 8, 2), (32, 32, 4, 2)],
}
# fp32 accumulator elements a program holds, per kernel (block_m, block_n, padded d, padded dv, split: one of the
# dK/dV kernel's two programs per key tile, dK1 and dK2 or dV)
_ACCUMULATORS = {
    "fwd": lambda m, n, d, dv, split: 2 * m * dv,
    "dkdv": lambda m, n, d, dv, split: n * (max(2 * d, dv) if split else 2 * d + dv),
    "dq": lambda m, n, d, dv, split: 2 * m * d,
}
_MAX_ACC_PER_THREAD = 128
INTERPRETER_CONFIG = KernelConfig(block_m=32, block_n=32)
# Fused multiply-adds on: Triton's default until 3.10 turns it off. The kernels' speed and their
# tested accuracy assume FMAs, so a Triton upgrade must not change them silently.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


@triton.jit
def load_tile(ptr, rows, stride_row, cols, n_rows, n_cols):
    """[rows, cols] tile, zero outside the tensor (the sequence tail and the head-dim padding)."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, tile, rows, stride_row, cols, n_rows, n_cols):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride_row + cols[None, :], tile, mask=mask)


@triton.jit
def visible(q_idx, k_idx, n_q, n_k, CAUSAL: tl.constexpr):
    """Which (query, key) pairs exist and pass the mask; q_idx and k_idx broadcast against each other."""
    ok = (q_idx < n_q) & (k_idx < n_k)
    if CAUSAL:
        ok = ok & (k_idx <= q_idx + (n_k - n_q))  # query i sees keys j <= i + n_k - n_q
    return ok


@triton.jit
def key_range(start_m, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For a query tile: keys [0, full) need no mask, keys [full, end) do, later keys are invisible."""
    if CAUSAL:
        shift = n_k - n_q
        end = tl.minimum(n_k, start_m + BLOCK_M + shift)
        full = tl.minimum(start_m + shift + 1, n_k) // BLOCK_N * BLOCK_N
    else:
        end = n_k
        full = n_k // BLOCK_N * BLOCK_N
    return full, end


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr, DOCUMENTS: tl.constexpr):
    """One online-softmax update with base-2 scores s: rescale the running sums, add this tile."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if DOCUMENTS:  # a row may see no key of its first tiles (its document starts later): its sums stay 0,
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # not NaN, and its max stays -inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def in_document(ok, q_start, k_idx, DOCUMENTS: tl.constexpr):
    """Document masking: a query sees keys from its document's start (q_start broadcasts against k_idx)."""
    if DOCUMENTS:
        ok = ok & (k_idx >= q_start)
    return ok


@triton.jit
def document_key_tiles(DOC_START, offs_m, n_q, n_k, BLOCK_N: tl.constexpr):
    """For a query tile: (each row's document start, the first key tile any row sees, the first key
    tile at or after every row's document start, from which on only the causal mask can apply)."""
    valid = offs_m < n_q
    q_start = tl.load(DOC_START + offs_m, mask=valid, other=n_k)
    lo = tl.min(q_start, 0) // BLOCK_N * BLOCK_N
    inner = (tl.max(tl.where(valid, q_start, 0), 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return q_start, lo, inner


@triton.jit
def _fwd_tiles(acc1, l1, m1, acc2, l2, m2, q1, q2, K1, K2, V, stride_kn, stride_vn,
               offs_m, q_start, offs_d, offs_dv, lo, hi, n_q, n_k, qk_scale,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOCUMENTS: tl.constexpr, DOT_PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1 = load_tile(K1, offs_n, stride_kn, offs_d, n_k, HEAD_D)
        k2 = load_tile(K2, offs_n, stride_kn, offs_d, n_k, HEAD_D)
        v = load_tile(V, offs_n, stride_vn, offs_dv, n_k, HEAD_DV)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
        s2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
        if MASKED:
            ok = in_document(visible(offs_m[:, None], offs_n[None, :], n_q, n_k, CAUSAL), q_start[:, None],
                             offs_n[None, :], DOCUMENTS)
            s1 = tl.where(ok, s1, float("-inf"))
            s2 = tl.where(ok, s2, float("-inf"))
        # without documents key 0 is visible to every query and comes first: no running max stays -inf
        acc1, l1, m1 = _softmax_step(acc1, l1, m1, s1, v, DOT_PREC, DOCUMENTS)
        acc2, l2, m2 = _softmax_step(acc2, l2, m2, s2, v, DOT_PREC, DOCUMENTS)
    return acc1, l1, m1, acc2, l2, m2


# not specialized on the lengths: Triton compiles apart for an int equal to 1 (and for one divisible by
# 16), so a decoding step (one query, keys growing by one) compiled every tile candidate again at its
# first token, some 50 s at the 3B head shape; the kernel gains nothing from either
@triton.jit(do_not_specialize=["n_q", "n_k"])
def _fwd_kernel(Q1, Q2, K1, K2, V, LAM, O1, O2, OUT, LSE1, LSE2, DOC_START,
                stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                n_q, n_k, n_heads, group, qk_scale, tune_n_q, tune_n_k,
                HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                COMBINE: tl.constexpr, DOCUMENTS: tl.constexpr, DOT_PREC: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)  # int64 offsets: batch * stride can pass 2^31
    h = (bh % n_heads).to(tl.int64)
    h_kv = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_off = b * stride_qb + h * stride_qh
    q1 = load_tile(Q1 + q_off, offs_m, stride_qn, offs_d, n_q, HEAD_D)
    q2 = load_tile(Q2 + q_off, offs_m, stride_qn, offs_d, n_q, HEAD_D)
    k_off = b * stride_kb + h_kv * stride_kh
    v_off = b * stride_vb + h_kv * stride_vh

    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    m1 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    full, end = key_range(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_start, inner = offs_m, 0
    if DOCUMENTS:  # keys of earlier documents: skipped up to lo, masked up to inner
        q_start, lo, inner = document_key_tiles(DOC_START + b * n_q, offs_m, n_q, n_k, BLOCK_N)
        inner = tl.minimum(inner, end)
        acc1, l1, m1, acc2, l2, m2 = _fwd_tiles(
            acc1, l1, m1, acc2, l2, m2, q1, q2, K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn,
            offs_m, q_start, offs_d, offs_dv, lo, inner, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, True,
            True, DOT_PREC)
        full = tl.maximum(full, inner)
    acc1, l1, m1, acc2, l2, m2 = _fwd_tiles(
        acc1, l1, m1, acc2, l2, m2, q1, q2, K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn,
        offs_m, q_start, offs_d, offs_dv, inner, full, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, False,
        DOCUMENTS, DOT_PREC)
    acc1, l1, m1, acc2, l2, m2 = _fwd_tiles(
        acc1, l1, m1, acc2, l2, m2, q1, q2, K1 + k_off, K2 + k_off, V + v_off, stride_kn, stride_vn,
        offs_m, q_start, offs_d, offs_dv, full, end, n_q, n_k, qk_scale, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, True,
        DOCUMENTS, DOT_PREC)

    o1 = acc1 / l1[:, None]
    o2 = acc2 / l2[:, None]
    o_off = b * stride_ob + h * stride_oh
    store_tile(O1 + o_off, o1, offs_m, stride_on, offs_dv, n_q, HEAD_DV)
    store_tile(O2 + o_off, o2, offs_m, stride_on, offs_dv, n_q, HEAD_DV)
    if COMBINE:
        lam = tl.load(LAM + h)
        store_tile(OUT + o_off, o1 - lam * o2, offs_m, stride_on, offs_dv, n_q, HEAD_DV)
    lse_off = bh * n_q + offs_m
    tl.store(LSE1 + lse_off, (m1 + tl.log2(l1)) * LN2, mask=offs_m < n_q)
    tl.store(LSE2 + lse_off, (m2 + tl.log2(l2)) * LN2, mask=offs_m < n_q)


INTERPRETED = isinstance(_fwd_kernel, InterpretedFunction)


def padded_dim(n: int) -> int:
    """tl.dot needs power-of-2 tiles of at least 16; narrower or odd head dims are zero-padded."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products rather than TF32, to match the reference
    return "ieee" if dtype == torch.float32 else "tf32"


def bnh_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, sequence and head strides of a [B, N, H, dim] tensor with a dense last dim."""
    assert t.stride(-1) == 1, "the kernels need a dense last dim"
    return t.stride(0), t.stride(1), t.stride(2)


def row_offsets_fit_int32(t: torch.Tensor) -> bool:
    """The kernels index within one (batch, head) slice in int32: row * sequence stride + column."""
    return (t.shape[1] - 1) * t.stride(1) + t.shape[-1] < 2 ** 31


def shared_layout(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels take one set of strides for q1/q2 (and k1/k2, do1/do2): make them agree.

    Views whose sequence stride is too large for int32 offsets (a long sequence in a fused
    [N, B, ...] projection) are copied to a dense layout, where N x H x dim fits.
    """
    first = tensors[0]
    if all(t.stride() == first.stride() and t.stride(-1) == 1 and row_offsets_fit_int32(t) for t in tensors):
        return tensors
    return tuple(t.contiguous() for t in tensors)


def shared_memory_estimate(kind: str, block_m: int, block_n: int, num_stages: int, block_d: int, block_dv: int,
                           element_size: int, tied: bool = True, arch: int = 90) -> int:
    """Bytes of shared memory a program of the kind's kernel needs on a GPU of compute capability arch / 10:
    the dots' operand tiles, those it keeps and those its loop streams, and score tiles changing layout.

    Fitted to what Triton 3.6 and 3.9 allocate for sm_90 and sm_80 at a launch on aligned tensors
    (metadata.shared, as python bench/kernel_resources.py --all prints it, which matched the H200's launches
    on 2026-11-27): never below it, equal for the forward's and dQ's tiles. A launch needing more than the
    GPU has fails, and an autotuner left with one candidate launches it untried.

    On Hopper a 16-bit dot over 64 rows or more (query rows; key rows in dK/dV) is a warp-group MMA reading
    its streamed operand from shared memory, which the pipeliner fills asynchronously: a buffer per stage
    (Triton allocated 256 KiB for dQ's 128x64 tile in bf16 where one buffer fewer gives 192, and the H200
    refused the launch). Otherwise the dots read registers: a buffer fewer, plus the score tile in the inputs'
    dtype (fp32: P and the row maxima in the forward, dS1 and dS2 in dQ). Blackwell (sm_100) is not fitted:
    Hopper's estimate with margins that covered some 40 tiles compiled for it (Triton 3.9).
    """
    hopper = _shared_memory(kind, block_m, block_n, num_stages, block_d, block_dv, element_size,
                            block_dv if tied else 2 * block_dv, arch >= 90 and element_size < 4)
    if arch < 100:
        return hopper
    if kind == "fwd":
        return hopper + 2048
    return hopper * (118 if kind == "dq" else 140 if block_n >= 64 else 100) // 100


def _shared_memory(kind: str, block_m: int, block_n: int, num_stages: int, block_d: int, block_dv: int,
                   element_size: int, do_cols: int, warp_group_mma: bool) -> int:
    """shared_memory_estimate on sm_80 (warp_group_mma False) and sm_90; do_cols: the dO columns a backward
    program reads (dv when tied, else 2 dv)."""
    if kind == "dkdv":  # K1, K2, V kept; Q1, Q2, dO streamed; the rows' lse, delta and document starts
        kept, streamed_rows = block_n * (2 * block_d + block_dv), block_m * (2 * block_d + do_cols)
        if warp_group_mma and block_n >= 64:
            return (kept + num_stages * streamed_rows + block_m * block_n) * element_size + 32 * block_m
        # P1, P2, dS1, dS2 in fp32
        return (kept + (num_stages - 1) * streamed_rows) * element_size + 16 * block_m * block_n + 32 * block_m
    warp_group_mma = warp_group_mma and block_m >= 64
    streamed = block_n * (2 * block_d + block_dv) * (num_stages if warp_group_mma else num_stages - 1)  # K1, K2, V
    kept = block_m * (2 * block_d + (0 if kind == "fwd" else do_cols))  # Q1, Q2 (and dO)
    if warp_group_mma:
        scratch = 0
    elif element_size < 4:
        scratch = block_m * block_n * element_size
    else:
        scratch = 4 * block_m * (block_n + 1) if kind == "fwd" else 8 * block_m * block_n
    return (kept + streamed) * element_size + scratch


def shared_memory_budget(device: torch.device) -> tuple[int, int] | None:
    """(the shared memory a program may use, compute capability x 10) on a CUDA device (227 KiB and 90 on an
    H100), None elsewhere: the interpreter has no such limit."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"], 10 * major + minor


def tile_config(tile: tuple) -> triton.Config:
    """A CANDIDATES entry as the autotuner's config (SPLIT only where set: the other kernels take no such
    argument)."""
    block_m, block_n, num_warps, num_stages, *split = tile
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, **({"SPLIT": True} if any(split) else {})},
                         num_warps=num_warps, num_stages=num_stages)


def config_tile(config: triton.Config) -> tuple:
    """The CANDIDATES entry an autotuner's config stands for."""
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return tile + (True,) if config.kwargs.get("SPLIT") else tile


def _fitting(kind: str, candidates: list, block_d: int, block_dv: int, tile=lambda candidate: candidate) -> list:
    """The candidates whose fp32 accumulators fit the per-thread budget, else the one needing fewest.
    tile(candidate): its CANDIDATES entry."""
    def per_thread(candidate):
        block_m, block_n, num_warps, _, *split = tile(candidate)
        return _ACCUMULATORS[kind](block_m, block_n, block_d, block_dv, any(split)) / (32 * num_warps)
    fitting = [c for c in candidates if per_thread(c) <= _MAX_ACC_PER_THREAD]
    return fitting or [min(candidates, key=per_thread)]


def fitting_candidates(kind: str, d: int, dv: int) -> list[tuple]:
    """Which of CANDIDATES[kind] the autotuner measures for head dims d and dv, shared memory aside."""
    return _fitting(kind, CANDIDATES[kind], padded_dim(d), padded_dim(dv))


def _prune(kind: str):
    def prune(configs, named_args, **meta):
        inputs = named_args["Q1"]  # every kernel's first argument
        budget = shared_memory_budget(inputs.device)
        if budget is not None:  # before the cut to N below: the first N must be tiles the GPU can launch
            limit, arch = budget

            def shared(config):
                return shared_memory_estimate(kind, config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"],
                                              config.num_stages, meta["BLOCK_D"], meta["BLOCK_DV"],
                                              inputs.element_size(), meta.get("TIED", True), arch)
            # none fitting: the least needing, whose launch then says how much it needs
            configs = [c for c in configs if shared(c) <= limit] or [min(configs, key=shared)]
        fitting = _fitting(kind, configs, meta["BLOCK_D"], meta["BLOCK_DV"], config_tile)
        return fitting[:triton_candidates_limit()]
    return prune


def tuning_lengths(n_q: int, n_k: int) -> tuple[int, int]:
    """The kernels' tune_n_q, tune_n_k: the lengths rounded up to powers of two (at least 16). Tiles
    tuned at 4K would otherwise serve 64K, or a decoding step's single query; rounding keeps generation,
    whose keys grow by one per step, from retuning at every step."""
    return tuple(max(16, 1 << (n - 1).bit_length()) for n in (n_q, n_k))


@functools.cache
def _autotuned(kernel, kind: str):
    configs = [tile_config(tile) for tile in CANDIDATES[kind]]
    # the mode flags a kernel takes (COMBINE: the forward's epilogue, TIED: the backward's inputs,
    # DOCUMENTS: document masking) change what a program holds, so each mode is tuned apart, as is each
    # length class; cache_results keeps the choice on disk for the next process (benchmarks, then
    # training) on the same GPU and Triton version
    modes = [name for name in ("COMBINE", "TIED", "DOCUMENTS") if name in kernel.arg_names]
    return triton.autotune(configs, key=["HEAD_D", "HEAD_DV", "CAUSAL", *modes, "tune_n_q", "tune_n_k"],
                           cache_results=True, prune_configs_by={"early_config_prune": _prune(kind)})(kernel)


def launch(kernel, kind: str, n_tiled: int, programs: int, args: tuple, meta: dict,
           config: KernelConfig | None) -> None:
    """Run `kernel` over (tiles of n_tiled rows) x programs; autotuned on CUDA unless a config is given.

    `kind` names the kernel ("fwd", "dq": tiles of queries; "dkdv": tiles of keys).
    """
    tile = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    if config is None and not INTERPRETED:
        # a split tile's programs are two per tile, on grid axis 2
        _autotuned(kernel, kind)[lambda m: (triton.cdiv(n_tiled, m[tile]), programs, 1 + m.get("SPLIT", False))](
            *args, **meta, **COMPILE_OPTIONS)
        return
    config = config or INTERPRETER_CONFIG
    tile_rows = config.block_n if kind == "dkdv" else config.block_m
    split = config.split and kind == "dkdv"
    kernel[(triton.cdiv(n_tiled, tile_rows), programs, 1 + split)](
        *args, **meta, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **({"SPLIT": True} if split else {}),
        num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS)


def empty_bnhd(b: int, n: int, heads: int, width: int, device, dtype, sequence_major: bool) -> torch.Tensor:
    """[B, N, H, width]; sequence-major (a transposed [N, B, H, width], megatron's layout) where asked for
    and the kernels' int32 offsets allow."""
    if sequence_major and (n - 1) * b * heads * width + width < 2 ** 31:
        return torch.empty(n, b, heads, width, device=device, dtype=dtype).transpose(0, 1)
    return torch.empty(b, n, heads, width, device=device, dtype=dtype)


def attention_maps_forward(q1, k1, q2, k2, v, lam_h, *, causal: bool, scale: float, o_dtype: torch.dtype,
                           config: KernelConfig | None = None, documents: Documents | None = None,
                           sequence_major: bool = False):
    """Both maps in one pass: returns (out, o1, o2, lse1, lse2).

    q1/q2 and k1/k2 must share their layouts (see `shared_layout`). o1, o2 (and out = o1 - lam_h o2,
    only when lam_h, fp32 [Hq], is given; else None) are [B, N, Hq, dv] in o_dtype, laid out in
    memory as [N, B, Hq, dv] with `sequence_major` where int32 offsets allow; lse1, lse2 are
    [B, Hq, N] fp32. `documents` (causal): attention stays within them.
    """
    b, n_q, n_heads, d = q1.shape
    n_k, n_kv, dv = k1.shape[1], k1.shape[2], v.shape[-1]
    o1, o2 = (empty_bnhd(b, n_q, n_heads, dv, q1.device, o_dtype, sequence_major) for _ in range(2))
    out = torch.empty_like(o1) if lam_h is not None else None  # empty_like keeps o1's strides
    lse1, lse2 = (torch.empty(b, n_heads, n_q, device=q1.device, dtype=torch.float32) for _ in range(2))
    args = (q1, q2, k1, k2, v,
            lam_h if lam_h is not None else lse1, o1, o2, out if out is not None else o1,  # unread placeholders
            lse1, lse2, documents.starts if documents is not None else lse1,
            *bnh_strides(q1), *bnh_strides(k1), *bnh_strides(v), *bnh_strides(o1),
            n_q, n_k, n_heads, n_heads // n_kv, scale * math.log2(math.e), *tuning_lengths(n_q, n_k))
    meta = dict(HEAD_D=d, HEAD_DV=dv, BLOCK_D=padded_dim(d), BLOCK_DV=padded_dim(dv), CAUSAL=causal,
                COMBINE=lam_h is not None, DOCUMENTS=documents is not None, DOT_PREC=dot_precision(q1.dtype))
    launch(_fwd_kernel, "fwd", n_q, b * n_heads, args, meta, config)
    return out, o1, o2, lse1, lse2
