"""Pure-PyTorch (+ Triton) differential-attention ops. Knows nothing about megatron."""
from megadiff.ops.dispatch import BACKENDS, differential_attention, paired_differential_attention, resolve_backend
from megadiff.ops.incremental import IntegralCarry
from megadiff.ops.lambdas import depth_lambda_init, reparameterized_lambda
from megadiff.ops.reference import differential_attention_reference
from megadiff.ops.sdpa import differential_attention_sdpa, softmax_attention

__all__ = [
    "BACKENDS",
    "IntegralCarry",
    "differential_attention",
    "differential_attention_reference",
    "differential_attention_sdpa",
    "depth_lambda_init",
    "paired_differential_attention",
    "reparameterized_lambda",
    "resolve_backend",
    "softmax_attention",
]
