"""The DIFF paper's lambda: depth-dependent init and the exp reparameterisation (eq. 2)."""
from __future__ import annotations

import functools
import math

import torch


def depth_lambda_init(depth: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 depth), depth = 0-based layer index."""
    if depth < 0:
        raise ValueError(f"layer depth must be >= 0, got {depth}")
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def lambda_difference(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor) -> torch.Tensor:
    """exp(lq1 . lk1) - exp(lq2 . lk2) in fp32 (0-dim tensor)."""
    return torch.exp(torch.sum(lq1.float() * lk1.float())) - torch.exp(torch.sum(lq2.float() * lk2.float()))


@functools.cache
def fused_lambda_difference():
    """lambda_difference compiled: one kernel for its casts, products, sums and exponentials, and one
    for their gradients, where eager torch launches about a dozen tiny ones each way per layer and
    micro-batch (some 2 ms a step at the 3B shape). lambda_init stays outside, so that every layer
    shares one compiled graph."""
    return torch.compile(lambda_difference, dynamic=False, fullgraph=True)


def reparameterized_lambda(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                           lambda_init: float) -> torch.Tensor:
    """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, computed in fp32 (0-dim tensor); compiled on CUDA."""
    difference = fused_lambda_difference() if lq1.is_cuda else lambda_difference
    return difference(lq1, lk1, lq2, lk2) + lambda_init
