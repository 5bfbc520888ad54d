"""The softmax baseline's SDPA core attention against a naive causal softmax written here (GQA)."""
from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType

from megadiff.models.softmax_attention import SoftmaxCoreAttention
from megadiff.models.transformer_config import MegadiffTransformerConfig
from tests.test_ops import quantized_rows

SEQ, BATCH, HEADS, GROUPS, D = 9, 2, 4, 2, 8


def naive(q, k, v, logit_bits=None):
    """[s, b, heads, d] in (k, v with GROUPS heads), [s, b, heads * d] out; logit_bits: each
    map's scores quantized (tests/test_ops.quantized_rows)."""
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    if logit_bits is not None:
        scores = torch.stack([torch.stack([quantized_rows(head, logit_bits) for head in sample]) for sample in scores])
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(SEQ, BATCH, HEADS * D)


def core_attention_and_inputs():
    config = MegadiffTransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                                       num_query_groups=GROUPS, use_cpu_initialization=True)
    core = SoftmaxCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, HEADS, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, D, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    return core, q, k, v, gen


def test_quantized_logits_match_naive():
    """`megadiff lm-eval --attention-logit-bits` sets the core attention's attention_logit_bits."""
    core, q, k, v, _ = core_attention_and_inputs()
    core.attention_logit_bits = 4
    torch.testing.assert_close(core(q, k, v, None), naive(q, k, v, logit_bits=4))
    assert not torch.allclose(core(q, k, v, None), naive(q, k, v), atol=1e-4)


def test_matches_naive_causal_softmax_with_gqa():
    core, q, k, v, gen = core_attention_and_inputs()
    grad = torch.randn(SEQ, BATCH, HEADS * D, generator=gen, dtype=torch.float64)
    got = core(q, k, v, None)
    want = naive(q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b)
