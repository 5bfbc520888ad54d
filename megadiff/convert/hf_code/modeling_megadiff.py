"""megadiff's differential-attention language models for Hugging Face transformers.

DIFF:        head = (A1 - lambda A2) V, A_m = softmax(Q_m K_m^T / sqrt(d)) (causal)
DINT:        head += lambda * mean over positions <= i of (A1 V)
Shared DIFF: Q_m = X (W_Q + A_qm B_qm^T), K_m = X (W_K + A_km B_km^T)
then every head goes through an RMSNorm over its 2d outputs (learned weight) and the
(1 - lambda_init) multiplier, with lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init.
The rest is Llama's (pre-RMSNorm, SwiGLU, RoPE), reused from transformers.

Weights follow DiffLlama's layout: q_proj rows are [Q1 of every head; Q2 of every head],
k_proj [K1; K2] per key/value head, v_proj [first half of every V; second half]. For
Shared DIFF, q_proj/k_proj are the shared W_Q/W_K and lowrank_down stacks the four A
factors (q1, q2, k1, k2). Generation uses transformers' cache: K/V per layer, plus for
DINT the running sum of A1 V as the "recurrent state" of a hybrid cache layer (in
transformers 4, whose cache layers have none, as an attribute of the layer).

Shipped into exported model directories by `megadiff convert to-hf`; imports only
torch and transformers.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.diffllama.modeling_diffllama import lambda_init_fn
from transformers.models.llama.modeling_llama import (
    LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb,
)
from transformers.utils import can_return_tuple

from .configuration_megadiff import MegadiffConfig

# transformers 4 and 5 differ in the helpers below: the feature checks sit here, not in the model code
try:  # transformers 5
    from transformers import initialization as init
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import capture_outputs

    def model_inputs(forward):
        """Fills use_cache etc. from the config and records hidden states (output_hidden_states)."""
        return merge_with_config_defaults(capture_outputs(forward))
except ImportError:  # transformers 4: one decorator did both, torch's init functions were used directly
    from torch.nn import init
    from transformers.utils.generic import check_model_inputs as model_inputs
# 5.x's cache layers hold a recurrent state (DINT's running sum); 4.x's hold only keys and values
CACHE_HAS_RECURRENT_STATES = hasattr(Cache, "update_recurrent_state")
if CACHE_HAS_RECURRENT_STATES:  # the layer a DINT cache gets from DynamicCache(config=...): keys, values, the sum
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer as RunningSumBaseLayer
else:  # 4.x: a plain dynamic layer, the sum an attribute of it
    from transformers.cache_utils import DynamicLayer as RunningSumBaseLayer

LOWRANK_UPDATES = ("q1", "q2", "k1", "k2")
CROP_REFUSAL = ("a DINT cache holds a running sum over every cached position, which cannot drop positions: "
                "decode the kept tokens again without this cache (or from a copy.deepcopy of it taken before the rest)")
STATIC_CACHE_REFUSAL = ("megadiff's modeling code takes the default dynamic cache, not a static one "
                        "(cache_implementation='static')")


def layer_lambda_init(config: MegadiffConfig, layer_idx: int) -> float:
    if config.lambda_init == "depth":
        return lambda_init_fn(layer_idx)  # DiffLlama's, whose layout the weights follow
    return float(config.lambda_init)


def attention_mask_4d(attention_mask, batch: int, query_len: int, past_len: int, device) -> torch.Tensor:
    """[B, 1, Nq, Nk] booleans: causal from the cached positions on, padding keys masked.

    A query always sees itself, so left-padding rows stay finite (their outputs are unused)."""
    query_pos = torch.arange(past_len, past_len + query_len, device=device)
    key_pos = torch.arange(past_len + query_len, device=device)
    allowed = (key_pos[None, :] <= query_pos[:, None])[None, None].expand(batch, 1, -1, -1)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed | (key_pos[None, :] == query_pos[:, None])[None, None]


def sdpa_masking(attention_mask, batch: int, query_len: int, past_len: int, device):
    """(attn_mask, is_causal) for SDPA. Without padding (attention_mask None) no [B, 1, Nq, Nk] mask is built
    (4 GiB of booleans per sequence at 64K, and one that keeps SDPA off its flash kernel): a prompt is causal
    from its first position, and one new token sees every cached one."""
    if attention_mask is None:
        if past_len == 0:
            return None, True
        if query_len == 1:
            return None, False
    return attention_mask_4d(attention_mask, batch, query_len, past_len, device), False


class RunningSumCacheLayer(RunningSumBaseLayer):
    """A DINT layer's cache. transformers' batch operations (batch_select_indices, batch_repeat_interleave, and 4.x's
    reorder_cache) move the keys and values alone, so rows read another row's running sum; and a crop left the sum
    counting the dropped positions. Here the sum follows the rows, and a crop that drops positions is refused."""

    def _select_running_sum_rows(self, rows) -> None:
        """Replaces the running sum, if any, by `rows` of it (a function of the [B, ...] tensor)."""
        if not CACHE_HAS_RECURRENT_STATES:
            if getattr(self, "megadiff_running_sum", None) is not None:
                self.megadiff_running_sum = rows(self.megadiff_running_sum)
        elif self.is_recurrent_states_initialized[0]:
            self.recurrent_states[0] = rows(self.recurrent_states[0])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if not CACHE_HAS_RECURRENT_STATES:  # 5.x's layer reorders its recurrent state itself
            self._select_running_sum_rows(lambda total: total.index_select(0, beam_idx.to(total.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_running_sum_rows(lambda total: total[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_running_sum_rows(lambda total: total.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Refused where it drops positions (4.x's argument: the length to keep; 5.x's: minus the positions to drop),
        else nothing to do."""
        length = self.get_seq_length()
        dropped = min(-tokens_to_remove, length) if tokens_to_remove < 0 else max(length - tokens_to_remove, 0)
        if dropped:
            raise ValueError(CROP_REFUSAL)


class MegadiffAttention(nn.Module):
    def __init__(self, config: MegadiffConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.integral = config.variant == "dint"
        self.shared = config.variant == "shared_diff"
        self.lambda_init = layer_lambda_init(config, layer_idx)
        hidden, d = config.hidden_size, self.head_dim
        maps = 1 if self.shared else 2  # Shared DIFF projects once and adds low-rank updates per map
        self.q_proj = nn.Linear(hidden, maps * self.heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, maps * self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, 2 * self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(2 * self.heads * d, hidden, bias=False)
        if self.shared:
            rank = config.lowrank_rank
            self.lowrank_down = nn.Linear(hidden, len(LOWRANK_UPDATES) * rank, bias=False)
            for name in LOWRANK_UPDATES:
                width = (self.heads if name.startswith("q") else self.kv_heads) * d
                setattr(self, f"lowrank_up_{name}", nn.Linear(rank, width, bias=False))
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.zeros(d, dtype=torch.float32)) for _ in range(4))
        self.head_norm = LlamaRMSNorm(2 * d, eps=config.rms_norm_eps)

    def _maps(self, x: torch.Tensor):
        """Q1, Q2 [B, h, N, d] and K1, K2 [B, kv, N, d]."""
        batch, seq = x.shape[:2]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.shared:
            down = self.lowrank_down(x).chunk(len(LOWRANK_UPDATES), dim=-1)
            up = {name: getattr(self, f"lowrank_up_{name}")(part) for name, part in zip(LOWRANK_UPDATES, down)}
            q = torch.cat([q + up["q1"], q + up["q2"]], dim=-1)
            k = torch.cat([k + up["k1"], k + up["k2"]], dim=-1)
        q = q.view(batch, seq, 2 * self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        return q[:, :self.heads], q[:, self.heads:], k[:, :self.kv_heads], k[:, self.kv_heads:]

    def _lambda(self) -> torch.Tensor:
        first = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
        second = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return first - second + self.lambda_init

    def _integral(self, first_map: torch.Tensor, attention_mask, past_key_values, past_len: int) -> torch.Tensor:
        """Running mean of A1 V over the (non-padding) positions up to each query, [B, h, N, 2d]."""
        batch, _, seq, _ = first_map.shape
        if attention_mask is not None:
            valid = attention_mask[:, -seq:].to(first_map.dtype)
            counts = attention_mask.to(first_map.dtype).cumsum(-1)[:, -seq:]
        else:
            valid = first_map.new_ones(batch, seq)
            counts = torch.arange(past_len + 1, past_len + seq + 1, device=first_map.device,
                                  dtype=first_map.dtype).expand(batch, -1)
        sums = (first_map * valid[:, None, :, None]).cumsum(dim=2)
        if past_key_values is not None:
            sums = self._add_cached_sum(sums, past_key_values.layers[self.layer_idx])
        return sums / counts.clamp(min=1)[:, None, :, None]

    @staticmethod
    def _add_cached_sum(sums: torch.Tensor, layer) -> torch.Tensor:
        """sums plus the cached sum of earlier steps; caches the new total."""
        if type(layer) is RunningSumBaseLayer:  # as DynamicCache built it (by generate() or the user), the sum left
            layer.__class__ = RunningSumCacheLayer  # out of its row operations: now one whose operations carry it
        if CACHE_HAS_RECURRENT_STATES:
            if not hasattr(layer, "update_recurrent_state"):
                raise TypeError("DINT needs a cache with a recurrent state per layer: pass "
                                "DynamicCache(config=model.config) (what generate() builds), not DynamicCache()")
            if layer.is_recurrent_states_initialized[0]:
                sums = sums + layer.recurrent_states[0][:, :, None, :]
            layer.update_recurrent_state(sums[:, :, -1].contiguous(), state_idx=0)
            return sums
        # transformers 4: the sum rides on the cache layer (beam search reorders it: _reorder_cache)
        if getattr(layer, "megadiff_running_sum", None) is not None:
            sums = sums + layer.megadiff_running_sum[:, :, None, :]
        layer.megadiff_running_sum = sums[:, :, -1].contiguous()
        return sums

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        batch, seq = hidden_states.shape[:2]
        d = self.head_dim
        q1, q2, k1, k2 = self._maps(hidden_states)
        cos, sin = position_embeddings
        q1, k1 = apply_rotary_pos_emb(q1, k1, cos, sin)
        q2, k2 = apply_rotary_pos_emb(q2, k2, cos, sin)
        # V of key/value head j is [first half j | second half j], width 2d
        v = self.v_proj(hidden_states).view(batch, seq, 2, self.kv_heads, d).permute(0, 3, 1, 2, 4)
        v = v.reshape(batch, self.kv_heads, seq, 2 * d)
        past_len = 0
        if past_key_values is not None:
            past_len = past_key_values.get_seq_length(self.layer_idx)
            keys, v = past_key_values.update(torch.cat([k1, k2], dim=1), v, self.layer_idx)
            k1, k2 = keys[:, :self.kv_heads], keys[:, self.kv_heads:]
        group = self.heads // self.kv_heads
        k1, k2, v = (t.repeat_interleave(group, dim=1) for t in (k1, k2, v))
        mask, causal = sdpa_masking(attention_mask, batch, seq, past_len, hidden_states.device)
        scale = 1.0 / math.sqrt(d)
        first = F.scaled_dot_product_attention(q1, k1, v, attn_mask=mask, is_causal=causal, scale=scale)
        second = F.scaled_dot_product_attention(q2, k2, v, attn_mask=mask, is_causal=causal, scale=scale)
        lam = self._lambda()
        out = first.float() - lam * second.float()
        if self.integral:
            out = out + lam * self._integral(first.float(), attention_mask, past_key_values, past_len)
        out = self.head_norm(out.to(hidden_states.dtype)) * (1.0 - self.lambda_init)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, 2 * self.heads * d))


class MegadiffDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MegadiffConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MegadiffAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                                       attention_mask, past_key_values)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MegadiffPreTrainedModel(PreTrainedModel):
    config_class = MegadiffConfig
    config: MegadiffConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # the attention always runs SDPA, whatever attn_implementation says
    _no_split_modules = ["MegadiffDecoderLayer"]
    _can_record_outputs = {"hidden_states": MegadiffDecoderLayer}

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MegadiffAttention):
            for vector in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2):
                init.normal_(vector, 0.0, self.config.lambda_std)


class MegadiffModel(MegadiffPreTrainedModel):
    def __init__(self, config: MegadiffConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MegadiffDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False  # merge_with_config_defaults builds no cache while checkpointing
        self.post_init()

    @model_inputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if kwargs.get("output_attentions", self.config.output_attentions):
            raise ValueError("megadiff's differential attention runs in SDPA, which returns no attention weights: "
                             "output_attentions is not supported")
        if isinstance(attention_mask, dict) or isinstance(past_key_values, StaticCache):
            raise ValueError(STATIC_CACHE_REFUSAL)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a [batch, past + new tokens] padding mask")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: read back from the GPU once here, not in every layer
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            # the cache by keyword: checkpointing drops it, or the recompute would append to it twice
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)


class MegadiffForCausalLM(MegadiffPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegadiffConfig):
        super().__init__(config)
        self.model = MegadiffModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # DINT's running sum cannot be rolled back to fewer tokens: generate() refuses assisted decoding
        self._is_stateful = config.variant == "dint"
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        """Refuses the static caches before generate() builds one: transformers 4 would fail building it for
        DINT (no static layer for its "hybrid" layer type) or on its deprecated "hybrid" name, not say why."""
        if generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            raise ValueError(STATIC_CACHE_REFUSAL)
        return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states)


__all__ = ["MegadiffForCausalLM", "MegadiffModel", "MegadiffPreTrainedModel"]
