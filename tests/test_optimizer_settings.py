"""The optimizer megadiff builds uses the configured AdamW settings: against torch's own AdamW.

build_optimizer hands train.weight_decay, the betas and eps to megatron, then sets each group's decay
itself (megatron leaves the 1-D parameters' wd_mult of 0 to its scheduler). The parity and update-step
tests compare megatron with megatron, so a wrong value there (no decay, beta2 = beta1) went unseen. Here an
independent torch.optim.AdamW, given the same weights and gradients, must write the weights megatron's
step writes. Several steps: at the first, Adam's bias corrections cancel the betas exactly (update = lr g /
(|g| + eps)), so only the later ones see them.
"""
from __future__ import annotations

import pytest
import torch

from megadiff.config import build_config
from tests.distributed import run_ranks
from tests.parity_worker import MODEL, SEED, VARIANTS, global_micro_batches

# distinctive values: none is megadiff's or megatron's default, beta1 != beta2, and eps large enough to matter
# next to the gradients; clip_grad=0 turns megatron's clipping off, so the gradients reach Adam as they are
SETTINGS = ["train.precision=fp32", "train.weight_decay=0.3", "train.adam_beta1=0.8", "train.adam_beta2=0.9",
            "train.adam_eps=1e-3", "train.clip_grad=0"]
STEPS = 3
KEPT = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")


def _reference_optimizer(cfg, params: list[torch.Tensor]) -> torch.optim.AdamW:
    """megatron's default grouping (optimizer/__init__.py, get_standard_config_overrides): 1-D parameters (norm
    weights, the lambda vectors; megadiff has no biases) do not decay, every matrix does (Shared DIFF's low-rank
    factors too). No scheduler: the engine steps at train.lr. megatron's Adam is AdamW (its
    OptimizerConfig.decoupled_weight_decay defaults to True)."""
    train = cfg.train
    return torch.optim.AdamW(
        [dict(params=[p for p in params if p.dim() >= 2], weight_decay=train.weight_decay),
         dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)


def _worker(rank: int, world_size: int, variant: str, out: str) -> None:
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine
    from tests.test_update_step import forward_backward

    cfg = build_config({}, MODEL + VARIANTS[variant] + SETTINGS, world_size)
    initialize(cfg.parallel, SEED)
    engine = build_engine(cfg)
    names, params = zip(*[(name, p) for chunk in engine.unwrapped() for name, p in chunk.named_parameters()])
    reference = [p.detach().clone() for p in params]
    adamw = _reference_optimizer(cfg, reference)
    record = {"names": names, "dims": [p.dim() for p in params], "steps": [],
              "kept": {key: getattr(engine.optimizer.config, key) for key in KEPT}}
    for step in range(STEPS):
        for chunk in engine.model:
            chunk.zero_grad_buffer()
        engine.optimizer.zero_grad()
        batches = global_micro_batches(cfg, step)
        forward_backward(engine, batches)
        for mine, param in zip(reference, params):
            mine.grad = param.main_grad.detach().clone()
        updated, _, _ = engine.optimizer.step()
        assert updated
        adamw.step()
        record["steps"].append([(p.detach().clone(), mine.clone()) for p, mine in zip(params, reference)])
    shutdown()
    torch.save(record, out)


@pytest.mark.parametrize("variant", ["diff", "shared_diff"])
def test_megatron_step_is_adamw_with_the_configured_settings(tmp_path, variant):
    """Every parameter after each of megatron's steps is where torch's AdamW, with the configured lr, betas,
    eps and decay (matrices only), puts it from the same weights and gradients."""
    run_ranks(1, _worker, variant, str(tmp_path / "record.pt"))
    record = torch.load(tmp_path / "record.pt")
    # megadiff sets every group's decay itself, so megatron's OptimizerConfig.weight_decay does not move this
    # engine's weights; megatron still reads the config elsewhere (its SGD, CPU-offload and Muon paths, the torch
    # optimizer's defaults for a group added later): it must hold the configured values too
    train = build_config({}, MODEL + VARIANTS[variant] + SETTINGS, 1).train
    assert record["kept"] == {key: getattr(train, key) for key in KEPT}
    # the grouping is exercised both ways: lambda and norms (1-D) and, for Shared DIFF, the low-rank factors (2-D)
    assert 1 in record["dims"] and 2 in record["dims"]
    assert any("lambda_q1" in name for name in record["names"])
    if variant == "shared_diff":
        assert any("lowrank_down" in name for name in record["names"])
    for step, pairs in enumerate(record["steps"]):
        for name, (theirs, mine) in zip(record["names"], pairs):
            torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {step}, {name}: {m}")
