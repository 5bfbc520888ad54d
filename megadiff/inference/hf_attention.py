"""A Hugging Face model's attention, read through transformers' attention interface: every call's
queries and keys (`outliers --hf`), and the rows at one query position that `needles --attention
--hf` allocates between the answer and the haystack, for a model the way transformers runs it
(Llama, Qwen2, Mistral, DiffLlama) and for its Dex/DAA adaptations (docs/SPEC.md section 9).

For a forward pass the interface is pointed at a function that shows each call's tensors to the
reader and then attends as SDPA does, so nothing of the model changes. Per layer and head, the row is:
- the softmax row, for a head as pretrained;
- transformers' DiffLlama (heads i and i + h the two maps of differential head i): (A1 - lambda
  A2) / (1 - lambda), as `needles --attention --load` gives a megadiff checkpoint's;
- DAA, diff_q, diff_k: (A1 - lambda A2) / (1 - lambda), the differential row normalised to sum 1
  as DIFF's are (a layer calls the interface twice, the second map second);
- Dex, which changes the head's output O' = O - lambda O W_D rather than its scores: the Dex
  paper's effective attention (its appendix F.3), the row X with X V = O', X = O' V^+ (the
  Moore-Penrose pseudoinverse of the values of the keys the query attends: under a sliding window
  the keys before it get none), exact since V has more rows than columns.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from megadiff.adapt.selection import attention_implementation
from megadiff.config import ConfigError

CAPTURE = "megadiff_attention_rows"
# what an attention call may be given beside its queries, keys, values and mask that the reading leaves out: SDPA
# drops a sink logit (gpt-oss's `s_aux`; Inkling 2's `sinks`, projected from each token's state, so no parameter
# names them) and a soft cap; it folds an additive position bias (Inkling's) into its mask, which the rows never see
UNREAD_CALL_ARGUMENTS = ("sinks", "s_aux", "softcap", "position_bias")
# the adaptations whose second map is a second softmax over the same keys
TWO_MAPS = ("daa", "diff_q", "diff_k")


def _softmax_row(query: torch.Tensor, key: torch.Tensor, scaling: float, attends: torch.Tensor | None
                 ) -> torch.Tensor:
    """query [1, H, 1, d], key [1, G, N, d] (G key/value heads), attends [N] booleans or None (every key)
    -> [H, N]."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = query.float() @ key.float().transpose(-1, -2) * scaling
    if attends is not None:
        scores = scores.masked_fill(~attends, float("-inf"))
    return torch.softmax(scores, dim=-1)[0, :, 0]


def _effective_dex_rows(rows: torch.Tensor, value: torch.Tensor, module, attends: torch.Tensor | None
                        ) -> torch.Tensor:
    """rows [H, N] -> the rows whose weighted values give Dex's output on its adapted heads, over the keys
    `attends` ([N] booleans, None: every key) only: the pseudoinverse of every key's values spread the row onto
    keys a sliding window hides from the head."""
    value = value.repeat_interleave(rows.shape[0] // value.shape[1], dim=1)[0].float()  # [H, N, d]
    seen = torch.ones(rows.shape[-1], dtype=torch.bool, device=rows.device) if attends is None else attends
    lam = module.current_lambda().float()
    effective = rows.clone()
    for slot, head in enumerate(module.adapter_heads):
        output = rows[head] @ value[head]
        adapted = output - lam * (output @ module.dex_weight[slot].float())
        effective[head] = 0.0
        effective[head, seen] = adapted @ torch.linalg.pinv(value[head, seen])
    return effective


def _diffllama_rows(rows: torch.Tensor, module) -> torch.Tensor:
    """DiffLlama's 2h map rows -> its h differential rows, normalised."""
    lam = (torch.exp((module.lambda_q1 * module.lambda_k1).sum(dtype=torch.float32))
           - torch.exp((module.lambda_q2 * module.lambda_k2).sum(dtype=torch.float32)) + module.lambda_init)
    first, second = rows.chunk(2)
    return (first - lam * second) / (1 - lam)


def _call_rows(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               mask: torch.Tensor | None) -> torch.Tensor:
    """One attention call's rows [H, N] at the last query (Dex's already effective: they need its values)."""
    attends = None if mask is None else mask[0, 0, -1]
    rows = _softmax_row(query[:, :, -1:], key, scaling, attends)
    if getattr(module, "adapter_method", None) == "dex":
        return _effective_dex_rows(rows, value, module, attends)
    return rows


def _layer_rows(module, calls: list[torch.Tensor]) -> torch.Tensor:
    """A layer's rows from its calls' _call_rows()."""
    method = getattr(module, "adapter_method", None)
    rows, *second = calls
    if hasattr(module, "lambda_q1") and hasattr(module, "groupnorm"):  # DiffLlama: its two calls differ in V only
        return _diffllama_rows(rows, module)
    if method == "dex":
        return rows
    if method in TWO_MAPS:
        lam = module.current_lambda().float()
        other = second[0]
        heads = module.adapter_heads
        rows[heads] = (rows[heads] - lam * other[heads]) / (1 - lam)
        return rows
    if method is not None:
        raise ConfigError(f"needles --attention: the effective attention of {method} is not defined "
                          "(its maps are the pretrained ones; the change is in V)")
    return rows


def _refuse_what_sdpa_leaves_out(hf) -> None:
    """A model whose attention SDPA (which the calls go on through) and the rows read do not compute: run on,
    the pass was another model's, every later layer's states and rows with it."""
    softcap = getattr(hf.config, "attn_logit_softcapping", None)
    if softcap:  # Gemma 2's
        raise ConfigError(f"{type(hf).__name__} soft-caps its attention logits (attn_logit_softcapping={softcap}), "
                          "which reading its attention through SDPA would not do: its attention cannot be read")
    # gpt-oss's, GraniteSWA's: a learned logit per head beside the keys', which the attention call is given
    sinks = [name for name, _ in hf.named_parameters() if name.endswith(".sinks")]
    if sinks:
        raise ConfigError(f"{type(hf).__name__} has attention sinks ({sinks[0]}, ...), which reading its attention "
                          "through SDPA would leave out: its attention cannot be read")


def _refuse_unread_arguments(module, arguments: dict) -> None:
    """The call-time check behind _refuse_what_sdpa_leaves_out's: what a model computes per call, and names its own
    way, no parameter or config key shows up front."""
    given = [name for name in UNREAD_CALL_ARGUMENTS if arguments.get(name) is not None]
    if given:
        raise ConfigError(f"{type(module).__name__} is given {', '.join(given)} beside its queries and keys, which "
                          "reading its attention through SDPA would leave out: its attention cannot be read")


@contextmanager
def attention_calls(hf, on_call: Callable[..., None]) -> Iterator[None]:
    """Within: every attention call of `hf`'s forward passes is shown to on_call(module, query,
    key, value, scaling, mask) ([B, heads, N, d] tensors as transformers hands them: rotated, keys not
    yet repeated for grouped queries; mask: SDPA's [B or 1, 1, N, N] booleans of the pairs attended,
    e.g. a sliding window's, or None where causality alone says; an additive mask's zeros), then
    attends as SDPA does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _refuse_what_sdpa_leaves_out(hf)

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        _refuse_unread_arguments(module, kwargs)
        attended = attention_mask
        if attended is not None and attended.dtype != torch.bool:  # an additive mask: 0 where attended
            attended = attended == 0
        on_call(module, query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5, attended)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(CAPTURE, capture)
    # SDPA's masks too: transformers makes none for an attention function it has no mask function for,
    # and SDPA would then attend causally over every key, a sliding window's model otherwise than it runs
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    with attention_implementation(hf, CAPTURE):
        yield


def refuse_megadiff_modeling_code(hf: str | None, command: str) -> None:
    """A directory of megadiff's own modeling code (model_type megadiff: a DINT or Shared DIFF export, or
    any exported with remote code) is refused from its config.json alone: that code calls SDPA itself, not
    transformers' attention interface, so the commands that read attention there would read no layer's,
    and said so only after the data was prepared and the weights read, without naming what reads it."""
    config = None if hf is None else Path(hf) / "config.json"
    if config is None or not config.is_file():
        return  # not an --hf run, or hf_window refuses the directory by name
    if json.loads(config.read_text()).get("model_type") == "megadiff":
        raise ConfigError(f"{command} --hf: {hf} holds megadiff's own modeling code, which attends through SDPA "
                          "and not transformers' attention interface, so its attention cannot be read there; "
                          f"run `megadiff {command} --load` on the checkpoint it was exported from")


def require_every_layer(hf, modules: int, command: str) -> None:
    layers = hf.config.num_hidden_layers
    if modules != layers:
        raise ConfigError(f"{command} --hf: {modules} of {type(hf).__name__}'s {layers} layers attend through "
                          "transformers' attention interface; its attention cannot be read")


@torch.no_grad()
def hf_attention_rows(model, tokens: list[int], position: int) -> list[torch.Tensor]:
    """Per layer, [heads, position + 1]: the (effective) attention of token `position` over the
    tokens up to it, for `model` an HFCausalLM."""
    calls: dict[torch.nn.Module, list[torch.Tensor]] = {}

    def keep(module, query, key, value, scaling, mask) -> None:
        # the rows, not the call's tensors: every layer's queries, keys and values of a 64K context
        # held to the end of the pass would take some 80 GB for a 13B model
        calls.setdefault(module, []).append(_call_rows(module, query, key, value, scaling, mask))

    with attention_calls(model.hf, keep):
        model.hf(input_ids=torch.tensor([tokens[:position + 1]], device=model.device), use_cache=False,
                 logits_to_keep=1)
    require_every_layer(model.hf, len(calls), "needles --attention")
    return [_layer_rows(module, module_calls) for module, module_calls in calls.items()]
