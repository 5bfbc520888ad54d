"""The step's update against megatron's own `optimizer.step()`, and how non-finite gradients skip it.

train_step takes megatron's step apart so that its one gradient norm also finds non-finite gradients
and spikes: the weights it writes must be exactly those of megatron's step, and a NaN held by one
rank alone must stop the update on every rank.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_ranks
from tests.parity_worker import MODEL, SEED, global_micro_batches, layout_independent_weights

# clip_grad small enough that every step is clipped
CLIPPED = MODEL + ["model.variant=diff", "train.clip_grad=0.05"]


def _engine(overrides: list[str], world_size: int):
    from megadiff.config import build_config
    from megadiff.parallel import initialize
    from megadiff.training.engine import build_engine, build_optimizer

    cfg = build_config({}, CLIPPED + overrides, world_size)
    initialize(cfg.parallel, SEED)
    engine = build_engine(cfg)
    layout_independent_weights(engine.unwrapped(), SEED)
    engine.optimizer = build_optimizer(cfg, engine.config, engine.model)  # its fp32 copies see the new weights
    return engine


def _my_batches(engine, step: int) -> list[dict]:
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    return global_micro_batches(engine.cfg, step)[parallel_state.get_data_parallel_rank()::dp]


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.unwrapped() for p in chunk.parameters()]


def forward_backward(engine, batches: list[dict]) -> float | None:
    """The schedule's forward and backward over `batches` (one micro-batch each), as train_step runs them, and
    their mean loss on every rank; no update."""
    from megadiff.training.step import _forward_backward, _mean_loss_on_every_rank

    reduced = _forward_backward(engine, iter(batches), len(batches), forward_only=False)
    return _mean_loss_on_every_rank(reduced, len(batches), engine.config.calculate_per_token_loss)


def _megatron_step(engine, batches: list[dict]) -> tuple[float, float]:
    for chunk in engine.model:
        chunk.zero_grad_buffer()
    engine.optimizer.zero_grad()
    loss = forward_backward(engine, batches)
    updated, grad_norm, _ = engine.optimizer.step()
    assert updated
    return loss, float(grad_norm)


def _is_last_rank() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def _poison_reduced_gradients(engine) -> None:
    """NaN in every gradient the last rank holds after the reduction: in its part alone where ranks
    hold different parts (distributed optimizer shards, tensor- and pipeline-parallel weights)."""
    if _is_last_rank():
        for chunk in engine.unwrapped():
            for param in chunk.parameters():
                param.main_grad.fill_(float("nan"))


def _poison_backward(monkeypatched_step) -> None:
    """NaN in the last rank's backward (its loss stays finite), before the gradients are reduced: where
    ranks hold the same reduced gradients (data- and context-parallel replicas), the reduction spreads it."""
    forward_step = monkeypatched_step.forward_step

    def poisoned(data_iterator, model, **options):  # options: validation's `summed`
        output, loss_func = forward_step(data_iterator, model, **options)
        if _is_last_rank():
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return output, loss_func

    monkeypatched_step.forward_step = poisoned


def _worker(rank: int, world_size: int, overrides: list[str], poison: str, out: str) -> None:
    import megadiff.training.step as step_module
    from megadiff.parallel import shutdown
    from megadiff.training.step import train_step

    ours, theirs = _engine(overrides, world_size), _engine(overrides, world_size)
    record = {"steps": []}
    for step in range(2):
        batches = _my_batches(ours, step)
        result = train_step(ours, iter(batches), len(batches))
        record["steps"].append(((result.loss, result.grad_norm, result.updated), _megatron_step(theirs, batches)))
    record["params"] = list(zip(_params(ours), _params(theirs)))

    poisoned = _engine(overrides, world_size)
    before = _params(poisoned)
    batches = _my_batches(poisoned, 0)
    if poison == "backward":
        _poison_backward(step_module)
    result = train_step(poisoned, iter(batches), len(batches), _poison_reduced_gradients if poison == "reduced" else None)
    record["poisoned"] = (result.updated, all(torch.equal(a, b) for a, b in zip(before, _params(poisoned))))
    record["finite_loss"] = math.isfinite(result.loss)
    shutdown()
    torch.save(record, f"{out}.{rank}")


LAYOUTS = {  # world size, overrides, where the NaN enters
    "single_fp32": (1, [], "reduced"),
    "single_bf16": (1, ["train.precision=bf16"], "reduced"),
    # each rank's norm holds half the terms; the NaN sits in the last rank's half alone
    "dp2_distopt_bf16": (2, ["train.precision=bf16", "parallel.distributed_optimizer=true"], "reduced"),
    "tp2": (2, ["parallel.tensor=2"], "reduced"),
    "pp2": (2, ["parallel.pipeline=2"], "reduced"),
    # replicas, each taking the norm of its own copy of the reduced gradients
    "dp2": (2, [], "backward"),
    "cp2": (2, ["parallel.context=2"], "backward"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_is_megatrons_step_and_a_nan_on_one_rank_skips_all(tmp_path, layout):
    world_size, overrides, poison = LAYOUTS[layout]
    run_ranks(world_size, _worker, overrides, poison, str(tmp_path / "record"))
    for rank in range(world_size):
        record = torch.load(tmp_path / f"record.{rank}")
        for (loss, grad_norm, updated), (their_loss, their_norm) in record["steps"]:
            assert updated and loss == their_loss and grad_norm == their_norm
            assert grad_norm > 0.05 * 2  # clipped
        for mine, theirs in record["params"]:
            assert torch.equal(mine, theirs)
        assert record["poisoned"] == (False, True), f"rank {rank}: (updated, weights unchanged)"
        assert record["finite_loss"]  # found by the gradients, not the loss


def _fp16_worker(rank: int, world_size: int, out: str) -> None:
    from megadiff.parallel import shutdown
    from megadiff.training.spikes import SpikeGuard
    from megadiff.training.step import train_step

    scales = {}
    for guarded in (False, True):
        engine = _engine(["train.precision=fp16"], world_size)
        # never spikes; judges every update once its window holds two
        guard = SpikeGuard(sigma=1e6, window=2) if guarded else None
        scales[guarded] = []
        for step in range(24):  # from 2^32 the scale halves at every other overflow, then steps update
            batches = _my_batches(engine, step)
            result = train_step(engine, iter(batches), len(batches), spike_guard=guard)
            scales[guarded].append((float(engine.optimizer.get_loss_scale()), result.overflow, result.loss))
    shutdown()
    torch.save(scales, out)


def test_fp16_loss_scale_moves_once_per_step_under_the_spike_guard(tmp_path):
    """The guard reads the norm the step takes: fp16's scaler sees each step once, as without it."""
    run_ranks(1, _fp16_worker, str(tmp_path / "scales.pt"))
    scales = torch.load(tmp_path / "scales.pt")
    assert scales[True] == scales[False]
    overflows = [overflow for _, overflow, _ in scales[False]]
    # from 2^32 down, then updates the guard judges (its window holds two)
    assert overflows[:2] == [True, True] and overflows.count(False) >= 4


def _weight_decays_worker(rank: int, world_size: int, path: str) -> None:
    from megadiff.training.pretrain import build_scheduler

    engine = _engine(["train.weight_decay=0.1"], world_size)
    built = [group["weight_decay"] for group in engine.optimizer.param_groups]
    build_scheduler(engine.cfg, engine.optimizer)  # megatron's scheduler sets each group's decay as it starts
    torch.save((built, [group["weight_decay"] for group in engine.optimizer.param_groups]), path)


def test_the_optimizer_starts_with_the_weight_decays_its_scheduler_gives(tmp_path):
    """Norms and lambda (wd_mult 0) decay by nothing from the first step, with or without a scheduler: the
    parity tests and bench step an engine without one."""
    run_ranks(1, _weight_decays_worker, str(tmp_path / "decays.pt"))
    built, scheduled = torch.load(tmp_path / "decays.pt")
    assert built == scheduled and set(built) == {0.0, 0.1}
