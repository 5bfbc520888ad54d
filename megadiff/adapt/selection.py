"""Which heads to adapt: per-head scores measured on calibration batches of the unmodified model.

- entropy: mean over query positions of the attention row's entropy -sum_j p_ij log p_ij, taken
  from the eager attention weights (the model is switched to eager attention while measuring).
  Dex adapts the highest-entropy heads.
- importance (Michel et al. 2019, "Are sixteen heads really better than one?"): each head's
  output is multiplied by a gate xi_h = 1; importance = mean over examples of |dL/dxi_h|, with L
  the example's mean next-token loss. Dex adapts the least important heads.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megadiff.adapt.documents import model_inputs


def num_selected(num_heads: int, fraction: float) -> int:
    return max(1, math.floor(num_heads * fraction))


def top_heads(scores: torch.Tensor, k: int, highest: bool) -> list[int]:
    """Indices of the k highest (or lowest) scores, ties broken by the lower index."""
    order = torch.argsort(scores if not highest else -scores, stable=True)
    return sorted(order[:k].tolist())


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str):
    """Within: `model` attends with transformers' attention function `name`, then as before."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# Eager attention keeps each layer's [heads, N, N] scores and probabilities, and the entropy two fp32
# copies of them: 68 GB and more for 32 heads at N = 32K. Entropy is measured on windows of at most
# this many tokens of a row, one window at a time (about 7 GB at 4K).
ENTROPY_WINDOW = 4096


def _windows(input_ids: torch.Tensor, length: int) -> list[torch.Tensor]:
    """[B, N] -> each row's consecutive pieces of at most `length` tokens, [1, <= length] each."""
    return [piece for row in input_ids for piece in row[None].split(length, dim=1)]


def attention_entropy(model: nn.Module, batches: Iterable[torch.Tensor], document_eos: int | None = None
                      ) -> torch.Tensor:
    """[layers, heads] mean attention entropy over the batches' query positions (with
    `document_eos`, attending within the documents packed in them), each position attending within
    its window of ENTROPY_WINDOW tokens."""
    modules = _attention_modules(model)
    totals = torch.zeros(len(modules), model.config.num_attention_heads, dtype=torch.float64)
    rows = 0

    def record(index):
        def hook(_module, _args, output):
            weights = output[1].float()  # [B, H, Nq, Nk]
            totals[index] += -torch.special.xlogy(weights, weights).sum(-1).sum((0, 2)).double().cpu()
        return hook

    handles = [module.register_forward_hook(record(i)) for i, module in enumerate(modules)]
    try:
        with attention_implementation(model, "eager"), torch.no_grad():
            for window in (piece for input_ids in batches for piece in _windows(input_ids, ENTROPY_WINDOW)):
                model(**model_inputs(window.to(model.device), document_eos))
                rows += window.numel()
    finally:
        for handle in handles:
            handle.remove()
    return (totals / rows).float()


def head_importance(model: nn.Module, batches: Iterable[torch.Tensor], document_eos: int | None = None
                    ) -> torch.Tensor:
    """[layers, heads] mean |dL/dxi_h| over the batches' examples (xi_h gates each head's output);
    `document_eos` as in attention_entropy."""
    modules = _attention_modules(model)
    num_heads = model.config.num_attention_heads
    totals = torch.zeros(len(modules), num_heads, dtype=torch.float64)
    examples = 0
    gates: list[torch.Tensor] = []

    def gate_heads(index):
        def pre_hook(_module, args):
            heads = args[0].unflatten(-1, (num_heads, -1))  # o_proj input [B, N, H * d] -> [B, N, H, d]
            return (heads * gates[index][:, None, :, None]).flatten(-2),
        return pre_hook

    handles = [module.o_proj.register_forward_pre_hook(gate_heads(i)) for i, module in enumerate(modules)]
    try:
        for input_ids in batches:
            input_ids = input_ids.to(model.device)
            gates[:] = [torch.ones(input_ids.shape[0], num_heads, device=model.device, dtype=model.dtype,
                                   requires_grad=True) for _ in modules]
            with torch.enable_grad():
                logits = model(**model_inputs(input_ids, document_eos)).logits.float()
                per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
                # each example's gate only touches that example, so d(sum)/d(gate[b]) = dL_b/d(gate[b])
                grads = torch.autograd.grad(per_token.mean(-1).sum(), gates)
            totals += torch.stack([g.abs().sum(0) for g in grads]).double().cpu()
            examples += input_ids.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    return (totals / examples).float()


MEASURED_SELECTIONS = ("entropy", "importance")  # the selections that run the model on calibration batches


def select_heads(model: nn.Module, selection: str, fraction: float, batches: list[torch.Tensor],
                 document_eos: int | None = None) -> list[list[int]]:
    """Per layer, the adapted heads for `selection` ('entropy' | 'importance' | 'all'), measured on
    `batches` (with `document_eos`, attending within their documents)."""
    num_layers, num_heads = len(model.model.layers), model.config.num_attention_heads
    if selection == "all":
        return [list(range(num_heads)) for _ in range(num_layers)]
    k = num_selected(num_heads, fraction)
    if selection == "entropy":
        return [top_heads(row, k, highest=True) for row in attention_entropy(model, batches, document_eos)]
    if selection == "importance":
        return [top_heads(row, k, highest=False) for row in head_importance(model, batches, document_eos)]
    raise ValueError(f"unknown head selection {selection!r}")
