"""Core attention for DIFF and DINT, plugged into megatron's SelfAttention.

Receives megatron's rotated q/k/v with 2h heads of width d (see
transformer_config.py for the layout), pairs adjacent heads into the two maps
of each differential head, applies the op, the head-wise RMSNorm and the
(1 - lambda_init) multiplier, and returns [s, b, h * 2d] for linear_proj.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megadiff.models.context_parallel import context_parallel_differential_attention
from megadiff.models.documents import packed_documents
from megadiff.ops import (
    IntegralCarry, depth_lambda_init, paired_differential_attention, reparameterized_lambda, sdpa_kernel_order,
)
from megadiff.ops.common import map_pairs


# lambda's vectors and the head-norm weight are replicated over the tensor-parallel ranks, each of which
# computes their gradient from its own heads only: the ranks' gradients are summed once per step
PARTIAL_GRADIENT = "tensor_parallel_partial_gradient"


def sum_partial_gradients(model_chunks: list) -> None:
    """After megatron's finalize_model_grads: one coalesced all-reduce over the tensor-parallel group of
    the gradients each rank holds a part of (copying the parameters into the tensor-parallel region
    all-reduced them one by one, five per layer per micro-batch)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [param.main_grad for chunk in model_chunks for param in chunk.parameters()
             if getattr(param, PARTIAL_GRADIENT, False) and param.requires_grad]
    if grads:
        summed = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(summed, group=group)
        for grad, total in zip(grads, _unflatten_dense_tensors(summed, grads)):
            grad.copy_(total)


def head_norm_weight(config, width: int) -> torch.nn.Parameter | None:
    """The weight of the RMSNorm of each head's output (width wide), or None where model.head_norm is off."""
    if not config.normed_heads:
        return None
    weight = torch.nn.Parameter(torch.ones(width, dtype=config.params_dtype))
    setattr(weight, PARTIAL_GRADIENT, True)
    return weight


def head_wise_norm(out: torch.Tensor, weight: torch.Tensor | None, scale: float, eps: float) -> torch.Tensor:
    """[s, b, heads, width] -> [s, b, heads * width]: each head's RMSNorm times `scale`, or the heads as they
    are without a weight (model.head_norm off: the DIFF paper's ablation drops the norm and its multiplier).
    torch's rms_norm normalises in fp32 whatever the dtype it reads and writes (bf16 in training: an fp32 copy
    of the output cost three more passes over it, and as many in backward); the scale rides on the weight
    rather than taking another pass."""
    if weight is not None:
        out = F.rms_norm(out, (out.shape[-1],), (weight * scale).to(out.dtype), eps)
    return out.reshape(*out.shape[:2], -1)


def layer_lambda_init(lambda_init: str | float, layer_number: int) -> float:
    """megatron's layer_number is 1-based and global (pipeline offset included)."""
    return depth_lambda_init(layer_number - 1) if lambda_init == "depth" else float(lambda_init)


class DifferentialCoreAttention(MegatronModule):
    """(A1 - lambda A2) V [+ lambda * running mean of A1 V for DINT], then head-wise norm."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"differential attention supports causal masking only, got {attn_mask_type}")
        self.integral = config.variant == "dint"
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale
        self.backend = config.attention_backend_name
        self.lambda_init = layer_lambda_init(config.lambda_init, layer_number)
        # lambda's vectors are made fp32 (exp() of their dot products is sensitive); in bf16/fp16 training
        # megatron's Float16Module casts them with every weight, the optimizer keeping fp32 master copies
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            torch.nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32)) for _ in range(4))
        self.head_norm_weight = head_norm_weight(config, 2 * self.head_dim)
        for param in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            setattr(param, PARTIAL_GRADIENT, True)
        self.head_norm_eps = config.layernorm_epsilon
        # set by single-process inference only (the DIFF paper's Figure 8): attention logits quantized to
        # these bits (megadiff.inference.harness)
        self.attention_logit_bits: int | None = None
        # set while a KVCache decodes (DINT only): the integral's running sum over the cached positions
        self.integral_carry: IntegralCarry | None = None
        # the lambda of the last forward, which training logs with that iteration's loss: read without the
        # weights, whose all-gather an overlapped optimizer step leaves to the next forward
        self.last_lambda: torch.Tensor | None = None
        self.reset_lambda_parameters()

    def reset_lambda_parameters(self) -> None:
        with torch.no_grad():
            for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                vector.normal_(mean=0.0, std=self.config.lambda_std)

    def current_lambda(self) -> torch.Tensor:
        return reparameterized_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        documents = packed_documents(packed_seq_params)
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by differential attention")
        d = self.head_dim
        # [s, b, 2h, d]: adjacent megatron heads are the two maps of one differential head; keys may
        # outnumber queries (a decoding step's queries attend to the cached keys too)
        v = value.reshape(*value.shape[:2], -1, 2 * d)
        lam = self.current_lambda()
        self.last_lambda = lam.detach()
        with sdpa_kernel_order(self.config.sdpa_kernels):
            if self.config.context_parallel_size > 1:
                (q1, q2), (k1, k2) = map_pairs(query), map_pairs(key)
                out = context_parallel_differential_attention(q1, k1, q2, k2, v, lam, integral=self.integral,
                                                              softmax_scale=self.softmax_scale, backend=self.backend,
                                                              cu_seqlens=documents)
            else:
                query, key, v = (t.transpose(0, 1) for t in (query, key, v))
                out = paired_differential_attention(query, key, v, lam, causal=True, integral=self.integral,
                                                    softmax_scale=self.softmax_scale, backend=self.backend,
                                                    cu_seqlens=documents, logit_bits=self.attention_logit_bits,
                                                    integral_carry=self.integral_carry)
        # [b, s, ...] -> [s, b, ...]: the Triton kernel wrote its output [s, b, ...] in memory (as the
        # queries are), so the norm reads it in place and linear_proj's reshape copies nothing
        out = head_wise_norm(out.transpose(0, 1), self.head_norm_weight, 1.0 - self.lambda_init, self.head_norm_eps)
        return out.to(query.dtype)
