"""megadiff's config tree -> megatron-core TransformerConfig.

A differential model with h heads of width d (V of width 2d) is laid out for
megatron as 2h attention heads of width d and 2*n_kv query groups: the Q/K/V
projection then has exactly DIFF's widths, and adjacent megatron heads (2i,
2i+1) are the two maps of differential head i. This keeps megatron's own
SelfAttention, QKV split, RoPE and tensor-parallel head sharding untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megadiff.config import (
    DIFFERENTIAL_VARIANTS, Config, resolved_ffn_hidden_size, resolved_head_dim, resolved_head_norm, resolved_kv_heads,
)
from megadiff.config.validate import head_norm_of

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass
class MegadiffTransformerConfig(TransformerConfig):
    """TransformerConfig plus what the differential layers read."""

    variant: str = "softmax"
    lambda_init: Union[str, float] = "depth"
    lambda_std: float = 0.1
    head_norm: Optional[bool] = None  # RMSNorm of each head's output (model.head_norm); None: the variant's default
    lowrank_rank: int = 0
    lowrank_zero_init: bool = True
    attention_backend_name: str = "auto"
    sdpa_kernels: Optional[list[str]] = None  # model.sdpa_kernels: the order SDPA's kernels are tried in
    float8_linears: bool = False  # the local layers' linears in float8 (models/float8.py, fp8_backend=torchao)

    @property
    def normed_heads(self) -> bool:
        return head_norm_of(self.variant, self.head_norm)

    @property
    def differential_heads(self) -> int:
        return self.num_attention_heads // 2

    @property
    def differential_kv_heads(self) -> int:
        return self.num_query_groups // 2


def to_transformer_config(cfg: Config) -> MegadiffTransformerConfig:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    maps = 2 if m.variant in DIFFERENTIAL_VARIANTS else 1
    dtype = PRECISION_DTYPES[t.precision]
    recompute = {} if t.recompute == "none" else (
        {"recompute_granularity": "selective"} if t.recompute == "selective"
        else {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})
    return MegadiffTransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=resolved_ffn_hidden_size(m),
        num_attention_heads=maps * m.num_attention_heads,
        num_query_groups=maps * resolved_kv_heads(m),
        kv_channels=resolved_head_dim(m),
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        context_parallel_size=p.context,
        sequence_parallel=p.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype if t.precision != "fp32" else torch.float32,
        bf16=t.precision in ("bf16", "fp8"),
        fp16=t.precision == "fp16",
        fp8="hybrid" if t.precision == "fp8" and t.fp8_backend == "te" else None,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        # megatron's fused SwiGLU saves only fc1's output for backward (2 x ffn per token instead of
        # 4 x ffn); it is torch.compile'd, which on CPU costs more time than the tiny models save
        bias_activation_fusion=torch.cuda.is_available(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # megatron's native fused cross entropy: a few torch.compile'd passes over the logits where the
        # unfused form makes about eight (some 4 ms a micro-batch at a 100K vocabulary); it hands back
        # bf16 gradients, so only where the logits are bf16
        cross_entropy_loss_fusion=torch.cuda.is_available() and t.precision in ("bf16", "fp8"),
        cross_entropy_fusion_impl="native",
        # TransformerEngine's fused RoPE (megatron's default where TE is): one pass over q and k each
        # way instead of megatron's unfused six forward and seven backward
        apply_rope_fusion=m.transformer_impl == "te",
        persist_layer_norm=False,
        # gloo matches point-to-point messages per peer in posting order; megatron's batched ops
        # mix up activations and gradients when both pipeline neighbours are one rank (PP=2).
        # Its unbatched path sends the two directions over different groups.
        batch_p2p_comm=torch.cuda.is_available(),
        cuda_graph_scope=[],  # megatron's own default ("full") warns that it is deprecated
        transformer_impl="transformer_engine" if m.transformer_impl == "te" else "local",
        variant=m.variant,
        lambda_init=m.lambda_init,
        lambda_std=m.lambda_std,
        head_norm=resolved_head_norm(m),
        lowrank_rank=m.lowrank_rank,
        lowrank_zero_init=m.lowrank_zero_init,
        attention_backend_name=m.attention_backend,
        sdpa_kernels=m.sdpa_kernels,
        float8_linears=t.precision == "fp8" and t.fp8_backend == "torchao",
        calculate_per_token_loss=t.per_token_loss,
        **recompute,
    )
