"""The checkpoint commands (evaluate, needles, outliers) across the ranks of torchrun or Slurm.

Every rank loads the whole model (it must fit one device), takes every `world`-th piece of the
work (sequences, needle cases) and rank 0 reports what all of them found. Run by one process,
the rank is 0 of 1 and nothing is exchanged. Sums are exact where the pieces are disjoint
(zeros elsewhere), so the report equals a one-process run's up to batch composition.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

from megadiff.parallel import compute_device, rank_and_world

Item = TypeVar("Item")


def reports() -> bool:
    """Whether this rank prints and writes the report (rank 0)."""
    return rank_and_world()[0] == 0


def share(items: Iterable[Item]) -> Iterator[Item]:
    """This rank's items: every world-th from its rank on (ranks' shares differ by one at most).
    Lazy, and every item is drawn on every rank, so items drawn from a seeded generator are the
    same on all of them."""
    rank, world = rank_and_world()
    return islice(items, rank, None, world)


def share_size(total: int) -> int:
    """How many of `total` items share() gives this rank."""
    rank, world = rank_and_world()
    return len(range(rank, total, world))


def sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of every rank's `tensor`, where `tensor` is (collectives run on the
    compute device: NCCL reduces CUDA tensors only)."""
    if rank_and_world()[1] == 1:
        return tensor
    summed = tensor.to(compute_device())
    dist.all_reduce(summed)
    return summed.to(tensor.device)


def gather_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each), concatenated along dim 0 in rank order."""
    if rank_and_world()[1] == 1:
        return tensor
    local = tensor.to(compute_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(rank_and_world()[1])]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(tensor.device)


