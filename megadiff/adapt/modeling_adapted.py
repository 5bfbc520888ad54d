"""Dex and DAA attention for transformers' Llama, Qwen2 and Mistral, and the model classes that load
an adapted checkpoint with `trust_remote_code=True`.

This file is copied verbatim next to exported weights, so it imports only torch and transformers.

An adapted attention module is the pretrained attention module itself (same projections, same
rotary embedding, same attention interface, same KV cache), with its class swapped for a subclass
that adds the adapter parameters and the differential step (megadiff docs/SPEC.md, sections 4-6):

- dex:    O = softmax(s Q K^T) V;  O' = O - lambda(t) O W_D          (per selected head, W_D: d x d)
- daa:    O' = (softmax(s Q K^T) - lambda(t) softmax(s (Q W_DAA) K^T)) V   (per selected head; W_DAA
          acts on the query before RoPE, so that both maps' scores depend on relative positions only;
          adaptations planned without `daa_weight_before_rope` apply it after, as megadiff once did)
- diff_q: second map from Q2 = q_proj(X W), diff_k: from K2 = k_proj(X W) (W: D x D per layer)
- diff_v: O' = A (V1 - lambda(t) V2), V2 = v_proj(X W)

with lambda(t) = (1 - a) (t / T) lambda_init + a lambda_learn, a = min(1, t / T). The adapter
matrices start at the identity and lambda_learn at ~0, so at t = 0 the module computes exactly
what the pretrained one did.

`config.adaptation` (a plain dict, saved in config.json) holds everything needed to rebuild the
adapted modules: method, T, the step t the weights were saved at, and per layer the adapted heads
and lambda_init.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.mistral import modeling_mistral
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config

METHODS = ("dex", "daa", "diff_q", "diff_k", "diff_v")
# methods whose extra matrix acts on the layer input (one D x D matrix, all heads)
INPUT_METHODS = ("diff_q", "diff_k", "diff_v")


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32 where it is in a lower precision (bf16, fp16), else as it is (an fp64 check stays fp64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def annealed_lambda(step: float, anneal_steps: int, lambda_init: float, lambda_learn):
    """Dex eq. 4: lambda(t) = (1 - alpha) (t / T) lambda_init + alpha lambda_learn, alpha = min(1, t / T).
    T = 0 means no annealing (lambda = lambda_learn)."""
    if anneal_steps == 0:
        return lambda_learn * 1.0
    ramp = step / anneal_steps
    alpha = min(1.0, ramp)
    return (1.0 - alpha) * ramp * lambda_init + alpha * lambda_learn


class AdaptedAttention(nn.Module):
    """Mixin placed before an architecture's attention class. `_rotary` and `_eager` are that
    architecture's own rotary-embedding and eager-attention functions."""

    _rotary = None
    _eager = None

    def init_adapter(self, method: str, heads: list[int], lambda_init: float, anneal_steps: int,
                     lambda_learn_init: float = 0.0, daa_weight_before_rope: bool = True) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown adaptation method {method!r}; expected one of {METHODS}")
        num_heads = self.config.num_attention_heads
        if method in INPUT_METHODS and sorted(heads) != list(range(num_heads)):
            raise ValueError(f"{method} acts on whole layers: every head must be adapted")
        weight = self.q_proj.weight
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.adapter_method = method
        self.adapter_heads = sorted(int(h) for h in heads)
        self.lambda_init = float(lambda_init)
        self.anneal_steps = int(anneal_steps)
        self.daa_weight_before_rope = daa_weight_before_rope
        self.step = 0
        self.last_lambda = None
        # shape [1], not a 0-dim scalar: DeepSpeed broadcasts parameters as byte views
        self.lambda_learn = nn.Parameter(torch.full((1,), float(lambda_learn_init), **factory))
        eye = torch.eye(self.head_dim, **factory)
        if method == "dex":
            self.dex_weight = nn.Parameter(eye.repeat(len(self.adapter_heads), 1, 1))
        elif method == "daa":
            self.daa_weight = nn.Parameter(eye.repeat(len(self.adapter_heads), 1, 1))
        else:
            self.input_weight = nn.Parameter(torch.eye(self.config.hidden_size, **factory))

    def current_lambda(self) -> torch.Tensor:
        """lambda(t) in fp32, as the differential layers compute theirs: in a bf16 model's dtype lambda_init's ramp
        was rounded to bf16's 8 bits, a staircase (311 values over 1000 annealing steps, up to 0.7% off)."""
        lam = annealed_lambda(self.step, self.anneal_steps, self.lambda_init, at_least_fp32(self.lambda_learn))
        self.last_lambda = lam.detach()
        return lam

    def _project(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, heads, N, head_dim]"""
        return proj(x).view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return type(self)._rotary(x, x, cos, sin)[0]

    def _head_index(self, device: torch.device) -> torch.Tensor:
        # built on first use on a device (a buffer would be left on the meta device by from_pretrained) and
        # kept: each host-to-GPU copy waits for the GPU's queue, and a forward needs it 1-3 times a layer
        index = self.__dict__.get("_adapter_head_index")
        if index is None or index.device != torch.device(device):
            index = torch.tensor(self.adapter_heads, dtype=torch.long).to(device)
            self.__dict__["_adapter_head_index"] = index
        return index

    def _subtract_on_heads(self, first, second, lam, dim: int):
        """first - lam * second on the adapted heads (tensor dim `dim`), first elsewhere; in fp32 (lam's dtype), rounded
        once: the two maps' outputs cancel where they are alike."""
        if first is None or second is None:
            return first
        index = self._head_index(first.device)
        adapted = first.index_select(dim, index) - lam * second.index_select(dim, index)
        return first.index_copy(dim, index, adapted.to(first.dtype))

    def _attention_function(self):
        """The attention function the config names (transformers 4.x has no get_interface: an export loads
        there too, as evaluation stacks pinning 4.x load it)."""
        implementation = self.config._attn_implementation
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, type(self)._eager)
        return type(self)._eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]

    def _sliding_window(self):
        """The window the architecture's own attention passes its attention function (flash attention reads it):
        Qwen2's per layer (transformers 4.x before layer_types: the config's), Mistral's the config's."""
        return getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))

    def _attend(self, query, key, value, attention_mask, **kwargs):
        return self._attention_function()(self, query, key, value, attention_mask,
                                          dropout=0.0 if not self.training else self.attention_dropout,
                                          scaling=self.scaling, sliding_window=self._sliding_window(), **kwargs)

    def _cached_two_keys(self, past_key_values, key, key2, value, cache_kwargs):
        """diff_k's two key maps and its value through the cache: the second key's first half rides beside the key,
        its second half beside the value, so both entries have one width (transformers 4's static cache sizes
        its values by the keys it is first given). Returns the cached key, second key and value."""
        half = self.head_dim // 2
        keys, values = past_key_values.update(torch.cat([key, key2[..., :half]], dim=-1),
                                              torch.cat([value, key2[..., half:]], dim=-1), self.layer_idx,
                                              cache_kwargs)
        value_width = value.shape[-1]
        second_key = torch.cat([keys[..., self.head_dim:], values[..., value_width:]], dim=-1)
        return keys[..., :self.head_dim], second_key, values[..., :value_width]

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        method = self.adapter_method
        lam = self.current_lambda()
        cos, sin = position_embeddings
        unrotated_query = self._project(self.q_proj, hidden_states)
        query, key = type(self)._rotary(unrotated_query, self._project(self.k_proj, hidden_states), cos, sin)
        value = self._project(self.v_proj, hidden_states)
        if method in INPUT_METHODS:
            shifted = hidden_states @ self.input_weight
        if method == "diff_q":
            query2 = self._rotate(self._project(self.q_proj, shifted), cos, sin)
        elif method == "diff_k":
            key2 = self._rotate(self._project(self.k_proj, shifted), cos, sin)
        elif method == "diff_v":
            # lambda is fixed during generation, so the cache can hold V1 - lambda V2 itself
            value = (value - lam * self._project(self.v_proj, shifted)).to(value.dtype)

        if past_key_values is not None:
            # transformers 4's static cache writes at cache_position, and without it over the first positions
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            if method == "diff_k":
                key, key2, value = self._cached_two_keys(past_key_values, key, key2, value, cache_kwargs)
            else:
                key, value = past_key_values.update(key, value, self.layer_idx, cache_kwargs)

        output, weights = self._attend(query, key, value, attention_mask, **kwargs)  # output [B, N, H, d]
        if method == "dex":
            index = self._head_index(output.device)
            selected = output.index_select(2, index)
            # in fp32, rounded once: O and lambda O W_D cancel (W_D starts at the identity, lambda grows to ~0.8)
            delta = torch.einsum("bnhd,hde->bnhe", *map(at_least_fp32, (selected, self.dex_weight)))
            output = output.index_copy(2, index, (selected - lam * delta).to(output.dtype))
        elif method != "diff_v":
            if method == "daa":
                index = self._head_index(query.device)
                if self.daa_weight_before_rope:  # the second map's scores stay relative to position, as the first's
                    transformed = torch.einsum("bhnd,hde->bhne", unrotated_query.index_select(1, index),
                                               self.daa_weight)
                    transformed = self._rotate(transformed, cos, sin)
                else:  # adaptations planned before megadiff recorded the setting: on the rotated query
                    transformed = torch.einsum("bhnd,hde->bhne", query.index_select(1, index), self.daa_weight)
                query2 = query.index_copy(1, index, transformed.to(query.dtype))
            elif method == "diff_k":
                query2 = query
            second, weights2 = self._attend(query2, key2 if method == "diff_k" else key, value, attention_mask,
                                            **kwargs)
            output = self._subtract_on_heads(output, second, lam, dim=2)
            weights = self._subtract_on_heads(weights, weights2, lam, dim=1)

        output = output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(output), weights


class AdaptedLlamaAttention(AdaptedAttention, modeling_llama.LlamaAttention):
    _rotary = staticmethod(modeling_llama.apply_rotary_pos_emb)
    _eager = staticmethod(modeling_llama.eager_attention_forward)

    def _sliding_window(self):
        # none, as Llama's attention passes: LlamaConfig keeps a window its config.json names (carried over from
        # another architecture's), and passed on, it cut the adapted attention to it under flash attention
        return None


class AdaptedQwen2Attention(AdaptedAttention, modeling_qwen2.Qwen2Attention):
    _rotary = staticmethod(modeling_qwen2.apply_rotary_pos_emb)
    _eager = staticmethod(modeling_qwen2.eager_attention_forward)


class AdaptedMistralAttention(AdaptedAttention, modeling_mistral.MistralAttention):
    _rotary = staticmethod(modeling_mistral.apply_rotary_pos_emb)
    _eager = staticmethod(modeling_mistral.eager_attention_forward)


ADAPTED_ATTENTION = {
    modeling_llama.LlamaAttention: AdaptedLlamaAttention,
    modeling_qwen2.Qwen2Attention: AdaptedQwen2Attention,
    modeling_mistral.MistralAttention: AdaptedMistralAttention,
}


def install_adapters(model: nn.Module, adaptation: dict) -> None:
    """Turn each decoder layer's attention into its adapted form, as `adaptation` describes.
    The module object stays (its projections, hooks and parameter names are kept); its class
    becomes the adapted subclass."""
    layers = model.get_decoder().layers  # a causal LM's decoder, or the base model itself (AutoModel)
    if len(adaptation["layers"]) != len(layers):
        raise ValueError(f"adaptation describes {len(adaptation['layers'])} layers, the model has {len(layers)}")
    for layer, spec in zip(layers, adaptation["layers"]):
        attention = layer.self_attn
        attention.__class__ = ADAPTED_ATTENTION[type(attention)]
        attention.init_adapter(adaptation["method"], spec["heads"], spec["lambda_init"], adaptation["anneal_steps"],
                               adaptation.get("lambda_learn_init", 0.0),
                               adaptation.get("daa_weight_before_rope", False))
        attention.step = adaptation.get("step", 0)


def describe_adapters(model: nn.Module) -> dict:
    """The inverse of install_adapters: the `adaptation` dict of an adapted model as it is now."""
    attentions = [layer.self_attn for layer in model.get_decoder().layers]
    if not all(isinstance(a, AdaptedAttention) for a in attentions):
        raise ValueError(f"{type(model).__name__} has attention layers without Dex/DAA adapters")
    first = attentions[0]
    return {"method": first.adapter_method, "anneal_steps": first.anneal_steps, "step": first.step,
            "daa_weight_before_rope": first.daa_weight_before_rope,
            "layers": [{"heads": list(a.adapter_heads), "lambda_init": a.lambda_init} for a in attentions]}


class _AdaptedModel:
    """Builds the stock model (a causal LM, or its base model for AutoModel), then adapts its attention layers
    from `config.adaptation`."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        install_adapters(self, config.adaptation)

    def set_adaptation_step(self, step: int) -> None:
        """The annealing step t of lambda(t), to train on in plain transformers (megadiff's loop sets it every
        optimizer step: t = the steps done)."""
        for layer in self.get_decoder().layers:
            layer.self_attn.step = step

    def save_pretrained(self, *args, **kwargs):
        # the adapters as they are now: the step was read from the config when the model was built, and a
        # copy saved after more annealing had reloaded at the old step
        self.config.adaptation = describe_adapters(self)
        return super().save_pretrained(*args, **kwargs)


class AdaptedLlamaConfig(LlamaConfig):
    model_type = "megadiff_adapted_llama"


class AdaptedQwen2Config(Qwen2Config):
    model_type = "megadiff_adapted_qwen2"


class AdaptedMistralConfig(MistralConfig):
    model_type = "megadiff_adapted_mistral"


class AdaptedLlamaForCausalLM(_AdaptedModel, modeling_llama.LlamaForCausalLM):
    config_class = AdaptedLlamaConfig


class AdaptedQwen2ForCausalLM(_AdaptedModel, modeling_qwen2.Qwen2ForCausalLM):
    config_class = AdaptedQwen2Config


class AdaptedMistralForCausalLM(_AdaptedModel, modeling_mistral.MistralForCausalLM):
    config_class = AdaptedMistralConfig


class AdaptedLlamaModel(_AdaptedModel, modeling_llama.LlamaModel):
    config_class = AdaptedLlamaConfig


class AdaptedQwen2Model(_AdaptedModel, modeling_qwen2.Qwen2Model):
    config_class = AdaptedQwen2Config


class AdaptedMistralModel(_AdaptedModel, modeling_mistral.MistralModel):
    config_class = AdaptedMistralConfig


# base causal-LM class -> (adapted config class, adapted causal-LM class, adapted base model class), for export
EXPORT_CLASSES = {
    modeling_llama.LlamaForCausalLM: (AdaptedLlamaConfig, AdaptedLlamaForCausalLM, AdaptedLlamaModel),
    modeling_qwen2.Qwen2ForCausalLM: (AdaptedQwen2Config, AdaptedQwen2ForCausalLM, AdaptedQwen2Model),
    modeling_mistral.MistralForCausalLM: (AdaptedMistralConfig, AdaptedMistralForCausalLM, AdaptedMistralModel),
}
