"""Overlapped parameter all-gather (parallel.overlap_param_gather, the 3B recipe's setting): megatron's
optimizer step then leaves the gather of the updated weights to the next forward, so what reads
weights between a step and that forward (a checkpoint) must gather first, and what is logged
(lambda) must come from the forward. A DP=2 run with the overlap must save and log exactly what the
same run without it does."""
from __future__ import annotations

import pytest
import torch

from megadiff.inference import load_checkpoint
from megadiff.observability.metrics import read_metrics
from tests.distributed import run_ranks
from tests.pretrain_runs import run_pretrain_in_ranks, tiny_overrides

DP2 = ["parallel.distributed_optimizer=true", "train.iters=3", "logging.log_interval=1"]
OVERLAP = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]


@pytest.fixture(scope="module")
def runs(small_tokenizer_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("overlap")
    base = tiny_overrides(small_tokenizer_dir, root / "cache") + DP2
    run_pretrain_in_ranks(2, base + [f"output_dir={root / 'plain'}"])
    run_pretrain_in_ranks(2, base + OVERLAP + [f"output_dir={root / 'overlap'}"])
    return {name: root / name for name in ("plain", "overlap")}


@pytest.mark.slow
def test_checkpoint_holds_the_updated_weights(runs):
    plain = load_checkpoint(runs["plain"]).parameters_by_name()
    overlap = load_checkpoint(runs["overlap"]).parameters_by_name()
    assert plain.keys() == overlap.keys()
    for name in plain:
        torch.testing.assert_close(overlap[name], plain[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_logged_lambdas_are_those_without_the_overlap(runs):
    def lambdas(output_dir):
        return [record["lambda"] for record in read_metrics(output_dir) if "lambda" in record]

    plain = lambdas(runs["plain"])
    assert len(plain) == 3
    assert lambdas(runs["overlap"]) == [pytest.approx(layers, rel=1e-6) for layers in plain]


def _check_who_dispatches_the_gathers(rank: int, world_size: int, overrides: list[str], by_schedule: bool) -> None:
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    cfg = build_config({}, overrides, world_size)
    initialize(cfg.parallel, seed=1)
    engine = build_engine(cfg)
    assert [chunk.ddp_config.align_param_gather for chunk in engine.model] == [by_schedule] * len(engine.model)
    assert (engine.config.param_sync_func is not None) == by_schedule
    shutdown()


@pytest.mark.parametrize("world_size,layout,by_schedule", [
    (1, [], False), (2, ["parallel.pipeline=2"], False),
    (2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4"], True)])
def test_only_the_interleaved_schedule_dispatches_the_gathers(small_tokenizer_dir, tmp_path, world_size, layout,
                                                             by_schedule):
    """megatron's forward pre-hooks prefetch the next bucket's all-gather, unless align_param_gather says
    the schedule dispatches them, which only the interleaved one does: aligned under 1F1B or without a
    pipeline (the 3B recipe), every bucket's gather waited in the forward, none overlapped."""
    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + DP2[:1] + OVERLAP + layout
    run_ranks(world_size, _check_who_dispatches_the_gathers, overrides, by_schedule)
