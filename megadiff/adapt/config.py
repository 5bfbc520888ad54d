"""The adaptation config: one typed object (or a plain dict of the same keys).

`AdaptationConfig()` is the papers' defaults: Dex on the half of each layer's heads with the
highest attention entropy, lambda_init from the depth schedule, lambda_learn starting at 0.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from megadiff.adapt.modeling_adapted import INPUT_METHODS
from megadiff.adapt.selection import MEASURED_SELECTIONS
from megadiff.config import ConfigError
from megadiff.config.loader import format_validation_error
from megadiff.config.schema import StrictNumbers

Method = Literal["dex", "daa", "diff_q", "diff_k", "diff_v", "finetune"]
DAA_METHODS = ("daa",) + INPUT_METHODS
# the papers' control (their "FT" rows): the same model fine-tuned on the same data, without any adapter
CONTROL_METHOD = "finetune"

# Parameters trained by default (fnmatch patterns on parameter names)
LM_HEAD = "lm_head.*"
PAPER_TRAINABLE = {
    # Dex section 3.4: W_K, W_V, W_O, W_D and lambda_learn; W_Q, FFN, norms, embeddings frozen
    "dex": ["*.self_attn.k_proj.*", "*.self_attn.v_proj.*", "*.self_attn.o_proj.*",
            "*.self_attn.dex_weight", "*.self_attn.lambda_learn"],
    # DAA appendix E.2 (its Llama models): every parameter of the attention modules and the LM head
    # (E.1's GPT-2 kept the head frozen), the rest frozen
    **{method: ["*.self_attn.*", LM_HEAD] for method in DAA_METHODS},
    # DAA's FT rows (appendix E: standard attention, trained as its methods are); docs/SPEC.md section 6
    CONTROL_METHOD: ["*.self_attn.*", LM_HEAD],
}


NO_HEADS = "none"  # the control's selection: it adapts no head, so it measures nothing


class AdaptationError(ConfigError):
    """A bad adaptation config or an unsupported model, found before any compute."""


class AdaptationConfig(StrictNumbers):
    method: Method = Field("dex", description="dex | daa, or DAA's ablations diff_q | diff_k | diff_v, or "
                           "finetune: the papers' control, the same parameters trained without any adapter (the "
                           "head and lambda settings then describe nothing, and a recipe's are ignored)")
    selection: Optional[Literal["entropy", "importance", "all"]] = Field(
        None, description="which heads of each layer to adapt: 'entropy' (highest first), 'importance' "
        "(lowest first, Michel et al. 2019) on calibration batches, or 'all'. Default: entropy for dex, "
        "all for daa; diff_q/k/v always adapt whole layers")
    heads_fraction: float = Field(0.5, gt=0, le=1, description="share of each layer's heads to adapt "
                                  "(k = max(1, floor(fraction x heads)))")
    selected_heads: Optional[list[list[int]]] = Field(
        None, description="explicit adapted heads per layer (skips calibration)")
    lambda_init: Union[Literal["depth"], float] = Field(
        "depth", description="'depth': 0.8 - 0.6 exp(-0.3 (l - 1)) for layer l = 1..L, or a constant")
    lambda_learn_init: float = Field(0.0, description="initial value of the learnable lambda")
    anneal_steps: int = Field(1000, ge=0, description="T of lambda(t); 0 = lambda_learn from the start")
    calibration_batches: int = Field(4, ge=1, description="batches measured for entropy/importance")
    trainable: Optional[list[str]] = Field(
        None, description="fnmatch patterns of trained parameter names; default: the paper's freeze policy; "
        "['*'] trains everything")

    @field_validator("selection", "selected_heads")
    @classmethod
    def _whole_layer_methods_adapt_all_heads(cls, value, info: ValidationInfo):
        method = info.data.get("method")
        if method in INPUT_METHODS and value not in (None, "all"):
            raise ValueError(f"{method} adapts whole layers (one D x D matrix): only 'all' heads")
        return value

    @model_validator(mode="after")
    def _a_share_of_heads_needs_a_ranking(self):
        """heads_fraction is the share of each layer's heads that entropy or importance ranks first: with every
        head or selected_heads it was ignored without a word (DAA's default selection is every head)."""
        default = type(self).model_fields["heads_fraction"].default
        if self.heads_fraction != default and self.resolved_selection not in (*MEASURED_SELECTIONS, NO_HEADS):
            chosen = "selected_heads" if self.resolved_selection == "given" else \
                f"{self.method} with selection 'all' (every head of each layer)"
            raise ValueError(f"heads_fraction={self.heads_fraction} takes a share of the heads that selection "
                             f"'entropy' or 'importance' ranks; {chosen} adapts no share: remove heads_fraction, "
                             "or set selection")
        return self

    @property
    def resolved_selection(self) -> str:
        return resolve_selection(self.method, self.selection, self.selected_heads)

    def trainable_patterns(self, tied_head: bool) -> list[str]:
        """adaptation.trainable, else the paper's policy. A head tied to the embeddings is no parameter
        of its own (DAA's Llama-3.2-1B): then the attention modules alone train, as they did there."""
        if self.trainable is not None:
            return list(self.trainable)
        return [pattern for pattern in PAPER_TRAINABLE[self.method] if not (tied_head and pattern == LM_HEAD)]


def resolve_selection(method: str, selection: str | None, selected_heads: list | None) -> str:
    """The selection a method runs: none for the control, else the 'given' heads, else the one set, else the
    method's default."""
    if method == CONTROL_METHOD:
        return NO_HEADS
    if selected_heads is not None:
        return "given"
    if selection is not None:
        return selection
    return "entropy" if method == "dex" else "all"


def coerce_config(config: AdaptationConfig | dict | None, methods: tuple[str, ...]) -> AdaptationConfig:
    """A config object or dict for one of `methods` (the first is the default)."""
    if config is None:
        config = {}
    if isinstance(config, AdaptationConfig):
        config = config.model_dump(exclude_unset=True)
    config = {"method": methods[0], **config}
    try:
        parsed = AdaptationConfig.model_validate(config)
    except ValidationError as err:
        raise AdaptationError(format_validation_error(err, AdaptationConfig)) from None
    if parsed.method not in methods:
        raise AdaptationError(f"adaptation.method: {parsed.method!r} is not one of {methods} for this function")
    return parsed

