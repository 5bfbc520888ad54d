"""RMSNorm usable in megatron layer specs, including under sequence parallelism.

megatron-core's local (non-TE) norm refuses sequence parallelism; this one
marks its weight with `sequence_parallel` so megatron's finalize_model_grads
all-reduces its gradient across the tensor-parallel group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
