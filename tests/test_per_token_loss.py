"""train.per_token_loss (megatron's calculate_per_token_loss): a step's loss is the mean over every
loss token of the global batch, computed here from the model's own per-token losses; with equal
token counts per micro-batch its gradients are the default's; and data-parallel and context x
pipeline-parallel layouts reproduce one process."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megadiff.config import build_config, data_parallel_size
from megadiff.parallel import initialize, shutdown
from megadiff.training.engine import build_engine, build_optimizer
from megadiff.training.step import train_step, validation_sums
from tests.distributed import run_ranks
from tests.parity_worker import MODEL, SEED, full_gradients, global_micro_batches, layout_independent_weights

PER_TOKEN = ["train.per_token_loss=true"]


def loss_masks(index: int, shape: torch.Size, even: bool) -> torch.Tensor:
    """Micro-batch `index` keeps its first 8 positions (even) or 2 + 3 x index of them."""
    mask = torch.zeros(shape)
    mask[:, :8 if even else 2 + 3 * index] = 1.0
    return mask


@torch.no_grad()
def reference_losses(engine, batches: list[dict]) -> tuple[float, float]:
    """(mean over all loss tokens, mean of the micro-batches' means) from the model's per-token losses."""
    sums, counts = [], []
    for batch in batches:
        losses = engine.model[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        sums.append(float((losses * batch["loss_mask"]).sum()))
        counts.append(float(batch["loss_mask"].sum()))
    return sum(sums) / sum(counts), sum(s / c for s, c in zip(sums, counts)) / len(sums)


def run_step(rank: int, world_size: int, overrides: list[str], even: bool, out_path: str) -> None:
    cfg = build_config({}, MODEL + ["model.variant=diff"] + overrides, world_size)
    initialize(cfg.parallel, SEED)
    engine = build_engine(cfg)
    layout_independent_weights(engine.unwrapped(), SEED)
    engine.optimizer = build_optimizer(cfg, engine.config, engine.model)
    batches = global_micro_batches(cfg, 0)
    for index, batch in enumerate(batches):
        batch["loss_mask"] = loss_masks(index, batch["labels"].shape, even)
    record = {}
    if world_size == 1:
        record["per_token"], record["per_micro_batch"] = reference_losses(engine, batches)
    mine = batches[parallel_state.get_data_parallel_rank()::data_parallel_size(cfg.parallel, world_size)]
    iterators = [iter(mine) for _ in engine.model]
    result = train_step(engine, iterators if len(iterators) > 1 else iterators[0], len(mine),
                        lambda e: record.update(grads=full_gradients(e)))
    record["loss"] = result.loss
    if rank == 0:
        torch.save(record, out_path)
    dist.barrier()
    shutdown()


def run(tmp_path, world_size: int, overrides: list[str], even: bool = False) -> dict:
    out = tmp_path / f"{world_size}-{'-'.join(overrides)}-{even}.pt"
    run_ranks(world_size, run_step, overrides, even, str(out))
    return torch.load(out)


def assert_same_gradients(got: dict, expected: dict, rel: float) -> None:
    assert set(got) == set(expected)
    for key, grad in expected.items():
        assert float((got[key] - grad).abs().max() / grad.abs().max().clamp(min=1e-12)) < rel, key


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("per-token"), 1, PER_TOKEN)


def test_the_loss_is_the_mean_over_every_loss_token(single, tmp_path):
    assert single["loss"] == pytest.approx(single["per_token"], rel=1e-6)
    assert single["per_token"] != pytest.approx(single["per_micro_batch"], rel=1e-3)  # unequal micro-batches
    default = run(tmp_path, 1, [])
    assert default["loss"] == pytest.approx(default["per_micro_batch"], rel=1e-6)


def test_equal_micro_batches_give_the_defaults_gradients(tmp_path):
    per_token, default = run(tmp_path, 1, PER_TOKEN, even=True), run(tmp_path, 1, [], even=True)
    assert per_token["loss"] == pytest.approx(default["loss"], rel=1e-6)
    assert_same_gradients(per_token["grads"], default["grads"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,layout", [
    (2, ["parallel.distributed_optimizer=true"]),
    (4, ["parallel.context=2", "parallel.pipeline=2"]),
])
def test_layouts_reproduce_one_process(single, tmp_path, world_size, layout):
    other = run(tmp_path, world_size, PER_TOKEN + layout)
    assert other["loss"] == pytest.approx(single["loss"], abs=2e-6)
    assert_same_gradients(other["grads"], single["grads"], rel=1e-4)


def step_without_loss_tokens(rank: int, world_size: int, overrides: list[str], out_path: str) -> None:
    """A step whose global batch has every target masked, after a step with loss tokens that fills the spike
    guard's window; writes the step's result, whether it moved the weights and the guard's history before and
    after it."""
    from megadiff.training.spikes import SpikeGuard

    cfg = build_config({}, MODEL + ["model.variant=diff"] + overrides, world_size)
    initialize(cfg.parallel, SEED)
    engine = build_engine(cfg)
    layout_independent_weights(engine.unwrapped(), SEED)
    engine.optimizer = build_optimizer(cfg, engine.config, engine.model)
    guard = SpikeGuard(sigma=3.0, window=2, losses=[5.0, 5.1], grad_norms=[1.0, 1.1])
    history = guard.history()
    batches = global_micro_batches(cfg, 0)
    for batch in batches:
        batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    weights = [p.detach().clone() for p in engine.unwrapped()[0].parameters()]
    result = train_step(engine, iter(batches), len(batches), spike_guard=guard)
    moved = any(not torch.equal(p, w) for p, w in zip(engine.unwrapped()[0].parameters(), weights))
    torch.save({"result": result, "moved": moved, "history": (history, guard.history())}, out_path)
    shutdown()


@pytest.mark.parametrize("overrides", [PER_TOKEN, []], ids=["per token", "per micro-batch"])
def test_a_global_batch_without_loss_tokens_has_no_loss_and_is_not_applied(tmp_path, overrides):
    """Chat data whose assistant turns were all cut: the step reported a loss of 0.0 (the masked count clamped
    to one), which entered the spike guard's window, and Adam's moments (and weight decay) moved the weights on
    its zero gradients. Now it has no loss, is not applied, and leaves the guard's window alone."""
    out = tmp_path / "step.pt"
    run_ranks(1, step_without_loss_tokens, overrides, str(out))
    seen = torch.load(out, weights_only=False)
    result = seen["result"]
    assert result.loss is None and not result.updated and result.no_loss_tokens
    assert not seen["moved"]
    before, after = seen["history"]
    assert after == before


def validation_forwards(rank: int, world_size: int, out_path: str) -> None:
    """validation_sums of one global batch of uneven loss masks, its reference means, and whether each forward
    it ran left an autograd graph (activations held for a backward that never comes)."""
    cfg = build_config({}, MODEL + ["model.variant=diff"], world_size)
    initialize(cfg.parallel, SEED)
    engine = build_engine(cfg)
    layout_independent_weights(engine.unwrapped(), SEED)
    engine.unwrapped()[0].eval()
    batches = global_micro_batches(cfg, 0)
    for index, batch in enumerate(batches):
        batch["loss_mask"] = loss_masks(index, batch["labels"].shape, even=False)
    graphs = []
    hook = engine.unwrapped()[0].register_forward_hook(lambda module, inputs, output: graphs.append(output.grad_fn))
    loss_sum, tokens = validation_sums(engine, iter(batches), len(batches)).tolist()
    hook.remove()
    torch.save({"mean": loss_sum / tokens, "reference": reference_losses(engine, batches)[0],
                "graphs": [graph is not None for graph in graphs]}, out_path)
    shutdown()


def test_validation_builds_no_autograd_graph_and_means_over_loss_tokens(tmp_path):
    """The periodic valid_loss ran its forwards with autograd on: every micro-batch's activations were held for a
    backward that never comes (training's activation memory again, in every evaluation). It runs them without,
    its mean over the loss tokens the model's own per-token losses give."""
    out = tmp_path / "validation.pt"
    run_ranks(1, validation_forwards, str(out))
    seen = torch.load(out)
    assert seen["mean"] == pytest.approx(seen["reference"], rel=1e-6)
    assert seen["graphs"] == [False] * 4  # global batch 8 / micro-batch 2


def _cross_entropies(rank: int, world_size: int, out_path: str) -> None:
    """megatron's native fused and unfused vocab-parallel cross entropies of the same bf16 logits (each
    rank holding half the vocabulary), their values and logits gradients; the fused one eager (its
    torch.compile is the GPU's)."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    draw = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, 2, 64, generator=draw)).to(torch.bfloat16)
    target = torch.randint(0, 64, (9, 2), generator=draw)
    shard = logits.chunk(world_size, dim=-1)[rank]
    results = {}
    for name in ("fused", "unfused"):
        mine = shard.clone().requires_grad_()
        if name == "fused":
            group = parallel_state.get_tensor_model_parallel_group()
            with torch._dynamo.config.patch(disable=True):
                loss = fused_vocab_parallel_cross_entropy(mine, target, group)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(mine, target)
        (grad,) = torch.autograd.grad(loss, mine, torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
        results[name] = (loss.detach(), grad)
    torch.save(results, f"{out_path}.{rank}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_the_fused_cross_entropy_of_bf16_runs_on_cuda_is_the_unfused_one(tmp_path, monkeypatch):
    """bf16 (and fp8) runs on CUDA take megatron's native fused cross entropy, which gives bf16 logits
    the unfused form's losses and gradients (TP=2: the vocabulary split over the ranks)."""
    from megadiff.models.transformer_config import to_transformer_config

    run_ranks(2, _cross_entropies, str(tmp_path / "ce"))
    for rank in range(2):
        results = torch.load(tmp_path / f"ce.{rank}")
        (fused_loss, fused_grad), (loss, grad) = results["fused"], results["unfused"]
        torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=1e-6)
        assert fused_grad.dtype == grad.dtype == torch.bfloat16
        torch.testing.assert_close(fused_grad, grad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flag only: nothing runs here
    for precision, fused in (("bf16", True), ("fp16", False), ("fp32", False)):
        cfg = build_config({}, MODEL + [f"train.precision={precision}"])
        assert to_transformer_config(cfg).cross_entropy_loss_fusion is fused, precision
