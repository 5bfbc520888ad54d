"""Tensor layouts: megadiff's (megatron, TP1) parameters <-> Hugging Face state dicts.

Hugging Face families:
  llama      softmax baseline -> LlamaForCausalLM
  diffllama  DIFF             -> DiffLlamaForCausalLM (stock; the learned head-norm weight is
                                 folded into o_proj's columns, since DiffLlama's norm has none)
  megadiff   DIFF, DINT, Shared DIFF -> MegadiffForCausalLM (hf_code/, trust_remote_code)

megatron's fused QKV weight holds, per query group, [its query heads | K | V] with d rows
per head. A differential model is 2h megatron heads / 2 n_kv groups whose adjacent heads
(2i, 2i+1) are the two maps of head i; Hugging Face (DiffLlama and hf_code alike) wants
all first maps then all second maps: [Q1 of every head; Q2 of every head].
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megadiff.config import ModelConfig, resolved_head_dim, resolved_kv_heads
from megadiff.errors import MegadiffError

LOWRANK_UPDATES = ("q1", "q2", "k1", "k2")


class ConversionError(MegadiffError, ValueError):
    """A checkpoint or model directory that cannot be converted as asked."""


@dataclass(frozen=True)
class Dims:
    family: str
    layers: int
    heads: int          # the variant's own heads (differential heads for DIFF/DINT/Shared DIFF)
    kv_heads: int
    head_dim: int
    tie_embeddings: bool
    shared: bool = False  # Shared DIFF's projections

    @classmethod
    def of(cls, model: ModelConfig, family: str) -> "Dims":
        return cls(family=family, layers=model.num_layers, heads=model.num_attention_heads,
                   kv_heads=resolved_kv_heads(model), head_dim=resolved_head_dim(model),
                   tie_embeddings=model.tie_embeddings, shared=model.variant == "shared_diff")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _split_groups(weight: torch.Tensor, groups: int, heads_per_block: tuple[int, ...], d: int) -> list[torch.Tensor]:
    """Rows [groups x (block_0 | block_1 | ...)] -> each block over all groups, rows in group order."""
    blocks = weight.reshape(groups, sum(heads_per_block), d, -1).split(heads_per_block, dim=1)
    return [block.reshape(-1, weight.shape[-1]) for block in blocks]


def _merge_groups(blocks: list[torch.Tensor], groups: int, d: int) -> torch.Tensor:
    columns = blocks[0].shape[-1]
    return torch.cat([block.reshape(groups, -1, d, columns) for block in blocks], dim=1).reshape(-1, columns)


def _pairs_to_halves(weight: torch.Tensor, d: int) -> torch.Tensor:
    """Heads ordered (0a, 0b, 1a, 1b, ...) -> (0a, 1a, ..., 0b, 1b, ...), d rows per head."""
    return weight.reshape(-1, 2, d, weight.shape[-1]).transpose(0, 1).reshape(-1, weight.shape[-1])


def _halves_to_pairs(weight: torch.Tensor, d: int) -> torch.Tensor:
    return weight.reshape(2, -1, d, weight.shape[-1]).transpose(0, 1).reshape(-1, weight.shape[-1])


def _qkv_to_hf(weight: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = dims.head_dim
    if dims.family == "llama":
        return tuple(_split_groups(weight, dims.kv_heads, (dims.group, 1, 1), d))
    q, k, v = _split_groups(weight, 2 * dims.kv_heads, (dims.group, 1, 1), d)
    return _pairs_to_halves(q, d), _pairs_to_halves(k, d), _pairs_to_halves(v, d)


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims) -> torch.Tensor:
    d = dims.head_dim
    if dims.family == "llama":
        return _merge_groups([q, k, v], dims.kv_heads, d)
    return _merge_groups([_halves_to_pairs(t, d) for t in (q, k, v)], 2 * dims.kv_heads, d)


def _shared_to_hf(weight: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared DIFF rows per key/value group: [its query heads | K | V (2d)]."""
    d = dims.head_dim
    q, k, v = _split_groups(weight, dims.kv_heads, (dims.group, 1, 2), d)
    return q, k, _pairs_to_halves(v, d)


def _shared_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims) -> torch.Tensor:
    d = dims.head_dim
    return _merge_groups([q, k, _halves_to_pairs(v, d)], dims.kv_heads, d)


def fold_head_norm(linear_proj: torch.Tensor, head_norm_weight: torch.Tensor, heads: int) -> torch.Tensor:
    """o_proj = linear_proj scaled column-wise by the (per-head repeated) head-norm weight, in fp32."""
    scale = head_norm_weight.float().repeat(heads)
    return (linear_proj.float() * scale[None, :]).to(linear_proj.dtype)


def _layer_to_hf(src: dict, dims: Dims, extras: dict, i: int) -> dict:
    """One layer; `src` maps megatron names relative to decoder.layers.{i}."""
    out = {"input_layernorm.weight": src["input_layernorm.weight"],
           "post_attention_layernorm.weight": src["pre_mlp_layernorm.weight"],
           "mlp.down_proj.weight": src["mlp.linear_fc2.weight"]}
    out["mlp.gate_proj.weight"], out["mlp.up_proj.weight"] = src["mlp.linear_fc1.weight"].chunk(2, dim=0)
    attn = "self_attention."
    if dims.shared:
        qkv = _shared_to_hf(src[attn + "linear_qkv.shared.weight"], dims)
        out["self_attn.lowrank_down.weight"] = src[attn + "linear_qkv.lowrank_down"]
        for name in LOWRANK_UPDATES:
            out[f"self_attn.lowrank_up_{name}.weight"] = src[f"{attn}linear_qkv.lowrank_up_{name}.weight"]
    else:
        qkv = _qkv_to_hf(src[attn + "linear_qkv.weight"], dims)
    out["self_attn.q_proj.weight"], out["self_attn.k_proj.weight"], out["self_attn.v_proj.weight"] = qkv
    proj = src[attn + "linear_proj.weight"]
    if dims.family != "llama":
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[f"self_attn.{name}"] = src[f"{attn}core_attention.{name}"]
        norm = src[attn + "core_attention.head_norm_weight"]
        if dims.family == "diffllama":
            extras[f"layers.{i}.head_norm_weight"], extras[f"layers.{i}.linear_proj.weight"] = norm, proj
            proj = fold_head_norm(proj, norm, dims.heads)
        else:
            out["self_attn.head_norm.weight"] = norm
    out["self_attn.o_proj.weight"] = proj
    return out


def _layer_from_hf(src: dict, dims: Dims, extras: dict | None, i: int) -> dict:
    out = {"input_layernorm.weight": src["input_layernorm.weight"],
           "pre_mlp_layernorm.weight": src["post_attention_layernorm.weight"],
           "mlp.linear_fc1.weight": torch.cat([src["mlp.gate_proj.weight"], src["mlp.up_proj.weight"]], dim=0),
           "mlp.linear_fc2.weight": src["mlp.down_proj.weight"]}
    attn = "self_attention."
    qkv = (src["self_attn.q_proj.weight"], src["self_attn.k_proj.weight"], src["self_attn.v_proj.weight"])
    if dims.shared:
        out[attn + "linear_qkv.shared.weight"] = _shared_from_hf(*qkv, dims)
        out[attn + "linear_qkv.lowrank_down"] = src["self_attn.lowrank_down.weight"]
        for name in LOWRANK_UPDATES:
            out[f"{attn}linear_qkv.lowrank_up_{name}.weight"] = src[f"self_attn.lowrank_up_{name}.weight"]
    else:
        out[attn + "linear_qkv.weight"] = _qkv_from_hf(*qkv, dims)
    proj = src["self_attn.o_proj.weight"]
    if dims.family != "llama":
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[f"{attn}core_attention.{name}"] = src[f"self_attn.{name}"]
        if dims.family == "diffllama":
            proj, norm = _unfold_head_norm(proj, extras, dims, i)
        else:
            norm = src["self_attn.head_norm.weight"]
        out[attn + "core_attention.head_norm_weight"] = norm
    out[attn + "linear_proj.weight"] = proj
    return out


def _unfold_head_norm(o_proj: torch.Tensor, extras: dict | None, dims: Dims, i: int):
    """The exact pre-fold tensors when the export's sidecar still matches o_proj; otherwise
    (e.g. fine-tuned since) unit norm weights and o_proj itself, which compute the same function."""
    norm, proj = (extras or {}).get(f"layers.{i}.head_norm_weight"), (extras or {}).get(f"layers.{i}.linear_proj.weight")
    if norm is not None and proj is not None and torch.equal(fold_head_norm(proj, norm, dims.heads), o_proj):
        return proj, norm
    return o_proj, torch.ones(2 * dims.head_dim, dtype=o_proj.dtype, device=o_proj.device)


def _layer_names(names: Iterable[str], prefix: str, layers: int) -> list[dict[str, str]]:
    """Per layer: {name relative to `prefix`{i}.: full name}."""
    per_layer: list[dict[str, str]] = [{} for _ in range(layers)]
    for name in names:
        if name.startswith(prefix):
            index, _, rest = name[len(prefix):].partition(".")
            per_layer[int(index)][rest] = name
    return per_layer


def megatron_to_hf(params: Mapping[str, torch.Tensor], dims: Dims) -> tuple[dict, dict]:
    """TP1 megatron parameters -> (HF state dict, sidecar tensors; DiffLlama's pre-fold weights)."""
    hf, extras = {}, {}
    for part in megatron_to_hf_parts(params, dims, extras):
        hf.update(part)
    return hf, extras


def megatron_to_hf_parts(params: Mapping[str, torch.Tensor], dims: Dims, extras: dict) -> Iterator[dict]:
    """megatron_to_hf a part at a time (the embeddings, final norm and head, then each layer), in its order, each
    layer's parameters read from `params` as it is converted; DiffLlama's sidecar tensors added to `extras`."""
    head = {"model.embed_tokens.weight": params["embedding.word_embeddings.weight"],
            "model.norm.weight": params["decoder.final_layernorm.weight"]}
    if not dims.tie_embeddings:
        head["lm_head.weight"] = params["output_layer.weight"]
    yield head
    for i, names in enumerate(_layer_names(params, "decoder.layers.", dims.layers)):
        yield _layer_of(params, names, dims, extras, i)


def _layer_of(params: Mapping[str, torch.Tensor], names: dict[str, str], dims: Dims, extras: dict, i: int) -> dict:
    """Layer i in Hugging Face's names; what it read from `params` (casts) kept only by what it returns."""
    layer = {rest: params[name] for rest, name in names.items()}
    return {f"model.layers.{i}.{k}": v for k, v in _layer_to_hf(layer, dims, extras, i).items()}


def hf_to_megatron(hf: Mapping[str, torch.Tensor], dims: Dims,
                   extras: Mapping | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """HF tensors -> TP1 megatron parameters, a part at a time: the embeddings and final norm, then
    each layer. Nothing here keeps a part once yielded: from a lazily read `hf` (hf_io.HFWeights), a
    caller that empties each part holds one layer's tensors at a time."""
    params = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
              "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not dims.tie_embeddings:
        params["output_layer.weight"] = hf["lm_head.weight"]
    yield params
    for i, names in enumerate(_layer_names(hf, "model.layers.", dims.layers)):
        converted = _layer_from_hf({rest: hf[name] for rest, name in names.items()}, dims, extras, i)
        yield {f"decoder.layers.{i}.{k}": converted.pop(k) for k in list(converted)}


def check_tensors(found: dict[str, tuple], expected: dict[str, torch.Size | tuple], where: str) -> None:
    """Refuse unknown, missing or mis-shaped tensors (`found`: their shapes by name), naming them."""
    unknown = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    problems = [f"unknown tensor {name} {tuple(found[name])}" for name in unknown]
    problems += [f"missing tensor {name} (expected shape {tuple(expected[name])})" for name in missing]
    problems += [f"tensor {name} has shape {tuple(found[name])}, expected {tuple(expected[name])}"
                 for name in sorted(set(found) & set(expected)) if tuple(found[name]) != tuple(expected[name])]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ConversionError(f"{where} does not match the model its config describes:\n  {shown}")


def expected_hf_shapes(params: dict[str, torch.Tensor], dims: Dims) -> dict[str, torch.Size]:
    """HF tensor names and shapes for a model with these megatron parameters (computed on meta tensors)."""
    meta = {name: torch.empty(p.shape, device="meta") for name, p in params.items()}
    return {name: t.shape for name, t in megatron_to_hf(meta, dims)[0].items()}
