"""Runs inside each rank: a fresh model's initial weights gathered whole, and the loss of its first step."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megadiff.config import build_config, data_parallel_size
from megadiff.parallel import initialize, shutdown
from megadiff.training.engine import build_engine
from megadiff.training.step import train_step
from tests.full_tensors import gather_full_tensors
from tests.parity_worker import LAYOUTS, MODEL, SEED, VARIANTS, global_micro_batches

# tied: under PP the last stage's output layer is a copy of the first stage's embedding, and must stay one
INITIALISED = {**VARIANTS, "diff_tied": ["model.variant=diff", "model.tie_embeddings=true"]}


def initial_weights_and_first_loss(rank: int, world_size: int, layout: str, invariant: bool, out_path: str):
    results = {}
    for variant, variant_overrides in INITIALISED.items():
        overrides = MODEL + variant_overrides + LAYOUTS[layout][1] + [f"train.layout_invariant_init={invariant}"]
        cfg = build_config({}, overrides, world_size)
        initialize(cfg.parallel, SEED)
        engine = build_engine(cfg)
        weights, _ = gather_full_tensors(engine.unwrapped())
        dp, dp_rank = data_parallel_size(cfg.parallel, world_size), parallel_state.get_data_parallel_rank()
        mine = global_micro_batches(cfg, 0)[dp_rank::dp]
        iterators = [iter(mine) for _ in engine.model]
        loss = train_step(engine, iterators if len(iterators) > 1 else iterators[0], len(mine)).loss
        results[variant] = {"weights": weights, "loss": loss}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    shutdown()
