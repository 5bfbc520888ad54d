"""Document masking for Hugging Face models: packed rows whose position ids restart after each
EOS, from which transformers builds the mask that keeps attention within each document
(masking_utils.find_packed_sequence_indices; only without a KV cache)."""
from __future__ import annotations

import torch


def document_position_ids(input_ids: torch.Tensor, eos: int) -> torch.Tensor:
    """[B, N] positions restarting after each EOS: RoPE sees each document from position 0, as it
    would alone, and transformers masks attention between the documents."""
    batch, seq = input_ids.shape
    index = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    starts = torch.ones_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def model_inputs(input_ids: torch.Tensor, document_eos: int | None) -> dict:
    """A causal LM's forward arguments for packed `input_ids`; with `document_eos`, attention stays
    within each document (transformers detects packing only without a KV cache)."""
    inputs = {"input_ids": input_ids, "use_cache": False}
    if document_eos is not None:
        inputs["position_ids"] = document_position_ids(input_ids, document_eos)
    return inputs
