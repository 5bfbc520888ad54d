"""Runs inside each rank: build the training engine of a layout, take one step, and measure what
the process holds: parameters per rank, and the bytes of every live tensor."""
from __future__ import annotations

import gc
import warnings

import torch
import torch.distributed as dist

from megadiff.config import build_config
from megadiff.parallel import initialize, shutdown
from megadiff.training.engine import build_engine
from megadiff.training.step import train_step

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.ffn_hidden_size=512",
         "model.vocab_size=4000", "model.seq_length=16", "train.micro_batch_size=1", "train.global_batch_size=2",
         "model.attention_backend=sdpa"]


def live_tensor_bytes() -> int:
    """Bytes of the storages behind every tensor the garbage collector can reach."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(rank: int, world_size: int, overrides: list[str], results) -> None:
    cfg = build_config({}, MODEL + overrides, world_size)
    initialize(cfg.parallel, seed=1)
    before = live_tensor_bytes()
    engine = build_engine(cfg)
    micro_batches = 2 // (world_size // (cfg.parallel.tensor * cfg.parallel.pipeline))
    batch = {"tokens": torch.randint(0, 4000, (1, 16)), "labels": torch.randint(0, 4000, (1, 16)),
             "loss_mask": torch.ones(1, 16), "position_ids": torch.arange(16)[None]}
    train_step(engine, iter([batch] * micro_batches), micro_batches)
    row = torch.tensor([sum(p.numel() for chunk in engine.unwrapped() for p in chunk.parameters()),
                        live_tensor_bytes() - before], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    if rank == 0:
        results.put([r.tolist() for r in rows])
    shutdown()
