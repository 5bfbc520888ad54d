"""Cross-field checks: each failure names the offending key(s)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

from megadiff.config.schema import (
    DIFFERENTIAL_VARIANTS, Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainConfig, WandbFields,
)
from megadiff.errors import MegadiffError
from megadiff.files import raise_if_a_file_is_in_the_way


class ConfigError(MegadiffError, ValueError):
    """A config that cannot work; raised before any compute."""


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


def resolved_kv_heads(model: ModelConfig) -> int:
    return model.num_kv_heads or model.num_attention_heads


def resolved_head_dim(model: ModelConfig) -> int:
    if model.head_dim is not None:
        return model.head_dim
    maps_per_head = 2 if model.variant in DIFFERENTIAL_VARIANTS else 1
    return model.hidden_size // (maps_per_head * model.num_attention_heads)


def head_norm_of(variant: str, head_norm: bool | None) -> bool:
    """Whether heads are normed: `head_norm`, or (None) the variant's default, on for the differential ones."""
    return variant in DIFFERENTIAL_VARIANTS if head_norm is None else head_norm


def resolved_head_norm(model: ModelConfig) -> bool:
    return head_norm_of(model.variant, model.head_norm)


def resolved_ffn_hidden_size(model: ModelConfig) -> int:
    if model.ffn_hidden_size is not None:
        return model.ffn_hidden_size
    return -(-(8 * model.hidden_size // 3) // 64) * 64


DERIVED_MODEL_KEYS = ("head_dim", "num_kv_heads", "ffn_hidden_size", "head_norm")


def resolved_architecture(model: ModelConfig) -> dict:
    """The model's settings with the derived ones resolved: null and the value it stands for (a recipe's
    explicit head_dim, a conversion's default) are the same model."""
    return {**model.model_dump(), "head_dim": resolved_head_dim(model), "num_kv_heads": resolved_kv_heads(model),
            "ffn_hidden_size": resolved_ffn_hidden_size(model), "head_norm": resolved_head_norm(model)}


def qkv_widths(model: ModelConfig) -> tuple[int, int, int]:
    """Widths of Q, K and V outputs (all maps together)."""
    maps = 2 if model.variant in DIFFERENTIAL_VARIANTS else 1
    d, h, h_kv = resolved_head_dim(model), model.num_attention_heads, resolved_kv_heads(model)
    return maps * h * d, maps * h_kv * d, maps * h_kv * d


def padded_vocab_size(model: ModelConfig, tensor_parallel: int) -> int:
    multiple = model.make_vocab_size_divisible_by * tensor_parallel
    return -(-model.vocab_size // multiple) * multiple


def validate_model(model: ModelConfig) -> None:
    h, h_kv = model.num_attention_heads, resolved_kv_heads(model)
    differential = model.variant in DIFFERENTIAL_VARIANTS
    if model.head_dim is None:
        maps = 2 if differential else 1
        if model.hidden_size % (maps * h):
            _fail("model.hidden_size", f"{model.hidden_size} is not divisible by "
                  f"{'2 x ' if differential else ''}model.num_attention_heads ({h}); set model.head_dim explicitly")
    if h % h_kv:
        _fail("model.num_kv_heads", f"model.num_attention_heads ({h}) must be a multiple of num_kv_heads ({h_kv})")
    if resolved_head_dim(model) % 2:
        _fail("model.head_dim", f"{resolved_head_dim(model)} must be even for rotary embeddings")
    if model.rope_theta != int(model.rope_theta):  # megatron-core's RoPE takes an integer base
        _fail("model.rope_theta", f"{model.rope_theta} must be an integer (megatron would use {int(model.rope_theta)})")
    scaling = model.rope_scaling
    if scaling is not None and scaling.high_freq_factor <= scaling.low_freq_factor:
        # equal, the interpolation between the two divides by zero: every middle frequency NaN
        _fail("model.rope_scaling.high_freq_factor", f"{scaling.high_freq_factor} must exceed low_freq_factor "
              f"({scaling.low_freq_factor})")
    if model.variant == "shared_diff" and model.lowrank_rank < 1:
        _fail("model.lowrank_rank", "Shared DIFF needs a rank >= 1")
    if model.variant != "shared_diff" and model.lowrank_rank:
        _fail("model.lowrank_rank", f"only used by variant 'shared_diff', not '{model.variant}'")
    if isinstance(model.lambda_init, float) and not differential:
        _fail("model.lambda_init", "only used by the differential variants")
    if isinstance(model.lambda_init, float) and not 0 <= model.lambda_init < 1:
        _fail("model.lambda_init", f"{model.lambda_init} must be in [0, 1) (the papers' (0, 1)): the heads' output is "
              "scaled by 1 - lambda_init, which 1 zeroes (no gradient reaches attention) and above 1 negates")
    if model.transformer_impl == "te":
        from importlib.util import find_spec
        if find_spec("transformer_engine") is None:
            _fail("model.transformer_impl", "'te' needs TransformerEngine, which is not installed; use 'local'")
    if model.sdpa_kernels is not None and differential and model.attention_backend in ("triton", "reference"):
        _fail("model.sdpa_kernels", f"model.attention_backend={model.attention_backend} makes no SDPA call; "
              "sdpa_kernels orders those of auto (off CUDA), sdpa and sdpa_split_v")
    if model.head_norm and not differential and model.transformer_impl == "te":
        _fail("model.head_norm", "the softmax baseline with model.transformer_impl=te runs TE's attention, which "
              "has no head-wise norm; use model.transformer_impl=local")
    if model.sdpa_kernels is not None and not differential and model.transformer_impl == "te":
        _fail("model.sdpa_kernels", "the softmax baseline with model.transformer_impl=te runs TE's attention, "
              "not SDPA; use model.transformer_impl=local")


def validate_parallel(model: ModelConfig, parallel: ParallelConfig, world_size: int | None = None,
                      seq_length: int | None = None) -> None:
    tp, pp, cp = parallel.tensor, parallel.pipeline, parallel.context
    h, h_kv = model.num_attention_heads, resolved_kv_heads(model)
    if h % tp:
        _fail("parallel.tensor", f"model.num_attention_heads ({h}) is not divisible by the tensor-parallel size {tp}")
    if h_kv % tp:
        _fail("parallel.tensor", f"GQA groups (model.num_kv_heads = {h_kv}) are not divisible by the "
              f"tensor-parallel size {tp}")
    ffn = resolved_ffn_hidden_size(model)
    if ffn % tp:
        _fail("parallel.tensor", f"the FFN width ({ffn}, model.ffn_hidden_size) is not divisible by the "
              f"tensor-parallel size {tp}")
    if parallel.sequence_parallel and tp == 1:
        _fail("parallel.sequence_parallel", "needs parallel.tensor > 1")
    seq = seq_length if seq_length is not None else model.seq_length
    if cp > 1 and seq % (2 * cp):
        _fail("parallel.context", f"sequence length {seq} is not divisible by 2 x parallel.context ({2 * cp})")
    # sequence parallelism splits each context-parallel rank's share of the sequence over the tensor ranks
    if parallel.sequence_parallel and (seq // cp) % tp:
        share = f"sequence length {seq} is" if cp == 1 else f"each context rank's {seq // cp} positions are"
        _fail("parallel.sequence_parallel", f"{share} not divisible by parallel.tensor ({tp})")
    chunks = pp * (parallel.virtual_pipeline or 1)
    if model.num_layers % chunks:
        what = "parallel.pipeline" + (" x parallel.virtual_pipeline" if parallel.virtual_pipeline else "")
        _fail("parallel.pipeline", f"model.num_layers ({model.num_layers}) is not divisible by {what} ({chunks})")
    if parallel.virtual_pipeline and pp < 2:
        _fail("parallel.virtual_pipeline", "interleaving needs parallel.pipeline >= 2")
    if parallel.overlap_param_gather and not parallel.distributed_optimizer:
        _fail("parallel.overlap_param_gather", "needs parallel.distributed_optimizer")
    if world_size is not None and world_size % (tp * pp * cp):
        _fail("parallel", f"world size {world_size} is not divisible by tensor x pipeline x context = {tp * pp * cp}")


def parse_blend(blend: list) -> tuple[list[str], Optional[list[float]]]:
    """data.blend -> (prefixes, weights or None): [w1, p1, w2, p2, ...] or [p1, p2, ...]."""
    if all(isinstance(item, str) for item in blend):
        return list(blend), None
    if len(blend) % 2:
        _fail("data.blend", f"{blend}: give [weight, prefix, weight, prefix, ...] pairs or only prefixes")
    weights, prefixes = blend[0::2], blend[1::2]
    for i, (weight, prefix) in enumerate(zip(weights, prefixes)):
        if isinstance(weight, str) or not isinstance(prefix, str):
            _fail("data.blend", f"item {2 * i} should be a weight and item {2 * i + 1} a prefix, got "
                  f"{weight!r}, {prefix!r}")
        if not (math.isfinite(weight) and weight > 0):
            _fail("data.blend", f"weight {weight} of {prefix} must be a positive number")
    return list(prefixes), [float(w) for w in weights]


def split_shares(split: str) -> list[float]:
    """data.split -> [train, valid, test] proportions (missing ones are 0), or a config error."""
    parts = split.split(",")
    if len(parts) > 3 or not all(re.fullmatch(r"\s*\d+(\.\d*)?\s*", part) for part in parts) \
            or float(parts[0]) == 0:
        _fail("data.split", f"{split!r}: give up to three non-negative train,valid,test proportions "
              "with train > 0, e.g. 949,50,1")
    return [float(part) for part in parts] + [0.0] * (3 - len(parts))


def validate_data(data: DataConfig) -> None:
    prefixes, _ = parse_blend(data.blend)
    for key, prefix in [("data.prefix", data.prefix), *(("data.blend", p) for p in prefixes)]:
        if prefix is not None and (not prefix.strip() or prefix.endswith("/")):
            # a directory: prepare-data wrote its hidden files there (dir/.bin, dir/.idx)
            _fail(key, f"{prefix!r} names no files: a prefix is a path less its extensions (PREFIX.bin, PREFIX.idx), "
                  "e.g. data/prepared/corpus")
    split_shares(data.split)
    if data.bundled_corpus and data.sources:
        _fail("data.bundled_corpus", "set either data.bundled_corpus or data.sources, not both "
              "(data.bundled_corpus=null to prepare data.sources)")
    if data.length_upsampling_unit is not None and not data.length_upsampling:
        _fail("data.length_upsampling_unit", "only used with data.length_upsampling=true")
    if data.response_key is not None and data.messages_key is not None:
        _fail("data.messages_key", "set either data.response_key (a prompt and a response per record) or "
              "data.messages_key (a conversation per record), not both")
    if data.chat_template is not None and data.messages_key is None:
        _fail("data.chat_template", "only used with data.messages_key")
    if data.masks_loss and data.length_upsampling:
        _fail(data.loss_mask_key, "prompt/response and conversation data are not up-sampled by length: set "
              "data.length_upsampling=false")


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    return world_size // (parallel.tensor * parallel.pipeline * parallel.context)


def gradient_bucket_numel(parallel: ParallelConfig, world_size: int) -> int | None:
    """The elements of each gradient bucket (None: one bucket a buffer, as without parallel.overlap_grad_reduce):
    megatron's default, larger past 40 data-parallel ranks. It lays out the distributed optimizer's state."""
    if not parallel.overlap_grad_reduce:
        return None
    return max(40_000_000, 1_000_000 * data_parallel_size(parallel, world_size))


def micro_batches_per_step(cfg: Config, world_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg.parallel, world_size))


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    validate_model(cfg.model)
    validate_parallel(cfg.model, cfg.parallel, world_size)
    validate_data(cfg.data)
    train = cfg.train
    if world_size is not None:
        dp = data_parallel_size(cfg.parallel, world_size)
        if train.global_batch_size % (train.micro_batch_size * dp):
            _fail("train.global_batch_size", f"{train.global_batch_size} is not divisible by "
                  f"train.micro_batch_size x data-parallel size ({train.micro_batch_size} x {dp})")
        if cfg.parallel.virtual_pipeline:
            micro_batches = micro_batches_per_step(cfg, world_size)
            if micro_batches % cfg.parallel.pipeline:
                _fail("train.global_batch_size", f"the interleaved schedule needs the number of micro-batches "
                      f"({micro_batches}) to be a multiple of parallel.pipeline ({cfg.parallel.pipeline})")
    _validate_profiling(cfg.logging, world_size)
    validate_wandb(cfg.logging)
    if train.min_lr > train.lr:
        _fail("train.min_lr", f"{train.min_lr} is above train.lr ({train.lr})")
    _validate_schedule(train)
    last_stage_seed = train.seed + 100 * (cfg.parallel.pipeline - 1)  # initialize.set_seed's offset per stage
    if last_stage_seed > 2**32 - 1:
        _fail("train.seed", f"{train.seed} + 100 per pipeline stage reaches {last_stage_seed}; numpy's seeds stop at "
              "2**32 - 1")
    if train.eval_interval and split_shares(cfg.data.split)[1] == 0:
        _fail("train.eval_interval", f"data.split {cfg.data.split!r} leaves no validation documents; give the "
              "valid split a share (e.g. 949,50,1) or set train.eval_interval=null")
    if train.eval_each_source and not train.eval_interval:
        _fail("train.eval_each_source", "needs train.eval_interval (when to evaluate)")
    if train.precision == "fp8":
        _validate_fp8_shapes(cfg)
        _validate_fp8(train.fp8_backend, cfg.model.transformer_impl)
    if cfg.data.document_masking:
        _validate_document_masking(cfg.model)
    if cfg.checkpoint.optimizer_format == "parallel" and not cfg.parallel.distributed_optimizer:
        _fail("checkpoint.optimizer_format", "parallel is a format of the distributed optimizer's state: it needs "
              "parallel.distributed_optimizer")


def refuse_a_file_for_directory(key: str, path: str | Path, writes: str) -> None:
    """A directory a command writes into: a file there (or where a parent of it should be) failed at the first
    write, after the start-up."""
    raise_if_a_file_is_in_the_way(path, lambda text: ConfigError(f"{key}: {text}; {writes}"))


def validate_wandb(logging: WandbFields) -> None:
    from importlib.util import find_spec

    if logging.wandb_project and find_spec("wandb") is None:
        _fail("logging.wandb_project", "W&B logging needs wandb, which is not installed (pip install wandb)")


def _validate_profiling(logging: LoggingConfig, world_size: int | None) -> None:
    if logging.profile_iterations is not None:
        first, last = logging.profile_iterations
        if not 1 <= first <= last:
            _fail("logging.profile_iterations", f"[{first}, {last}] must be [first, last] with 1 <= first <= last")
    outside = [rank for rank in logging.profile_ranks if rank < 0 or (world_size is not None and rank >= world_size)]
    if outside:
        _fail("logging.profile_ranks", f"{outside} are not ranks of this run (world size {world_size})")


def _validate_schedule(train: TrainConfig) -> None:
    if train.lr_decay_iters is not None and train.lr_decay_iters <= train.lr_warmup_iters:
        _fail("train.lr_decay_iters", f"{train.lr_decay_iters} ends the decay before train.lr_warmup_iters "
              f"({train.lr_warmup_iters}) ends the warmup")
    _validate_wsd(train)


def short_warmup_warning(train: TrainConfig) -> str | None:
    """A run whose warmup outlasts it (a recipe shortened for a trial, its warmup kept) never reaches train.lr:
    said, not refused, as a trial may mean it."""
    if train.lr_warmup_iters <= train.iters:  # the last iteration's lr is train.lr
        return None
    return (f"train.lr_warmup_iters: {train.lr_warmup_iters} iterations of warmup outlast train.iters={train.iters}: "
            f"the lr rises to {train.lr * train.iters / train.lr_warmup_iters:.3g}, never to train.lr={train.lr:g}")


def _validate_wsd(train: TrainConfig) -> None:
    if train.lr_decay_style != "wsd":
        if train.lr_wsd_decay_iters is not None:
            _fail("train.lr_wsd_decay_iters", "only used with train.lr_decay_style=wsd")
        return
    after_warmup = lr_decay_length(train) - train.lr_warmup_iters
    if train.lr_wsd_decay_iters is None:
        _fail("train.lr_wsd_decay_iters", "train.lr_decay_style=wsd needs the final decay's length in iterations")
    if train.lr_decay_iters is None and train.lr_warmup_iters >= train.iters:  # (lr_decay_iters: checked above)
        _fail("train.lr_wsd_decay_iters", f"train.lr_warmup_iters ({train.lr_warmup_iters}) leaves no iteration of "
              f"train.iters ({train.iters}) for WSD's stable phase and decay: shorten the warmup")
    if train.lr_wsd_decay_iters > after_warmup:
        _fail("train.lr_wsd_decay_iters", f"{train.lr_wsd_decay_iters} is longer than the schedule after its "
              f"warmup ({after_warmup} iterations: train.lr_decay_iters or train.iters, less train.lr_warmup_iters)")


def lr_decay_length(train: TrainConfig) -> int:
    """Iterations from the start to the end of the lr decay (train.lr_decay_iters, else train.iters)."""
    return max(train.lr_decay_iters or train.iters, train.lr_warmup_iters + 1)


def _validate_document_masking(model: ModelConfig) -> None:
    if model.variant == "softmax" and model.transformer_impl == "te":
        _fail("data.document_masking", "the softmax baseline with model.transformer_impl=te uses TE's attention, "
              "which takes documents only in THD packing; use model.transformer_impl=local")


def _validate_fp8(backend: str, transformer_impl: str) -> None:
    if backend == "te" and transformer_impl != "te":
        _fail("train.precision", "fp8 with train.fp8_backend=te needs model.transformer_impl=te (TransformerEngine); "
              "train.fp8_backend=torchao gives float8 linears in the local layers")
    if backend == "torchao" and transformer_impl == "te":
        _fail("train.fp8_backend", "torchao's float8 linears replace the local layers' linears; with "
              "model.transformer_impl=te use train.fp8_backend=te")
    if backend == "torchao":
        from importlib.util import find_spec
        if find_spec("torchao") is None:
            _fail("train.fp8_backend", "'torchao' needs torchao, which is not installed (pip install torchao)")


FP8_ALIGNMENT = 16  # float8 GEMMs (TransformerEngine's, torch._scaled_mm) take operands whose every side is a multiple


def _validate_fp8_shapes(cfg: Config) -> None:
    """What TE's and torchao's float8 matmuls would refuse on a GPU at the first step, refused here."""
    model, tp = cfg.model, cfg.parallel.tensor
    tokens = model.seq_length * cfg.train.micro_batch_size // cfg.parallel.context
    if tokens % FP8_ALIGNMENT:
        _fail("train.micro_batch_size", f"fp8 matmuls need the tokens of a micro-batch on a rank (model.seq_length x "
              f"train.micro_batch_size / parallel.context = {tokens}) to be a multiple of {FP8_ALIGNMENT}")
    q, k, v = qkv_widths(model)
    ffn = resolved_ffn_hidden_size(model)
    widths = {"model.hidden_size": model.hidden_size, "the attention output's per-rank width": q // tp,
              "model.ffn_hidden_size per rank": ffn // tp}
    if model.variant != "shared_diff":  # its QKV projection is not a float8 linear
        widths["the QKV projection's per-rank width"] = (q + k + v) // tp
    unaligned = [f"{name} ({width})" for name, width in widths.items() if width % FP8_ALIGNMENT]
    if unaligned:
        _fail("train.precision", f"fp8 matmuls need widths that are multiples of {FP8_ALIGNMENT}: "
              f"{', '.join(unaligned)} {'is' if len(unaligned) == 1 else 'are'} not (with parallel.tensor={tp})")
