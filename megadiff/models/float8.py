"""Torch-native float8 training for the local layers (`train.precision=fp8`, `train.fp8_backend=torchao`).

The transformer layers' column- and row-parallel linears (QKV, attention output, MLP fc1/fc2) run
their three matmuls in float8 with dynamic tensorwise scaling, through torchao's float8 training
function (torchao.float8.float8_linear.matmul_with_hp_or_float8_args):
    forward      Y  = X W^T    e4m3 x e4m3
    input grad   dX = dY W     e5m2 x e4m3
    weight grad  dW = dY^T X   e5m2 x e4m3
with one scale per tensor (amax of this rank's shard), fp32 accumulation and outputs in the input
dtype. The embedding and the output layer stay in BF16: GPTModel builds them outside the layer spec.

Tensor parallelism stays megatron's: these classes only replace the local matmul that megatron's
ColumnParallelLinear/RowParallelLinear delegate to `_forward_impl`
(linear_with_grad_accumulation_and_async_allreduce). The column-parallel layer's communication is
done with megatron's own mappings (all-gather of a sequence-parallel input, reduce-scatter or
all-reduce of the input gradient); the row-parallel reduction stays in RowParallelLinear.forward.

On CUDA the matmuls are torch._scaled_mm (compute capability >= 8.9) and the amax/scale/cast steps
are compiled with torch.compile so they fuse (MEGADIFF_FLOAT8_EAGER=1 turns that off). On other
devices torchao's emulation casts to float8 and back and multiplies in fp32: the same numerics,
slowly, which is how the CPU tests check this module.
"""
from __future__ import annotations

import functools
import os

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
)

MIN_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper and later
SCALED_MM_ALIGNMENT = 16      # torch._scaled_mm needs every matmul dimension to be a multiple of 16


@functools.cache
def _torchao_recipe(emulate: bool):
    """(Float8LinearConfig, LinearMMConfig) of torchao's tensorwise recipe."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig(emulate=emulate)  # the default recipe: dynamic tensorwise scaling
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                                 for gemm in gemms))
    return config, mm_config


@functools.cache
def _matmul(emulate: bool):
    """x [..., K], weight [N, K] -> x W^T in float8; compiled on CUDA."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm_config = _torchao_recipe(emulate)

    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)

    if emulate or os.environ.get("MEGADIFF_FLOAT8_EAGER") == "1":
        return matmul
    return torch.compile(matmul, dynamic=False)


def float8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T with the float8 recipe above; emulated unless x is on CUDA."""
    emulate = not x.is_cuda
    if not emulate:
        tokens = x.numel() // x.shape[-1]
        if tokens % SCALED_MM_ALIGNMENT:
            raise ValueError(f"float8 matmuls need the tokens of a micro-batch on a rank ({tokens}) to be a "
                             f"multiple of {SCALED_MM_ALIGNMENT}: change model.seq_length or train.micro_batch_size")
    return _matmul(emulate)(x, weight)


def float8_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                  grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None):
    """Drop-in for megatron's linear_with_grad_accumulation_and_async_allreduce (same arguments)."""
    if gradient_accumulation_fusion:
        raise NotImplementedError("float8 linears do not fuse gradient accumulation; megadiff turns it off")
    if grad_output_buffer is not None:
        raise NotImplementedError("deferred weight gradients (an output-layer option) are not supported in float8")
    if sequence_parallel:  # backward: reduce-scatter of the input gradient
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:  # backward: all-reduce of the input gradient
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    output = float8_matmul(input, weight)
    return output if bias is None else output + bias


def check_float8_layer(weight: torch.Tensor) -> None:
    """Refuse, at build time, what the float8 matmuls cannot run on this machine."""
    if not torch.cuda.is_available():
        return  # emulated
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CUDA_CAPABILITY:
        raise RuntimeError(f"train.fp8_backend=torchao needs float8 tensor cores (compute capability >= "
                           f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}); this GPU has "
                           f"{capability[0]}.{capability[1]}. Use train.precision=bf16")
    if any(size % SCALED_MM_ALIGNMENT for size in weight.shape):
        raise ValueError(f"float8 linear layers need per-rank widths that are multiples of {SCALED_MM_ALIGNMENT}, "
                         f"got a weight of {tuple(weight.shape)}: adjust model.hidden_size, head counts, "
                         "model.ffn_hidden_size or parallel.tensor")


class _Float8Matmuls:
    """Mixin for megatron's parallel linears: float8 in place of their local matmul."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.weight is not None:
            check_float8_layer(self.weight)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return float8_linear(input, weight, *args, **kwargs)


class Float8ColumnParallelLinear(_Float8Matmuls, ColumnParallelLinear):
    """megatron's ColumnParallelLinear with float8 matmuls."""


class Float8RowParallelLinear(_Float8Matmuls, RowParallelLinear):
    """megatron's RowParallelLinear with float8 matmuls."""


FLOAT8_REPLACEMENTS = {ColumnParallelLinear: Float8ColumnParallelLinear, RowParallelLinear: Float8RowParallelLinear}


def use_float8_linears(layer) -> None:
    """In a TransformerLayer spec's submodules, swap megatron's parallel linears for the float8 ones.

    Other modules (e.g. Shared DIFF's QKV projection) are left as they are.
    """
    attention, mlp = layer.self_attention.submodules, layer.mlp.submodules
    for owner, name in ((attention, "linear_qkv"), (attention, "linear_proj"), (mlp, "linear_fc1"),
                        (mlp, "linear_fc2")):
        module = getattr(owner, name)
        setattr(owner, name, FLOAT8_REPLACEMENTS.get(module, module))
