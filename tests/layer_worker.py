"""Runs in a fresh process: one megadiff attention layer (megatron SelfAttention + our
modules) per variant, forward and backward on random data; saves everything the
naive reference in test_attention_layers.py needs."""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

from megadiff.config import build_config
from megadiff.models.specs import layer_spec
from megadiff.models.transformer_config import to_transformer_config
from megadiff.parallel import initialize, shutdown

LAYER_NUMBER = 3  # depth 2: lambda_init = 0.8 - 0.6 exp(-0.6)
SEQ, BATCH = 12, 2
MODEL = ["model.hidden_size=48", "model.num_attention_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
         "model.rope_theta=500", "model.seq_length=12", "model.vocab_size=64"]
VARIANTS = {
    "diff": ["model.variant=diff"],
    "dint": ["model.variant=dint"],
    "shared_diff": ["model.variant=shared_diff", "model.lowrank_rank=3", "model.lowrank_zero_init=false"],
    "diff_constant_lambda": ["model.variant=diff", "model.lambda_init=0.5"],
    # the DIFF paper's table 6 ablations: DIFF without GroupNorm, the Transformer with it
    "diff_no_head_norm": ["model.variant=diff", "model.head_norm=false"],
    "softmax_head_norm": ["model.variant=softmax", "model.head_norm=true"],
}


def run(rank: int, world_size: int, out_path: str) -> None:
    results = {}
    for name, overrides in VARIANTS.items():
        cfg = build_config({}, MODEL + overrides, world_size)
        initialize(cfg.parallel, seed=7)
        config = to_transformer_config(cfg)
        attention = build_module(layer_spec(config).submodules.self_attention, config=config,
                                 layer_number=LAYER_NUMBER)
        with torch.no_grad():  # move every parameter away from its init so each one matters
            for param in attention.parameters():
                param.add_(0.1 * torch.randn_like(param))
        rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                 rotary_base=int(cfg.model.rope_theta), use_cpu_initialization=True)
        x = torch.randn(SEQ, BATCH, cfg.model.hidden_size, requires_grad=True)
        out, _ = attention(x, attention_mask=None, rotary_pos_emb=rotary(SEQ))
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        results[name] = dict(
            overrides=overrides, x=x.detach(), grad_out=grad_out, out=out.detach(), grad_x=x.grad,
            params={k: p.detach().clone() for k, p in attention.named_parameters()},
            grads={k: p.grad.clone() for k, p in attention.named_parameters()},
        )
    torch.save(results, out_path)
    shutdown()
