"""Activation recomputation (train.recompute) changes memory, never numbers."""
from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.parity_worker import MODEL, SEED, full_gradients, global_micro_batches, layout_independent_weights

MODES = ("none", "selective", "full")


def _worker(rank: int, world_size: int, out: str) -> None:
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine, build_optimizer
    from megadiff.training.step import train_step

    results = {}
    for mode in MODES:
        cfg = build_config({}, MODEL + ["model.variant=dint", f"train.recompute={mode}"], world_size)
        initialize(cfg.parallel, SEED)
        engine = build_engine(cfg)
        layout_independent_weights(engine.unwrapped(), SEED)
        engine.optimizer = build_optimizer(cfg, engine.config, engine.model)
        batches = global_micro_batches(cfg, 0)
        record = {}
        result = train_step(engine, iter(batches), len(batches), lambda e: record.update(grads=full_gradients(e)))
        results[mode] = {"loss": result.loss, "grads": record["grads"]}
    shutdown()
    torch.save(results, out)


def test_recompute_modes_give_the_same_loss_and_gradients(tmp_path):
    out = tmp_path / "recompute.pt"
    run_ranks(1, _worker, str(out))
    results = torch.load(out)
    reference = results["none"]
    for mode in MODES[1:]:
        assert results[mode]["loss"] == reference["loss"], mode
        for key, grad in reference["grads"].items():
            torch.testing.assert_close(results[mode]["grads"][key], grad, rtol=1e-6, atol=1e-7, msg=f"{mode}: {key}")
