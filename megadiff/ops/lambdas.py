"""The DIFF paper's lambda: depth-dependent init and the exp reparameterisation (eq. 2)."""
from __future__ import annotations

import math

import torch


def depth_lambda_init(depth: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 depth), depth = 0-based layer index."""
    if depth < 0:
        raise ValueError(f"layer depth must be >= 0, got {depth}")
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def reparameterized_lambda(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                           lambda_init: float) -> torch.Tensor:
    """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, computed in fp32 (0-dim tensor)."""
    first = torch.exp(torch.sum(lq1.float() * lk1.float()))
    second = torch.exp(torch.sum(lq2.float() * lk2.float()))
    return first - second + lambda_init
