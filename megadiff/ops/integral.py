"""What the fused kernel's autograd Function computes in torch around the kernels: everything linear in O1, O2.

DINT adds lam R(O1) to the kernel's O1 - lam O2 (R: the running mean over positions, within documents).
Backward, with G = dL/dout and G1 = dL/dO1 when O1 was returned too (a context-parallel DINT layer):
    dO1 = G + [integral] lam R^T(G) + G1,   dO2 = -lam G,
    dlam_h += [integral] sum(R^T(G) O1),     delta1 = rowsum(dO1 O1) (the kernels' statistic),
where R^T(G)_k = sum_{i >= k} G_i / i (causal; within k's document, i counted from its start) or mean_i G_i.
Eager torch takes some 23 passes over [B, N, H, dv] tensors for these, most in fp32 (casts, a cumulative
sum and its flips, products, row sums); on CUDA each direction is one compiled function instead. Plain DIFF
needs none of it: its backward runs the kernels in tied mode.
"""
from __future__ import annotations

import torch

from megadiff.ops.common import document_counts, running_mean, sum_until


def _running_mean_adjoint(g: torch.Tensor, causal: bool, starts: torch.Tensor | None,
                          ends: torch.Tensor | None) -> torch.Tensor:
    """R^T(g) for R = running_mean along dim 1: the gradient of sum(g * R(x)) w.r.t. x. starts/ends:
    [B, N] int64, each position's document start and end (exclusive), or None without documents."""
    if not causal:
        return g.mean(dim=1, keepdim=True).expand_as(g)
    if starts is None:
        counts = torch.arange(1, g.shape[1] + 1, device=g.device, dtype=g.dtype).view(1, -1, 1, 1)
        return (g / counts).flip(1).cumsum(1).flip(1)
    return sum_until(g / document_counts(starts, g.dtype), ends)


def integral_added(out: torch.Tensor, o1: torch.Tensor, lam_h: torch.Tensor, causal: bool,
                   starts: torch.Tensor | None) -> torch.Tensor:
    """out + lam_h R(o1) in fp32, returned in out's dtype; lam_h: fp32 [H], starts: [B, N] int64 or None."""
    return (out.float() + lam_h.view(1, 1, -1, 1) * running_mean(o1.float(), causal, starts)).to(out.dtype)


def first_map_gradients(g: torch.Tensor, o1: torch.Tensor, lam_h: torch.Tensor, causal: bool, integral: bool,
                        starts: torch.Tensor | None, ends: torch.Tensor | None,
                        grad_first_map: torch.Tensor | None) -> tuple:
    """(dO1, dO2, delta1, dlam_h): the maps' gradients in o1's dtype, delta1 = rowsum(dO1 O1) as [B, H, N] fp32
    contiguous, and the integral's part of lam_h's gradient, fp32 [H] (zeros without the integral)."""
    lam = lam_h.view(1, 1, -1, 1)
    do1 = g.float()
    do2 = -lam * do1
    grad_lam = torch.zeros_like(lam_h)
    if integral:
        g_mean = _running_mean_adjoint(do1, causal, starts, ends)
        grad_lam = (g_mean * o1.float()).sum(dim=(0, 1, 3))
        do1 = do1 + lam * g_mean
    if grad_first_map is not None:
        do1 = do1 + grad_first_map.float()
    delta1 = (do1 * o1.float()).sum(dim=-1).transpose(1, 2).contiguous()
    return do1.to(o1.dtype), do2.to(o1.dtype), delta1, grad_lam
