"""The DINT integral term across incremental calls (generation with cached keys and values).

Each call brings the next queries of the same sequences, attending to every key so far; the
integral at a position is the mean of the first map's outputs A1 V over all positions up to it,
most of which earlier calls computed. `IntegralCarry` keeps their sum.
"""
from __future__ import annotations

import torch

from megadiff.ops.common import compute_dtype, running_mean


class IntegralCarry:
    """The sum and count of A1 V rows ([B, 1, H, dv], fp32 for low precision) over the positions so far."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def reset(self) -> None:
        self.total, self.count = None, 0

    def snapshot(self) -> tuple[torch.Tensor | None, int]:
        return (None if self.total is None else self.total.clone()), self.count

    def restore(self, snapshot: tuple[torch.Tensor | None, int]) -> None:
        total, self.count = snapshot
        self.total = None if total is None else total.clone()

    def running_mean(self, first_map_out: torch.Tensor) -> torch.Tensor:
        """[B, n, H, dv] A1 V of the next n positions -> the running mean at each of them (in the
        compute dtype), counting every earlier position; the carry then includes them."""
        sums = first_map_out.to(compute_dtype(first_map_out.dtype)).cumsum(dim=1)
        if self.total is not None:
            sums = sums + self.total
        n = first_map_out.shape[1]
        counts = torch.arange(self.count + 1, self.count + n + 1, device=sums.device, dtype=sums.dtype)
        self.total, self.count = sums[:, -1:], self.count + n
        return sums / counts.view(1, -1, 1, 1)


def integral_mean(first_map_out: torch.Tensor, causal: bool, carry: IntegralCarry | None) -> torch.Tensor:
    """The integral's running mean of A1 V: over the positions of this call, or continued from `carry`'s (decoding,
    which `carry` then includes)."""
    return running_mean(first_map_out, causal) if carry is None else carry.running_mean(first_map_out)
