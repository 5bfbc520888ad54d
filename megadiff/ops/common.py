"""Shape checks and small helpers shared by every differential-attention implementation."""
from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.float16, torch.bfloat16)
# what the fused Triton kernel runs: one tile holds a whole head (d, and dv = 2d) of a block of rows
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256
TRITON_CANDIDATES_ENV = "MEGADIFF_TRITON_CANDIDATES"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulation run in fp32 for low precision, in the input dtype otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@functools.cache
def compiled(function):
    """`function` compiled for any sizes (documents, decoding steps and batches vary them): a fused kernel or two
    where eager torch launches a pass per op. Not as one graph: grad mode, dtypes, layouts and the flags each
    make a variant, and past torch's limit of them a call runs eagerly where fullgraph would raise."""
    return torch.compile(function, dynamic=True)


_failed_to_compile: set = set()


def compiled_on(device: torch.device, function):
    """`function` compiled for CUDA, as it is elsewhere (the CPU has no use for the compile's seconds). A call
    whose compile fails (a bug of some torch or Triton version) warns once and leaves the function eager: slower,
    the same math. (A backward graph compiles at its first backward, where no fallback can take over.)"""
    if device.type != "cuda" or function in _failed_to_compile:
        return function
    return functools.partial(_run_compiled, function)


def _run_compiled(function, *args):
    try:
        return compiled(function)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        _failed_to_compile.add(function)
        cause = getattr(error, "inner_exception", error)  # the compiler's own error, not dynamo's wrapping
        warnings.warn(f"torch.compile of {function.__qualname__} failed ({type(cause).__name__}: "
                      f"{(str(cause).strip().splitlines() or [''])[0]}); it runs eagerly from now on")
        return function(*args)


def copied_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor made here, on `device`, queued rather than waited for: torch copies from pageable host memory
    to a GPU and then synchronises the stream, so a micro-batch's document bounds, copied in its first layer, held
    the host until the GPU had run every kernel queued before them. Copied from pinned memory, torch's pinned
    cache keeps the buffer until the copy has run."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def triton_fits(head_dim: int, value_dim: int) -> bool:
    """Whether the fused kernel's tiles hold heads this wide."""
    return max(head_dim, value_dim) <= TRITON_MAX_HEAD_DIM


def triton_supports(dtype: torch.dtype, head_dim: int, value_dim: int) -> bool:
    return dtype in TRITON_DTYPES and triton_fits(head_dim, value_dim)


def triton_candidates_limit() -> int | None:
    """$MEGADIFF_TRITON_CANDIDATES: how many of the fitting candidates (in their listed order) the
    autotuner compiles and measures per kernel and mode, to bound the first step's compile time (about
    9 s a candidate at the 3B head shape, on every node whose Triton cache is empty); unset: all."""
    value = os.environ.get(TRITON_CANDIDATES_ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${TRITON_CANDIDATES_ENV} must be a positive integer, got {value!r}")
    return int(value)


def check_shapes(q1, k1, q2, k2, v, lam, integral: bool) -> None:
    if q1.dim() != 4:
        raise ValueError(f"q1 must be [B, N, H, d], got shape {tuple(q1.shape)}")
    if q1.shape != q2.shape:
        raise ValueError(f"q1 {tuple(q1.shape)} and q2 {tuple(q2.shape)} must have the same shape")
    if k1.shape != k2.shape:
        raise ValueError(f"k1 {tuple(k1.shape)} and k2 {tuple(k2.shape)} must have the same shape")
    b, n_q, h_q, d = q1.shape
    b_k, n_k, h_kv, d_k = k1.shape
    if (b_k, d_k) != (b, d):
        raise ValueError(f"k {tuple(k1.shape)} does not match q {tuple(q1.shape)} in batch or head dim")
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")
    if v.shape[:3] != (b, n_k, h_kv):
        raise ValueError(f"v must be [B, Nk, Hkv, dv] = [{b}, {n_k}, {h_kv}, dv], got {tuple(v.shape)}")
    if lam.dim() > 1 or (lam.dim() == 1 and lam.shape[0] != h_q):
        raise ValueError(f"lam must be a 0-dim tensor or have one value per query head ({h_q}), got {tuple(lam.shape)}")
    if n_q > n_k:
        raise ValueError(f"more queries ({n_q}) than keys ({n_k})")
    if integral and n_q != n_k:
        raise ValueError("the DINT integral term needs as many queries as keys")


def map_pairs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, 2H, d] (or megatron's [N, B, 2H, d]) whose heads 2i and 2i + 1 are differential head i's
    two maps -> the two maps' [B, N, H, d] views."""
    return t[:, :, 0::2], t[:, :, 1::2]


def lambda_per_head(lam: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[] or [H] -> [H] in fp32, or in fp64 for an fp64 lambda (whose rounding to fp32 would hide a gradient
    check's perturbations of it)."""
    lam = lam.to(torch.promote_types(lam.dtype, torch.float32))
    return lam.expand(num_heads) if lam.dim() == 0 else lam


def running_mean(x: torch.Tensor, causal: bool, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions 1..i of x[:, :i] (causal) or over all positions; x: [B, N, H, e].

    starts ([B, N] int64, causal only): each position's document start; the mean then runs over
    the positions of i's document up to i.
    """
    if not causal:
        return x.mean(dim=1, keepdim=True).expand_as(x)
    if starts is None:
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return x.cumsum(dim=1) / counts
    return sum_since(x, starts) / document_counts(starts, x.dtype)


def sum_since(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[B, N, H, e]: x summed over positions starts[b, i] .. i ([B, N] int64 starts, each <= i).

    The difference of two prefix sums of x less its mean: those of x itself grow with the position, and
    their difference for a short document late in a long sequence cancelled (1.5% off at 64K in fp32).
    Indexed rather than gathered, so autograd keeps the indices, not the [B, N, H, e] prefix sums."""
    mean = x.detach().mean(dim=1, keepdim=True)
    prefix = F.pad((x - mean).cumsum(dim=1), (0, 0, 0, 0, 1, 0))  # prefix[:, k] = sum of (x - mean)[:, :k]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return prefix[:, 1:] - prefix[rows, starts] + mean * document_counts(starts, x.dtype)


def sum_until(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[B, N, H, e]: x summed over positions i .. ends[b, i] - 1 ([B, N] int64 ends, each > i): sum_since's
    transpose, taken the same way (suffix sums of x less its mean, indexed)."""
    mean = x.detach().mean(dim=1, keepdim=True)
    suffix = F.pad((x - mean).flip(1).cumsum(dim=1).flip(1), (0, 0, 0, 0, 0, 1))  # suffix[:, k]: (x - mean)[:, k:]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    positions = torch.arange(ends.shape[1], device=ends.device)
    return suffix[:, :-1] - suffix[rows, ends] + mean * (ends - positions).to(x.dtype)[:, :, None, None]


def document_counts(starts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, 1, 1]: how many positions of its document each position has reached (itself included)."""
    positions = torch.arange(starts.shape[1], device=starts.device)
    return (positions - starts + 1).to(dtype)[:, :, None, None]
