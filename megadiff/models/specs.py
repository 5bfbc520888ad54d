"""Layer specs: megatron's local GPT layer with the attention variant swapped in.

softmax      megatron's own SelfAttention + DotProductAttention (the baseline)
diff         SelfAttention + DifferentialCoreAttention
dint         same, the core attention adds the integral term
shared_diff  SelfAttention whose linear_qkv is SharedDiffQKV, + DifferentialCoreAttention
"""
from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megadiff.models.differential_attention import DifferentialCoreAttention
from megadiff.models.norms import RMSNorm
from megadiff.models.shared_diff import SharedDiffQKV


def layer_spec(config) -> ModuleSpec:
    """One transformer layer for `config.variant`, local (non-TE) backend."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    layer = spec.submodules
    # megatron's local norm refuses sequence parallelism; ours supports it
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    if config.variant in ("diff", "dint", "shared_diff"):
        attention.core_attention = DifferentialCoreAttention
    if config.variant == "shared_diff":
        attention.linear_qkv = SharedDiffQKV
    return spec


def block_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (and virtual stage), with our final norm."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(config)] * layers, layer_norm=RMSNorm)
