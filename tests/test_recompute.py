"""Activation recomputation (train.recompute) changes memory, never numbers: every attention variant (lambda's
vectors, DINT's running mean and its carries across context-parallel chunks, Shared DIFF's low-rank updates),
on one rank and under tensor + sequence, context and pipeline parallelism."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.parity_worker import (
    LAYOUTS, MODEL, SEED, VARIANTS, full_gradients, global_micro_batches, layout_independent_weights,
)

MODES = ("none", "selective", "full")


def _worker(rank: int, world_size: int, layout: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megadiff.config import build_config, data_parallel_size
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine, build_optimizer
    from megadiff.training.step import train_step

    results = {}
    for variant, variant_overrides in VARIANTS.items():
        for mode in MODES:
            cfg = build_config({}, MODEL + variant_overrides + LAYOUTS[layout][1] + [f"train.recompute={mode}"],
                               world_size)
            initialize(cfg.parallel, SEED)
            engine = build_engine(cfg)
            layout_independent_weights(engine.unwrapped(), SEED)
            engine.optimizer = build_optimizer(cfg, engine.config, engine.model)
            dp, dp_rank = data_parallel_size(cfg.parallel, world_size), parallel_state.get_data_parallel_rank()
            mine = global_micro_batches(cfg, 0)[dp_rank::dp]
            record = {}
            result = train_step(engine, iter(mine), len(mine), lambda e: record.update(grads=full_gradients(e)))
            results[variant, mode] = {"loss": result.loss, "grads": record["grads"]}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    shutdown()


@pytest.mark.parametrize("layout", ["single", "tp2_sp", "cp2", "pp2"])
def test_recompute_modes_give_the_same_loss_and_gradients(tmp_path, layout):
    out = tmp_path / "recompute.pt"
    run_ranks(LAYOUTS[layout][0], _worker, layout, str(out))
    results = torch.load(out)
    for variant in VARIANTS:
        reference = results[variant, "none"]
        for mode in MODES[1:]:
            assert results[variant, mode]["loss"] == reference["loss"], (variant, mode)
            for key, grad in reference["grads"].items():
                torch.testing.assert_close(results[variant, mode]["grads"][key], grad, rtol=1e-6, atol=1e-7,
                                           msg=f"{variant}, {mode}: {key}")
