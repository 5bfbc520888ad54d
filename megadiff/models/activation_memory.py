"""Activation memory per GPU from the config alone: the bytes autograd keeps for the backward pass
on the most loaded rank, summed tensor by tensor over what megadiff's layers save.

One layer saves, per token of the rank's sequence share (t = tensor-parallel size; widths on the
rank; under sequence parallelism the residual-stream tensors hold 1/t of the tokens):
  input and pre-MLP RMSNorm   their input + one fp32 rstd per row
  linear_qkv, fc1             their input (sequence-parallel: the shard, gathered again in backward)
  RoPE                        cos and sin for Q and for K (4 x d)
  core attention              Q, K, V; per map its output and log-sum-exp (the fused kernels');
                              DIFF/DINT: the head-wise RMSNorm's input (+ DINT's running mean)
  linear_proj                 its input
  SwiGLU MLP                  fc1's output (gate and up) and fc2's input: 3 x ffn (on CUDA, megatron's
                              fused SwiGLU; unfused it also keeps the SiLU and an offset up half)
and the last stage adds the final norm, the output layer's input and the fp32 softmax of the
cross entropy over the whole sequence's logits (s x V/t).

Recompute: "selective" keeps only Q, K, V of the core attention (megatron checkpoints it);
"full" keeps each layer's input and, in backward, one layer's activations at a time.
Pipeline: under 1F1B the first stage holds min(PP, micro-batches) micro-batches in flight
(interleaved: megatron's warm-up of (PP - 1) x 2 + (VP - 1) x PP model chunks, plus one).

On CUDA, torch's fused rms_norm saves its input and rstd; elsewhere its composite form keeps fp32
copies. Checked against the storages autograd holds on real gloo ranks (tests/test_memory.py), and
on a GPU for one layout.
Transients (the backward's activation gradients, the logits before the loss) are not included;
TransformerEngine's layers (model.transformer_impl=te) save about what the local ones do.
"""
from __future__ import annotations

from dataclasses import dataclass

from megadiff.config import (
    DIFFERENTIAL_VARIANTS, Config, micro_batches_per_step, padded_vocab_size, qkv_widths,
    resolved_ffn_hidden_size, resolved_head_dim, resolved_head_norm,
)
from megadiff.ops.common import triton_fits

FP32 = 4
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8 keeps bf16 activations between layers


class NotEstimated(Exception):
    """The layout saves what this accounting does not model (N x N attention maps)."""


@dataclass(frozen=True)
class ActivationMemory:
    per_layer: int         # bytes of one layer for one micro-batch on this rank
    layers: int            # layers held in flight on the most loaded rank (layers x micro-batches)
    output: int            # final norm, output layer input and loss (last stage)
    rebuilt: int           # full recompute: one layer's activations, rebuilt in backward after the loss's are freed

    @property
    def total(self) -> int:
        return self.per_layer * self.layers + max(self.output, self.rebuilt)


def rms_norm_bytes(width: int, rows: int, element: int, device: str) -> int:
    """torch fuses rms_norm on CUDA (input and rstd saved); elsewhere its composite form keeps fp32
    copies of the input and of the normalised rows."""
    if device == "cuda":
        return width * element + rows * FP32
    return 2 * width * FP32 + rows * FP32


@dataclass(frozen=True)
class _RankShare:
    """What one rank holds of one micro-batch."""
    element: int    # bytes per activation
    tokens: int     # its share of the sequence (context parallelism splits it), times the micro-batch
    stream: int     # residual-stream tokens: 1/TP of those under sequence parallelism
    kv_tokens: int  # tokens of K and V it attends to: the whole sequence under context parallelism

    @classmethod
    def of(cls, cfg: Config) -> "_RankShare":
        p = cfg.parallel
        micro_tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        tokens = micro_tokens // p.context
        return cls(ACTIVATION_BYTES[cfg.train.precision], tokens,
                   tokens // p.tensor if p.sequence_parallel else tokens, micro_tokens if p.context > 1 else tokens)


def _attention_core_bytes(cfg: Config, device: str, share: _RankShare) -> tuple[int, int, int]:
    """(Q, K, V as the core attention saves them, the same kept by megatron's checkpoint under
    selective recompute, everything else the core attention saves)."""
    m, t, element, tokens = cfg.model, cfg.parallel.tensor, share.element, share.tokens
    heads = m.num_attention_heads // t
    q_width, k_width, v_width = (width // t for width in qkv_widths(m))
    # megatron's V is a view of the fused QKV projection's output, whose storage autograd keeps whole;
    # the differential core attention saves a [.., 2d]-headed copy of V (gathered, with K, under CP)
    checkpointed = tokens * (2 * q_width + 2 * k_width + v_width) * element
    # under context parallelism the core attention saves its Q and the whole sequence's gathered K and V
    gathered = tokens * q_width * element + share.kv_tokens * (k_width + v_width) * element
    # model.head_norm's: its input (for softmax no longer a view linear_proj keeps) and statistics
    head_norm = rms_norm_bytes(q_width, heads, element, device) if resolved_head_norm(m) else 0
    if m.variant not in DIFFERENTIAL_VARIANTS:  # SDPA's log-sum-exp; its output is linear_proj's input (a view)
        saved = gathered if share.kv_tokens != tokens else checkpointed
        return saved, checkpointed, tokens * (heads * FP32 + head_norm)
    saved = gathered
    backend = m.attention_backend
    if backend == "auto":  # as ops.resolve_backend chooses: V's heads are 2d wide
        backend = "triton" if device == "cuda" and triton_fits(resolved_head_dim(m), 2 * resolved_head_dim(m)) \
            else "sdpa"
    if backend == "reference" or (backend == "sdpa" and device != "cuda"):
        raise NotEstimated(f"attention backend {backend!r} on {device} keeps the N x N maps")
    outputs = 2 * q_width * element                     # A1 V and A2 V, H x 2d each
    if backend == "triton":
        statistics = 2 * heads * FP32                   # one log-sum-exp per map
        combine = 0
    else:  # SDPA calls per map (two per map with split V), and the O2 that lambda * O2 keeps: an fp32 copy where
        # it runs eagerly (off CUDA), else (compiled) O2 itself, which split V concatenates from its halves
        statistics = (4 if backend == "sdpa_split_v" else 2) * heads * FP32
        if device != "cuda":
            combine = q_width * FP32
        else:
            combine = q_width * element if backend == "sdpa_split_v" else 0
    # DINT: lambda x running mean, and (eagerly) its divisors. The kernel's autograd Function takes the integral in
    # (without context parallelism, which continues it across chunks outside, eagerly) and saves nothing more for
    # it; the SDPA backends' combination takes it in, compiled on CUDA, which keeps the running mean alone
    integral = 0
    if m.variant == "dint" and (backend != "triton" or share.kv_tokens != tokens):
        compiled = device == "cuda" and share.kv_tokens == tokens
        integral = q_width * FP32 + (0 if compiled else FP32)
    return saved, checkpointed, tokens * (outputs + statistics + combine + integral + head_norm)


def _layer_bytes(cfg: Config, device: str, share: _RankShare) -> tuple[int, int]:
    """(one layer's saved bytes for one micro-batch, the same under selective recompute)."""
    m, t, element, stream = cfg.model, cfg.parallel.tensor, share.element, share.stream
    norms = 2 * stream * rms_norm_bytes(m.hidden_size, 1, element, device)
    linear_inputs = 2 * stream * m.hidden_size * element                # linear_qkv and fc1
    if m.variant == "shared_diff":  # the four low-rank up-projections' input: X A, gathered once under SP
        linear_inputs += share.tokens * 4 * m.lowrank_rank * element
    rope = share.tokens // cfg.train.micro_batch_size * 4 * resolved_head_dim(m) * element  # one per sequence
    qkv, checkpointed, core = _attention_core_bytes(cfg, device, share)
    proj = share.tokens * qkv_widths(m)[0] // t * element
    mlp = share.tokens * (3 if device == "cuda" else 5) * resolved_ffn_hidden_size(m) // t * element
    rest = norms + linear_inputs + rope + proj + mlp
    return rest + qkv + core, rest + checkpointed


def layers_in_flight(cfg: Config, world_size: int, stage: int) -> int:
    """Layers x micro-batches whose activations pipeline stage `stage` holds at its peak: 1F1B's
    warm-up forwards plus one (megatron's schedules), at most every micro-batch of the step."""
    p, micro_batches = cfg.parallel, micro_batches_per_step(cfg, world_size)
    chunks = p.virtual_pipeline or 1
    if chunks == 1:
        passes = min(p.pipeline - stage, micro_batches)
    else:
        passes = min((p.pipeline - stage - 1) * 2 + (chunks - 1) * p.pipeline + 1, micro_batches * chunks)
    return passes * (cfg.model.num_layers // (p.pipeline * chunks))


def activation_memory(cfg: Config, world_size: int, device: str = "cuda") -> ActivationMemory:
    """The most loaded rank's saved activations at its peak. The last stage adds the loss's
    tensors; under full recompute one rebuilt layer instead where that is larger, since the loss's
    are freed before any layer is rebuilt."""
    m, p, share = cfg.model, cfg.parallel, _RankShare.of(cfg)
    per_layer, selective = _layer_bytes(cfg, device, share)
    output = (share.stream * (rms_norm_bytes(m.hidden_size, 1, share.element, device) + m.hidden_size * share.element)
              + share.tokens * padded_vocab_size(m, p.tensor) // p.tensor * FP32)
    rebuilt = 0
    if cfg.train.recompute == "selective":
        per_layer = selective
    elif cfg.train.recompute == "full":
        layer_input = share.stream * m.hidden_size * share.element  # also the rebuilt layer's first saved tensor
        per_layer, rebuilt = layer_input, per_layer - layer_input
    stages = [ActivationMemory(per_layer, layers_in_flight(cfg, world_size, stage),
                               output if stage == p.pipeline - 1 else 0, rebuilt) for stage in range(p.pipeline)]
    return max(stages, key=lambda stage: stage.total)
