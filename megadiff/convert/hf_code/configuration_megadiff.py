"""Hugging Face configuration of megadiff's differential-attention models.

`megadiff convert to-hf` copies this file (and modeling_megadiff.py) next to
the weights of Shared DIFF and DINT models (and of DIFF ones that stock
DiffLlama cannot express), so `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)` loads them. It imports only transformers.

Head counting follows megadiff, not DiffLlama: `num_attention_heads` is the
number of differential heads, each with two softmax maps of width `head_dim`
and a value of width 2 * head_dim.
"""
try:
    from transformers import PreTrainedConfig  # transformers 5: a dataclass built from the fields below
    FIELDS_ARE_DATACLASS = True
except ImportError:  # transformers 4: fields are __init__ keywords, set by the __init__ below
    from transformers import PretrainedConfig as PreTrainedConfig
    FIELDS_ARE_DATACLASS = False

VARIANTS = ("diff", "dint", "shared_diff")


class MegadiffConfig(PreTrainedConfig):
    model_type = "megadiff"
    keys_to_ignore_at_inference = ["past_key_values"]

    variant: str = "diff"                   # diff | dint | shared_diff
    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5504
    num_hidden_layers: int = 24
    num_attention_heads: int = 8            # differential heads
    num_key_value_heads: int | None = None  # GQA key/value heads (each holds K1, K2 and a 2d-wide V)
    head_dim: int | None = None             # width d of one map
    lambda_init: str | float = "depth"      # "depth": 0.8 - 0.6 exp(-0.3 layer_idx), or a constant
    lambda_std: float = 0.1
    lowrank_rank: int = 0                   # Shared DIFF: rank of the four low-rank updates
    hidden_act: str = "silu"
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    layer_types: list[str] | None = None

    if not FIELDS_ARE_DATACLASS:
        def __init__(self, **kwargs):
            fields = {name: kwargs.pop(name, getattr(type(self), name)) for name in self.__annotations__}
            super().__init__(**kwargs)
            vars(self).update(fields)
            self.__post_init__()
            rope = self.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
            # 4.x's rotary embedding reads rope_theta and, for a non-default rope, rope_scaling
            self.rope_theta = rope["rope_theta"]
            self.rope_scaling = None if rope.get("rope_type", "default") == "default" else rope

    def __post_init__(self, **kwargs):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant == "shared_diff" and self.lowrank_rank < 1:
            raise ValueError("a Shared DIFF model needs lowrank_rank >= 1")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // (2 * self.num_attention_heads)
        if self.layer_types is None:
            # DINT carries a running sum across decoding steps: transformers' "hybrid" cache layer holds
            # it as a recurrent state next to the keys and values
            layer = "hybrid" if self.variant == "dint" else "full_attention"
            self.layer_types = [layer] * self.num_hidden_layers
        if FIELDS_ARE_DATACLASS:
            super().__post_init__(**kwargs)


__all__ = ["MegadiffConfig"]
