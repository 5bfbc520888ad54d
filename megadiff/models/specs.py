"""Layer specs: megatron's GPT layer with the attention variant swapped in.

softmax      megatron's own SelfAttention + SDPA core attention (TE: TE's), the baseline
diff         SelfAttention + DifferentialCoreAttention
dint         same, the core attention adds the integral term
shared_diff  SelfAttention whose linear_qkv is SharedDiffQKV, + DifferentialCoreAttention

Backends (model.transformer_impl): "local" (megatron-core modules, runs anywhere)
or "te" (TransformerEngine linear/norm layers, BF16/FP8, following megatron's own
TE spec; the differential core attention stays ours). With train.fp8_backend=torchao
the local layers' parallel linears compute in float8 (models/float8.py).
"""
from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megadiff.models.differential_attention import DifferentialCoreAttention
from megadiff.models.float8 import use_float8_linears
from megadiff.models.norms import RMSNorm
from megadiff.models.shared_diff import SharedDiffQKV
from megadiff.models.softmax_attention import SoftmaxCoreAttention

DIFFERENTIAL = ("diff", "dint", "shared_diff")


def _te_norm():
    from megatron.core.extensions.transformer_engine import TENorm  # needs TransformerEngine
    return TENorm


def layer_spec(config) -> ModuleSpec:
    """One transformer layer for `config.variant` and `config.transformer_impl`."""
    te = config.transformer_impl == "transformer_engine"
    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec() if te
                         else get_gpt_layer_local_spec(normalization="RMSNorm"))
    layer = spec.submodules
    if not te:  # megatron's local norm refuses sequence parallelism; ours supports it
        layer.input_layernorm = RMSNorm
        layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    if config.variant in DIFFERENTIAL:
        attention.core_attention = DifferentialCoreAttention
    elif not te:  # megatron's local core attention materialises the N x N scores; SDPA's is fused
        attention.core_attention = SoftmaxCoreAttention
    if config.variant == "shared_diff":
        attention.linear_qkv = SharedDiffQKV
        if te:  # TE fuses the input norm into linear_qkv; Shared DIFF's projection needs it separately,
            layer.input_layernorm = _te_norm()  # saved under the fused key, as the local spec does
            layer.sharded_state_dict_keys_map = {**layer.sharded_state_dict_keys_map,
                                                 "input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if config.float8_linears:
        use_float8_linears(layer)
    return spec


def block_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (and virtual stage), with the final norm."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    final_norm = _te_norm() if config.transformer_impl == "transformer_engine" else RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec(config)] * layers, layer_norm=final_norm)
