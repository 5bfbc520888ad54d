"""Parameter and FLOP counts from the config alone (no model is allocated).

`megadiff params CONFIG` prints them, so a recipe can be sized before any GPU is touched. A
test checks the counts against a built model, and the recipes against the papers' sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from megadiff.config import (
    DIFFERENTIAL_VARIANTS, Config, ModelConfig, data_parallel_size, load_config, padded_vocab_size, qkv_widths,
    resolved_ffn_hidden_size, resolved_head_dim, resolved_head_norm, validate_config,
)


@dataclass(frozen=True)
class ParamCount:
    attention: int       # per layer: QKV (Shared DIFF: shared + low-rank), output projection, lambda, head norm
    attention_replicated: int  # of which every tensor-parallel rank holds all: lambda, head norm, low-rank A
    attention_vectors: int     # of which no matmul reads: lambda and head norm
    mlp: int             # per layer: SwiGLU fc1 (gate + up) and fc2
    norms: int           # per layer: the two RMSNorms
    num_layers: int
    embedding: int       # input embedding (padded vocabulary)
    output_layer: int    # 0 when tied to the embedding
    final_norm: int

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def non_embedding(self) -> int:
        return self.num_layers * self.per_layer + self.final_norm

    @property
    def total(self) -> int:
        return self.non_embedding + self.embedding + self.output_layer


def count_parameters(model: ModelConfig, tensor_parallel: int = 1) -> ParamCount:
    hidden, d = model.hidden_size, resolved_head_dim(model)
    q, k, v = qkv_widths(model)
    lowrank_down = 0
    if model.variant == "shared_diff":  # shared W_Q, W_K (half the maps' widths) + four rank-r updates
        r = model.lowrank_rank
        lowrank_down = 4 * r * hidden
        qkv = hidden * (q // 2 + k // 2 + v) + lowrank_down + 2 * r * (q // 2) + 2 * r * (k // 2)
    else:
        qkv = hidden * (q + k + v)
    differential = model.variant in DIFFERENTIAL_VARIANTS
    # lambda's four vectors, and the head-wise norm's weight (a differential head's output is 2d wide)
    vectors = (4 * d if differential else 0) + ((2 if differential else 1) * d if resolved_head_norm(model) else 0)
    ffn = resolved_ffn_hidden_size(model)
    vocab = padded_vocab_size(model, tensor_parallel)
    return ParamCount(
        attention=qkv + q * hidden + vectors,  # linear_proj reads every query head's output
        attention_replicated=vectors + lowrank_down,
        attention_vectors=vectors,
        mlp=3 * hidden * ffn,
        norms=2 * hidden,
        num_layers=model.num_layers,
        embedding=vocab * hidden,
        output_layer=0 if model.tie_embeddings else vocab * hidden,
        final_norm=hidden,
    )


def training_flops_per_token(model: ModelConfig, seq_length: int | None = None, tensor_parallel: int = 1) -> float:
    """Matmul FLOPs (forward + backward = 3 x forward) per trained token: the dense layers' and
    attention's, as MFU counts them (no recomputation)."""
    return (dense_training_flops_per_token(model, tensor_parallel)
            + attention_training_flops_per_token(model, seq_length))


def dense_training_flops_per_token(model: ModelConfig, tensor_parallel: int = 1) -> float:
    """2 FLOPs per matmul weight per token, times 3: the layers' and the output layer's weights (the
    vocabulary padded as at `tensor_parallel`), not the embedding lookup nor lambda and the head norms."""
    counts = count_parameters(model, tensor_parallel)
    weights = counts.num_layers * (counts.attention - counts.attention_vectors + counts.mlp) + counts.embedding
    return 3 * 2 * weights


def attention_training_flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Every map computes Q K^T and P V over, on average, half the sequence (causal), times 3."""
    seq = seq_length or model.seq_length
    q, _, _ = qkv_widths(model)
    maps = 2 if model.variant in DIFFERENTIAL_VARIANTS else 1
    # scores: all maps' query width; P V: each map times a V as wide as a differential head (2d)
    return 3 * model.num_layers * 2 * (seq / 2) * (q + maps * q)


def _billions(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def print_param_count(config_path: str, overrides: list[str], world_size: int | None = None,
                      fit_gib: float | None = None) -> int:
    """`megadiff params`: the counts, and the memory per GPU (model states, activations) of the
    config's layout on `world_size` ranks (default: one data-parallel replica); with `fit_gib`, the
    tensor/pipeline/recompute layouts that fit a GPU of that many GiB."""
    from megadiff.models.memory import describe, estimate_activations, model_state_memory

    cfg: Config = load_config(config_path, overrides, world_size=world_size)
    p = cfg.parallel
    world = world_size or p.tensor * p.pipeline * p.context
    if world_size is None:  # the batch sizes are checked against the data-parallel size of this world
        validate_config(cfg, world)
    counts = count_parameters(cfg.model, cfg.parallel.tensor)
    m = cfg.model
    print(f"{config_path}: variant {m.variant}, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"{m.num_attention_heads} heads x head dim {resolved_head_dim(m)}, ffn {resolved_ffn_hidden_size(m)}")
    rows = [("attention / layer", counts.attention), ("mlp / layer", counts.mlp), ("norms / layer", counts.norms),
            ("non-embedding", counts.non_embedding), ("embedding", counts.embedding),
            ("output layer", counts.output_layer), ("total", counts.total)]
    for name, value in rows:
        print(f"  {name:<18} {value:>16,d}  ({_billions(value)})")
    print(f"  training FLOPs / token: {training_flops_per_token(m, tensor_parallel=p.tensor):.3e}")
    print(f"per GPU on {world} rank{'s' if world > 1 else ''} (TP {p.tensor}, PP {p.pipeline}, CP {p.context}, DP "
          f"{data_parallel_size(p, world)}; {cfg.train.precision}"
          f"{', distributed optimizer' if p.distributed_optimizer else ''}; micro-batch "
          f"{cfg.train.micro_batch_size} x {m.seq_length} tokens, recompute {cfg.train.recompute}), "
          "the most loaded rank:")
    for name, value in describe(model_state_memory(cfg, world), estimate_activations(cfg, world)):
        print(f"  {name:<18} {value}")
    if fit_gib is not None:
        _print_fitting_layouts(config_path, overrides, cfg, world, fit_gib)
    return 0


LAYOUTS_SHOWN = 8


def _print_fitting_layouts(config_path: str, overrides: list[str], cfg: Config, world: int, fit_gib: float) -> None:
    from megadiff.models.activation_memory import NotEstimated
    from megadiff.models.layouts import fitting_layouts
    from megadiff.models.memory import GIB

    print(f"layouts that fit {fit_gib:g} GiB per GPU on {world} ranks (CP {cfg.parallel.context}, micro-batch "
          f"{cfg.train.micro_batch_size}, {'' if cfg.parallel.distributed_optimizer else 'no '}distributed optimizer; "
          "sequence-parallel with TP > 1), cheapest first:")
    try:
        layouts = fitting_layouts(config_path, overrides, world, int(fit_gib * GIB))
    except NotEstimated as reason:
        print(f"  not estimated: {reason}")
        return
    if not layouts:
        print("  none: try parallel.context, a smaller train.micro_batch_size, or more GPUs")
        return
    print(f"  {'TP':>3} {'PP':>3}  {'recompute':<10} {'model states':>13} {'activations':>12} {'peak':>9}")
    for layout in layouts[:LAYOUTS_SHOWN]:
        print(f"  {layout.tensor:>3} {layout.pipeline:>3}  {layout.recompute:<10} "
              f"{layout.model_states.total / GIB:>9.2f} GiB {layout.activations.total / GIB:>8.2f} GiB "
              f"{layout.peak / GIB:>5.2f} GiB")
    if len(layouts) > LAYOUTS_SHOWN:
        print(f"  ... and {len(layouts) - LAYOUTS_SHOWN} with more model-parallel ranks")
