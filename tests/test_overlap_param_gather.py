"""Overlapped parameter all-gather (parallel.overlap_param_gather, the 3B recipe's setting): megatron's
optimizer step then leaves the gather of the updated weights to the next forward, so everything
that reads weights between a step and that forward (checkpoints, lambda logging) must gather
first. A DP=2 run with the overlap must save and log exactly what the same run without it does."""
from __future__ import annotations

import pytest
import torch

from megadiff.inference import load_checkpoint
from megadiff.observability.metrics import read_metrics
from tests.pretrain_runs import run_pretrain, tiny_overrides

DP2 = ["parallel.distributed_optimizer=true", "train.iters=3", "logging.log_interval=1"]
OVERLAP = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]


@pytest.fixture(scope="module")
def runs(small_tokenizer_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("overlap")
    base = tiny_overrides(small_tokenizer_dir, root / "cache") + DP2
    run_pretrain(2, base + [f"output_dir={root / 'plain'}"])
    run_pretrain(2, base + OVERLAP + [f"output_dir={root / 'overlap'}"])
    return {name: root / name for name in ("plain", "overlap")}


@pytest.mark.slow
def test_checkpoint_holds_the_updated_weights(runs):
    plain = load_checkpoint(runs["plain"]).parameters_by_name()
    overlap = load_checkpoint(runs["overlap"]).parameters_by_name()
    assert plain.keys() == overlap.keys()
    for name in plain:
        torch.testing.assert_close(overlap[name], plain[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_logged_lambdas_are_the_updated_ones(runs):
    def lambdas(output_dir):
        return [record["lambda"] for record in read_metrics(output_dir) if "lambda" in record]

    plain = lambdas(runs["plain"])
    assert len(plain) == 3
    assert lambdas(runs["overlap"]) == [pytest.approx(layers, rel=1e-6) for layers in plain]
