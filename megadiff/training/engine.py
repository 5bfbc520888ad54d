"""Model chunks wrapped for training: mixed precision, megatron DDP, the megatron optimizer.

Shared by `megadiff pretrain` and the parallel-parity tests, so what the tests
check is what training runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from megadiff.config import Config
from megadiff.config.validate import gradient_bucket_numel
from megadiff.models import MegadiffTransformerConfig, build_model, to_transformer_config
from megadiff.models.differential_attention import sum_partial_gradients
from megadiff.training.initial_weights import redraw_layout_invariant
from megadiff.training.multi_tensor import use_sync_free_fallbacks


@dataclass
class Engine:
    cfg: Config
    config: MegadiffTransformerConfig
    model: list            # DDP-wrapped chunks, one per virtual pipeline stage
    optimizer: object      # megatron MegatronOptimizer (ChainedOptimizer)

    def gather_updated_params(self) -> None:
        """Under parallel.overlap_param_gather the optimizer step leaves the all-gather of the
        updated weights to the next forward's pre-hooks, so each data-parallel rank holds its own
        shard updated and the rest one step old. Whatever reads weights before that forward (a
        checkpoint) gathers them first, as megatron's training loop does
        before saving; the next forward then finds them gathered. Collective."""
        if self.cfg.parallel.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def unwrapped(self) -> list:
        """The GPTModel chunks inside DDP / Float16Module."""
        return unwrap_model(self.model)


def _finalize_model_grads(model: list, *args, **kwargs) -> None:
    """megatron's, then the differential layers' tensor-parallel gradient sums (once per step)."""
    finalize_model_grads(model, *args, **kwargs)
    sum_partial_gradients(model)


def wrap_model(cfg: Config, config: MegadiffTransformerConfig, chunks: list) -> list:
    parallel = cfg.parallel
    # only the interleaved schedule dispatches each chunk's parameter all-gather (config.param_sync_func);
    # under the others megatron's forward pre-hooks prefetch the next bucket's, unless told the schedule
    # does (align_param_gather: then every bucket's gather waited in the forward, none overlapped).
    # megatron's own arguments turn align_param_gather off for the non-interleaved schedules
    schedule_gathers = parallel.overlap_param_gather and parallel.virtual_pipeline is not None
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        # megatron's default, given here: a checkpoint's optimizer_format records it (checkpoint.optimizer_format)
        bucket_size=gradient_bucket_numel(parallel, torch.distributed.get_world_size()),
        overlap_param_gather=parallel.overlap_param_gather,
        use_distributed_optimizer=parallel.distributed_optimizer,
        align_param_gather=schedule_gathers,
    )
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                       # megatron buckets only the first chunk when overlapping
                                       disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if parallel.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in wrapped]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    if schedule_gathers:
        sync = [chunk.start_param_sync for chunk in wrapped]
        config.param_sync_func = sync[0] if len(sync) == 1 else sync
    config.finalize_model_grads_func = _finalize_model_grads
    return wrapped


def build_optimizer(cfg: Config, config: MegadiffTransformerConfig, model: list):
    train = cfg.train
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model)
    use_sync_free_fallbacks()  # the gradient norm each step takes, read from the device at once
    # megatron builds every group with train.weight_decay and leaves the norms' and lambda's wd_mult of 0 to
    # its scheduler's first step: an engine stepped without one (the parity tests, bench) decayed them
    for group in optimizer.param_groups:
        group["weight_decay"] = train.weight_decay * group.get("wd_mult", 1.0)
    if config.bf16 or config.fp16:
        config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_engine(cfg: Config) -> Engine:
    """Model-parallel state must be initialised (megadiff.parallel.initialize)."""
    config = to_transformer_config(cfg)
    chunks = build_model(cfg, config)
    if cfg.train.layout_invariant_init:  # before wrapping: DDP's buffers and the optimizer copy these weights
        redraw_layout_invariant(chunks, config, cfg.train.seed)
    model = wrap_model(cfg, config, chunks)
    return Engine(cfg=cfg, config=config, model=model, optimizer=build_optimizer(cfg, config, model))
