"""Pure-PyTorch (+ Triton) differential-attention ops. Knows nothing about megatron."""
from megadiff.ops.dispatch import BACKENDS, differential_attention, paired_differential_attention, resolve_backend
from megadiff.ops.incremental import IntegralCarry
from megadiff.ops.lambdas import depth_lambda_init, reparameterized_lambda
from megadiff.ops.reference import differential_attention_reference
from megadiff.ops.sdpa import SDPA_KERNELS, differential_attention_sdpa, sdpa_kernel_order, softmax_attention

__all__ = [
    "BACKENDS",
    "IntegralCarry",
    "SDPA_KERNELS",
    "differential_attention",
    "differential_attention_reference",
    "differential_attention_sdpa",
    "depth_lambda_init",
    "paired_differential_attention",
    "reparameterized_lambda",
    "resolve_backend",
    "sdpa_kernel_order",
    "softmax_attention",
]
