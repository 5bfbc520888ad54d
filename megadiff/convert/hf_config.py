"""megadiff's model config <-> Hugging Face configs (LlamaConfig, DiffLlamaConfig, MegadiffConfig).

Every megadiff setting a Hugging Face class cannot express is refused here with
a message naming it, before any weights are read or written.
"""
from __future__ import annotations

import math

import torch
from pydantic import ValidationError

from megadiff.config import (
    DIFFERENTIAL_VARIANTS, ModelConfig, resolved_architecture, resolved_ffn_hidden_size, resolved_head_dim,
    resolved_head_norm, resolved_kv_heads,
)
from megadiff.config.schema import RopeScalingConfig
from megadiff.config.validate import DERIVED_MODEL_KEYS
from megadiff.convert.hf_layout import ConversionError

REMOTE_CODE_AUTO_MAP = {"AutoConfig": "configuration_megadiff.MegadiffConfig",
                        "AutoModel": "modeling_megadiff.MegadiffModel",
                        "AutoModelForCausalLM": "modeling_megadiff.MegadiffForCausalLM"}
SUPPORTED_MODEL_TYPES = ("llama", "diffllama", "megadiff")


def choose_family(model: ModelConfig, remote_code: bool = False) -> str:
    """Which Hugging Face class (one of SUPPORTED_MODEL_TYPES) a megadiff model becomes."""
    if resolved_head_norm(model) != (model.variant in DIFFERENTIAL_VARIANTS):
        raise ConversionError(
            f"model.head_norm is {model.head_norm} on variant {model.variant} (the DIFF paper's table 6 ablation): "
            "Llama has no head-wise norm, and DiffLlama and megadiff's modeling code always apply one")
    if model.variant == "softmax":
        return "llama"
    if model.variant != "diff" or remote_code:
        return "megadiff"
    if model.lambda_init != "depth":
        raise ConversionError(
            f"model.lambda_init is the constant {model.lambda_init}: stock DiffLlama always uses "
            "lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx) and cannot express it. Export with --remote-code "
            "(megadiff's own modeling code, loaded with trust_remote_code=True) instead.")
    return "diffllama"


def _common_fields(model: ModelConfig, vocab_size: int, bos: int, eod: int, dtype: torch.dtype) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=model.hidden_size,
                intermediate_size=resolved_ffn_hidden_size(model), num_hidden_layers=model.num_layers,
                max_position_embeddings=model.seq_length, rms_norm_eps=model.norm_eps,
                rope_parameters=hf_rope_parameters(model),
                tie_word_embeddings=model.tie_embeddings, bos_token_id=bos, eos_token_id=eod, pad_token_id=None,
                dtype=dtype)


def hf_rope_parameters(model: ModelConfig) -> dict:
    """transformers' rope_parameters of the model's RoPE: its base, and its scaling if it has one."""
    scaling = {} if model.rope_scaling is None else model.rope_scaling.model_dump()
    return {"rope_type": "default", **scaling, "rope_theta": model.rope_theta}


def build_hf_config(model: ModelConfig, family: str, vocab_size: int, bos: int, eod: int, dtype: torch.dtype):
    """The Hugging Face config of an export (vocab_size = the padded vocabulary)."""
    return _family_config(model, family, _common_fields(model, vocab_size, bos, eod, dtype))


def _family_config(model: ModelConfig, family: str, common: dict):
    heads, kv_heads, d = model.num_attention_heads, resolved_kv_heads(model), resolved_head_dim(model)
    if family == "llama":
        from transformers import LlamaConfig

        if model.hidden_size % heads:
            raise ConversionError(f"model.hidden_size ({model.hidden_size}) is not a multiple of "
                                  f"model.num_attention_heads ({heads}), which LlamaConfig requires")
        return LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                           architectures=["LlamaForCausalLM"], **common)
    if family == "diffllama":
        from transformers import DiffLlamaConfig

        # DiffLlama counts every softmax map as a head: 2h query heads, 2 n_kv key/value heads
        return DiffLlamaConfig(num_attention_heads=2 * heads, num_key_value_heads=2 * kv_heads, head_dim=d,
                               lambda_std_dev=model.lambda_std, architectures=["DiffLlamaForCausalLM"], **common)
    from megadiff.convert.hf_code.configuration_megadiff import MegadiffConfig

    config = MegadiffConfig(variant=model.variant, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=d, lambda_init=model.lambda_init, lambda_std=model.lambda_std,
                            lowrank_rank=model.lowrank_rank, architectures=["MegadiffForCausalLM"], **common)
    config.auto_map = dict(REMOTE_CODE_AUTO_MAP)
    return config


def load_hf_config(config_dict: dict, directory):
    """A config.json (already read) -> the matching config class, without running code from the directory."""
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"{directory}/config.json: model_type {model_type!r} is not convertible; megadiff reads "
                              f"{SUPPORTED_MODEL_TYPES}")
    if model_type == "llama":
        from transformers import LlamaConfig as config_class
    elif model_type == "diffllama":
        from transformers import DiffLlamaConfig as config_class
    else:
        from megadiff.convert.hf_code.configuration_megadiff import MegadiffConfig as config_class
    return config_class.from_pretrained(str(directory))


# the names transformers' ACT2FN maps to SiLU, x * sigmoid(x): megadiff's SwiGLU gate
SILU_NAMES = ("silu", "swish")


def _refuse_unsupported(hf, directory) -> None:
    rope = hf.rope_parameters or {}
    checks = [
        (getattr(hf, "hidden_act", "silu") in SILU_NAMES,
         f"hidden_act {getattr(hf, 'hidden_act', None)!r} (megadiff: silu)"),
        (not getattr(hf, "attention_bias", False), "attention_bias=true (megadiff has no biases)"),
        (not getattr(hf, "mlp_bias", False), "mlp_bias=true (megadiff has no biases)"),
        (rope.get("rope_type", "default") in ("default", "llama3"),
         f"rope_type {rope.get('rope_type')!r} (megadiff: default RoPE or llama3 scaling)"),
        (not getattr(hf, "attention_dropout", 0.0), "attention_dropout > 0"),
    ]
    unsupported = [what for ok, what in checks if not ok]
    if unsupported:
        raise ConversionError(f"{directory}: unsupported by megadiff: {', '.join(unsupported)}")


def _rope_scaling(rope: dict, directory) -> RopeScalingConfig | None:
    if rope.get("rope_type", "default") == "default":
        return None
    try:  # transformers' own check only warns of values out of range
        return RopeScalingConfig(**{name: rope[name] for name in RopeScalingConfig.model_fields})
    except ValidationError as err:
        raise ConversionError(f"{directory}: rope_parameters {rope}: {err}") from None


def _default_or_none(value: int, default: int) -> int | None:
    return None if value == default else value


def model_fields_from_hf(hf, directory) -> dict:
    """ModelConfig fields (all but the vocabulary) described by a Hugging Face config."""
    _refuse_unsupported(hf, directory)
    fields = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, seq_length=hf.max_position_embeddings,
                  rope_theta=float(hf.rope_parameters["rope_theta"]), norm_eps=hf.rms_norm_eps,
                  rope_scaling=_rope_scaling(hf.rope_parameters, directory),
                  tie_embeddings=bool(hf.tie_word_embeddings))
    heads, kv_heads, d = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    if hf.model_type == "llama":
        fields.update(variant="softmax")
    elif hf.model_type == "diffllama":
        if heads % 2 or kv_heads % 2:
            raise ConversionError(f"{directory}: DiffLlama needs even num_attention_heads and num_key_value_heads "
                                  f"(pairs of maps), got {heads} and {kv_heads}")
        heads, kv_heads = heads // 2, kv_heads // 2
        fields.update(variant="diff", lambda_init="depth", lambda_std=hf.lambda_std_dev)
    else:
        fields.update(variant=hf.variant, lambda_init=hf.lambda_init, lambda_std=hf.lambda_std,
                      lowrank_rank=hf.lowrank_rank)
    maps = 2 if fields["variant"] in DIFFERENTIAL_VARIANTS else 1
    fields.update(num_attention_heads=heads, num_kv_heads=_default_or_none(kv_heads, heads),
                  head_dim=_default_or_none(d, hf.hidden_size // (maps * heads)))
    fields["ffn_hidden_size"] = _default_or_none(
        hf.intermediate_size, resolved_ffn_hidden_size(ModelConfig(hidden_size=hf.hidden_size)))
    return fields


def same_model(model: ModelConfig, fields: dict) -> bool:
    """Whether `model` resolves to the architecture `fields` describe (defaults resolved on both sides)."""
    mine, theirs = resolved_architecture(model), resolved_architecture(model.model_copy(update=fields))
    return all(mine[key] == theirs[key] for key in (*fields, *DERIVED_MODEL_KEYS))


def vocab_padding_multiple(vocab_size: int) -> int:
    """A make_vocab_size_divisible_by that keeps a Hugging Face vocabulary exactly as it is."""
    return math.gcd(vocab_size, 128)
