"""Core attention of the softmax baseline through torch's fused SDPA (flash / cuDNN / memory-efficient).

megatron-core's local DotProductAttention materialises the N x N scores (baddbmm + softmax), so
without TransformerEngine the baseline would train slower and in O(N^2) memory while the
differential variants run fused kernels: comparisons between them would measure that, not the
attention variant. This module is the same computation through `megadiff.ops.softmax_attention`,
with causal masking and context parallelism like the differential core attention.
"""
from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megadiff.models.context_parallel import context_parallel_softmax_attention
from megadiff.models.differential_attention import head_norm_weight, head_wise_norm
from megadiff.models.documents import packed_documents
from megadiff.ops import sdpa_kernel_order, softmax_attention


class SoftmaxCoreAttention(MegatronModule):
    """softmax(q k^T / sqrt(d)) v per head, causal; GQA through SDPA itself. With model.head_norm (the DIFF
    paper's "Transformer + GroupNorm" ablation) each head's output is RMS-normalised, with no multiplier."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"the softmax core attention supports causal masking only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.attention_logit_bits: int | None = None  # as DifferentialCoreAttention's
        self.head_norm_weight = head_norm_weight(config, config.kv_channels)
        self.head_norm_eps = config.layernorm_epsilon

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        documents = packed_documents(packed_seq_params)
        with sdpa_kernel_order(self.config.sdpa_kernels):
            if self.config.context_parallel_size > 1:
                out = context_parallel_softmax_attention(query, key, value, softmax_scale=self.softmax_scale,
                                                         cu_seqlens=documents)
            else:
                # megatron's [s, b, heads, d] -> [b, s, heads, d]
                q, k, v = (t.transpose(0, 1) for t in (query, key, value))
                out = softmax_attention(q, k, v, causal=True, softmax_scale=self.softmax_scale,
                                        cu_seqlens=documents, logit_bits=self.attention_logit_bits)
        return head_wise_norm(out.transpose(0, 1), self.head_norm_weight, 1.0, self.head_norm_eps)
