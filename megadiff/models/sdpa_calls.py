"""Whether `model.sdpa_kernels` can run a model's SDPA calls where it trains: asked before the run starts,
as the first step would otherwise fail with torch's "No available kernel" after the model and data are built."""
from __future__ import annotations

import torch

from megadiff.config import DIFFERENTIAL_VARIANTS, Config, resolved_head_dim, resolved_kv_heads
from megadiff.models.transformer_config import PRECISION_DTYPES
from megadiff.ops import resolve_backend
from megadiff.ops.sdpa import sdpa_kernels_refusal


def sdpa_kernels_refusal_for(cfg: Config, device: torch.device) -> str | None:
    """torch's reasons why no kernel of model.sdpa_kernels takes this model's SDPA calls on `device` (None:
    one does, or the model makes none there). The calls' widths: the softmax baseline's V is as wide as Q
    and K, the sdpa backend's twice as wide, split V's as wide; one rank's heads under tensor parallelism;
    context parallelism's chunks carry a mask; document masking makes a call per document, down to one
    token (which cuDNN, for one, declines)."""
    m, tensor = cfg.model, cfg.parallel.tensor
    if m.sdpa_kernels is None:
        return None
    head_dim, dtype = resolved_head_dim(m), PRECISION_DTYPES[cfg.train.precision]
    value_dim = head_dim
    if m.variant in DIFFERENTIAL_VARIANTS:
        backend = resolve_backend(m.attention_backend, torch.empty(0, head_dim, dtype=dtype, device=device),
                                  2 * head_dim)
        if backend not in ("sdpa", "sdpa_split_v"):
            return None
        value_dim = head_dim if backend == "sdpa_split_v" else 2 * head_dim
    lengths = [(64, 128 if cfg.parallel.context > 1 else 64)] + ([(1, 1)] if cfg.data.document_masking else [])
    for rows, keys in lengths:
        refusal = sdpa_kernels_refusal(m.sdpa_kernels, heads=max(1, m.num_attention_heads // tensor),
                                       kv_heads=max(1, resolved_kv_heads(m) // tensor), head_dim=head_dim,
                                       value_dim=value_dim, dtype=dtype, device=device, rows=rows, keys=keys)
        if refusal:
            return refusal if rows > 1 else f"(a one-token document's call) {refusal}"
    return None
