"""Parameter counts without allocating: the recipes against the papers' sizes, and the formula
against real megatron models."""
from __future__ import annotations

import json

import pytest
import torch

from megadiff.config import build_config, load_config, padded_vocab_size, resolved_head_dim
from megadiff.data.tokenizers import load_tokenizer
from megadiff.models.param_count import (
    attention_training_flops_per_token, count_parameters, dense_training_flops_per_token, training_flops_per_token,
)
from tests.distributed import run_ranks
from tests.pretrain_runs import ROOT

CONFIGS = ROOT / "configs"
# DIFF paper table 10 (and its softmax baselines, which double the heads). The paper's sizes count
# the layers plus one vocabulary matrix.
SCALING = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9}
THREE_B = ["diff-3b.yaml", "diff-3b-350b.yaml", "softmax-3b.yaml", "dint-3b.yaml", "dint-3b-350b.yaml",
           "shared-diff-3b.yaml", "shared-diff-3b-350b.yaml", "diff-3b-64k.yaml", "softmax-3b-64k.yaml",
           "diff-3b-64k-math.yaml", "softmax-3b-64k-math.yaml", "diff-3b-64k-math-sft.yaml",
           "softmax-3b-64k-math-sft.yaml", "shared-diff-3b-64k.yaml", "dint-3b-64k.yaml", "diff-3b-chat-sft.yaml"]


@pytest.mark.parametrize("variant", ["diff", "softmax"])
@pytest.mark.parametrize("size", list(SCALING))
def test_scaling_recipes_have_the_papers_sizes(variant, size):
    counts = count_parameters(load_config(CONFIGS / "scaling" / f"{variant}-{size}.yaml").model)
    assert counts.non_embedding + counts.embedding == pytest.approx(SCALING[size], rel=0.02)


# Shared DIFF paper table 3: (hidden, layers, heads, rank) of each size
SHARED_DIFF_SCALING = {"830m": (1536, 24, 8, 96), "1.4b": (2048, 24, 10, 128), "2.8b": (2880, 32, 14, 256),
                       "6.8b": (4096, 35, 20, 320), "13.1b": (5120, 44, 30, 448)}


@pytest.mark.parametrize("size", list(SHARED_DIFF_SCALING))
def test_shared_diff_scaling_recipes_follow_its_table(size):
    """Table 3 as printed, trained as DIFF's scaling runs; the head dim where the hidden size is not
    divisible: the largest multiple of 8 not above it (docs/SPEC.md section 8). Sizes within 5% of
    their names, but 2.8B's row, which repeats the 3B model's hidden size (3.3B parameters)."""
    shared = load_config(CONFIGS / "scaling" / f"shared-diff-{size}.yaml")
    diff = load_config(CONFIGS / "scaling" / f"diff-{size}.yaml")
    model = shared.model
    assert (model.hidden_size, model.num_layers, model.num_attention_heads, model.lowrank_rank) == \
        SHARED_DIFF_SCALING[size]
    assert model.variant == "shared_diff" and shared.train == diff.train and shared.data == diff.data
    widest = model.hidden_size / (2 * model.num_attention_heads)
    assert resolved_head_dim(model) % 8 == 0 and 0 <= widest - resolved_head_dim(model) < 8
    counts = count_parameters(model)
    expected = 3.3e9 if size == "2.8b" else SCALING[size]
    assert counts.non_embedding + counts.embedding == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("recipe", THREE_B)
def test_3b_recipes_are_3b(recipe):
    """DIFF-3B (table 9) and Shared DIFF-3B (its table 1): about 3B parameters in the layers."""
    assert count_parameters(load_config(CONFIGS / recipe).model).non_embedding == pytest.approx(3e9, rel=0.07)


def test_the_comparison_runs_train_350b_tokens():
    """DIFF paper appendix B: DIFF-3B and the Transformer-3B compared (table 8, figure 3b, tables 2, 4, 5) both
    train 350B tokens, and section 3.3 extends those models (test_64k_recipes_extend_their_4k_models); table 1's
    DIFF-3B trains 1T. The baseline trained 1T, and the extensions loaded the 1T runs."""
    def tokens(name: str) -> int:
        cfg = load_config(CONFIGS / f"{name}.yaml")
        return cfg.train.iters * cfg.train.global_batch_size * cfg.model.seq_length

    for variant in ("diff", "shared-diff", "dint"):  # Shared DIFF's table 2 is 1T runs, its tables 4-5 DIFF's 350B
        assert tokens(f"{variant}-3b") == pytest.approx(1e12, rel=1e-3)
        assert tokens(f"{variant}-3b-350b") == tokens("softmax-3b") == pytest.approx(350e9, rel=1e-5)
        short, full = (load_config(CONFIGS / f"{variant}-3b{suffix}.yaml") for suffix in ("-350b", ""))
        assert short.model == full.model


@pytest.mark.parametrize("recipe", ["diff-3b.yaml", "scaling/diff-1.4b.yaml"])
def test_the_recipes_vocabulary_has_the_papers_rows(recipe):
    """DIFF paper table 9 (and Shared DIFF's table 1): 100,288 rows, cl100k_base's 100,277 ids padded; the
    recipes padded that figure again, to 100,352. At TP 1 and 2 (the 3B recipe's layout) they are the paper's."""
    model = load_config(CONFIGS / recipe).model
    assert [padded_vocab_size(model, tensor) for tensor in (1, 2)] == [100288, 100288]
    assert model.vocab_size == load_tokenizer(load_config(CONFIGS / recipe).data.tokenizer).vocab_size


def test_differential_and_softmax_recipes_match():
    """Half the heads of twice the width: the same parameters (up to lambda and head norms) and 1.5x
    the attention-score FLOPs."""
    diff, softmax = (load_config(CONFIGS / name).model for name in ("diff-3b.yaml", "softmax-3b.yaml"))
    assert count_parameters(diff).total == pytest.approx(count_parameters(softmax).total, rel=1e-5)
    assert training_flops_per_token(diff) > training_flops_per_token(softmax)


def test_shared_diff_saves_parameters_over_diff():
    diff = build_config({}, ["model.hidden_size=256", "model.num_attention_heads=4"]).model
    shared = build_config({}, ["model.hidden_size=256", "model.num_attention_heads=4", "model.variant=shared_diff",
                               "model.lowrank_rank=8"]).model
    assert count_parameters(shared).attention < count_parameters(diff).attention


MODELS = {
    "diff": ["model.variant=diff"],
    "diff_gqa_tied": ["model.variant=diff", "model.num_kv_heads=2", "model.tie_embeddings=true"],
    "dint": ["model.variant=dint"],
    "shared_diff_gqa": ["model.variant=shared_diff", "model.lowrank_rank=5", "model.num_kv_heads=2"],
    "softmax_gqa": ["model.variant=softmax", "model.num_attention_heads=8", "model.num_kv_heads=2"],
    # the DIFF paper's table 6 ablations: DIFF without its head-wise norm, the Transformer with one
    "diff_no_head_norm": ["model.variant=diff", "model.head_norm=false"],
    "softmax_head_norm": ["model.variant=softmax", "model.num_attention_heads=8", "model.head_norm=true"],
}
SMALL = ["model.num_layers=3", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=96",
         "model.vocab_size=300", "model.make_vocab_size_divisible_by=64", "model.seq_length=16"]


def _count_built(rank: int, world_size: int, out: str) -> None:
    from megadiff.models import build_model
    from megadiff.parallel import initialize, shutdown

    counted = {}
    for name, overrides in MODELS.items():
        cfg = build_config({}, SMALL + overrides)
        initialize(cfg.parallel, seed=0)
        counted[name] = sum(p.numel() for chunk in build_model(cfg) for p in chunk.parameters())
    shutdown()
    with open(out, "w") as handle:
        json.dump(counted, handle)


def test_formula_equals_the_built_models(tmp_path):
    out = tmp_path / "counts.json"
    run_ranks(1, _count_built, str(out))
    built = json.loads(out.read_text())
    for name, overrides in MODELS.items():
        assert count_parameters(build_config({}, SMALL + overrides).model).total == built[name], name


FLOP_LENGTHS = (16, 32)


def _count_flops(rank: int, world_size: int, out: str) -> None:
    """Each model's matmul FLOPs per token over one forward and backward, as torch's FlopCounterMode
    counts them on this rank: the weights' (aten.mm) and attention's (aten.bmm) apart."""
    from torch.utils.flop_counter import FlopCounterMode

    from megadiff.models import build_model
    from megadiff.parallel import initialize, shutdown

    measured = {}
    layout = [f"parallel.tensor={world_size}"]
    initialize(build_config({}, layout).parallel, seed=0)  # one layout for all the models
    for name, overrides in MODELS.items():
        for length in FLOP_LENGTHS:
            cfg = build_config({}, SMALL + overrides + layout + [f"model.seq_length={length}"])
            [model] = build_model(cfg)
            tokens = torch.arange(2 * length).view(2, length) % cfg.model.vocab_size  # the same on every rank
            with FlopCounterMode(display=False) as counter:
                model(tokens, torch.arange(length).expand(2, length), None, labels=tokens).sum().backward()
            counts = {str(op): flops / tokens.numel() for op, flops in counter.get_flop_counts()["Global"].items()}
            measured[f"{name}/{length}"] = counts
    shutdown()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(measured, handle)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_flops_formula_equals_the_built_models_matmuls(tmp_path, tensor_parallel):
    """The weights' FLOPs (every rank's share, the vocabulary padded at that TP size) are the
    formula's dense part exactly; the reference attention computes every (query, key) pair, twice
    the causal half the formula counts. On a CPU SDPA's own kernel (the softmax model's) counts none."""
    out = tmp_path / "flops.json"
    run_ranks(tensor_parallel, _count_flops, str(out))  # rank 0's share: TP ranks hold equal shares
    measured = json.loads(out.read_text())
    for name, overrides in MODELS.items():
        for length in FLOP_LENGTHS:
            model = build_config({}, SMALL + overrides).model
            counts = measured[f"{name}/{length}"]
            if name.startswith("shared_diff") and tensor_parallel > 1:
                continue  # every rank computes the replicated low-rank A's product: more than the model's FLOPs
            assert tensor_parallel * counts["aten.mm"] == dense_training_flops_per_token(model, tensor_parallel), name
            attention = counts.get("aten.bmm", 0) * tensor_parallel
            expected = 0 if name.startswith("softmax") else 2 * attention_training_flops_per_token(model, length)
            assert attention == expected, (name, length)


@pytest.mark.parametrize("variant", ["diff", "softmax"])
def test_math_recipes_continue_the_64k_models(variant):
    """The DIFF paper's appendix C: the 64K model itself, 20B tokens in 4M-token batches at LR 8e-5,
    a checkpoint every 2B tokens, from the 64K run's output."""
    math_run, long_run = (load_config(CONFIGS / f"{variant}-3b-64k{suffix}.yaml") for suffix in ("-math", ""))
    assert math_run.model == long_run.model and math_run.checkpoint.load == long_run.output_dir
    tokens_per_step = math_run.train.global_batch_size * math_run.model.seq_length
    assert tokens_per_step == pytest.approx(4e6, rel=0.05) and math_run.train.lr == 8e-5
    assert math_run.train.iters * tokens_per_step == pytest.approx(20e9, rel=1e-3)
    assert math_run.checkpoint.save_interval * tokens_per_step == pytest.approx(2e9, rel=1e-3)


@pytest.mark.parametrize("variant", ["diff", "softmax"])
def test_distillation_recipes_continue_the_math_models(variant):
    """Appendix C's second stage: the math model itself, 2B tokens in 1M-token batches at LR 1e-5,
    the loss on the responses only."""
    distilled, math_run = (load_config(CONFIGS / f"{variant}-3b-64k-math{suffix}.yaml") for suffix in ("-sft", ""))
    assert distilled.model == math_run.model and distilled.checkpoint.load == math_run.output_dir
    tokens_per_step = distilled.train.global_batch_size * distilled.model.seq_length
    assert tokens_per_step == pytest.approx(1e6, rel=0.05) and distilled.train.lr == 1e-5
    assert distilled.train.iters * tokens_per_step == pytest.approx(2e9, rel=1e-3)
    assert distilled.data.response_key is not None


@pytest.mark.parametrize("variant", ["diff", "softmax", "shared-diff", "dint"])
def test_64k_recipes_extend_their_4k_models(variant):
    """The same model but for the window and RoPE's base, continued from the 4K run on appendix B's 350B tokens."""
    short = load_config(CONFIGS / f"{variant}-3b{'' if variant == 'softmax' else '-350b'}.yaml")
    long = load_config(CONFIGS / f"{variant}-3b-64k.yaml")
    assert long.model.seq_length == 65536 and long.model.rope_theta == 640000
    assert long.model.model_copy(update={"seq_length": short.model.seq_length,
                                         "rope_theta": short.model.rope_theta}) == short.model
    assert long.checkpoint.load == short.output_dir
