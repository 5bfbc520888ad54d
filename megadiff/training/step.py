"""One optimizer step through megatron's pipeline schedules (1F1B, interleaved or none)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from megadiff.models.documents import document_packing
from megadiff.parallel import compute_device
from megadiff.rank_agreement import ranks_where
from megadiff.training.engine import Engine
from megadiff.training.spikes import SpikeGuard


def masked_mean_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """megatron loss_func: mean token loss of one micro-batch over its whole sequence.

    Under context parallelism each rank holds part of the sequence: the value is the
    full-sequence mean, while the gradient flows through this rank's tokens only (the
    schedule then scales by the CP size and DDP averages over DP x CP).
    """
    mask = loss_mask.reshape(-1).float()
    local_sum = torch.sum(per_token_loss.float().reshape(-1) * mask)
    totals = torch.stack([local_sum.detach(), mask.sum()])
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    loss = (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1.0)
    # clone: the schedule scales the returned loss in place by 1/num_microbatches. This rank's own tokens: summed
    # over the data- and context-parallel ranks, they say whether the global batch held any
    return loss, {"lm_loss": loss.detach().clone(), "loss_tokens": mask.sum()}


def masked_loss_sum(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """megatron loss_func under calculate_per_token_loss (train.per_token_loss): this rank's summed
    token loss and its token count. megatron adds the counts over micro-batches and DP x CP ranks
    and divides the gradients by the total; the reported mean divides the summed sums alike."""
    mask = loss_mask.reshape(-1).float()
    local_sum, tokens = torch.sum(per_token_loss.float().reshape(-1) * mask), mask.sum()
    return local_sum, tokens.to(torch.int), {"lm_loss": torch.stack([local_sum.detach(), tokens])}


def forward_step(data_iterator: Iterator, model, *, summed: bool | None = None):
    """megatron forward_step_func: every stage reads the batch; the first uses tokens, the last labels,
    every layer the document boundaries when the batch has them (data.document_masking). `summed` (default:
    train.per_token_loss, the model config's) returns the loss as masked_loss_sum's (sum, tokens)."""
    batch = dict(next(data_iterator))  # a copy: the interleaved schedule gives every model chunk the same dict
    # the documents of the whole sequences: each context-parallel rank attends from its chunks to them all
    documents = document_packing(batch.pop("cu_seqlens", None), batch["tokens"].shape[1])
    batch = get_batch_on_this_cp_rank(batch)  # identity without context parallelism
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           packed_seq_params=documents)
    if summed is None:
        summed = model.config.calculate_per_token_loss
    loss_func = masked_loss_sum if summed else masked_mean_loss
    return per_token_loss, partial(loss_func, batch["loss_mask"])


@dataclass
class StepResult:
    loss: float | None          # mean over micro-batches and data-parallel ranks, same on every rank; None: no
    #                             loss tokens in the global batch (every target masked), whose step is not applied
    grad_norm: float | None     # None where none was taken (a non-finite loss, an fp16 overflow)
    updated: bool               # False when the step was skipped (non-finite loss or gradients, or a spike)
    spike: bool = False         # skipped by the spike guard
    overflow: bool = False      # skipped by fp16's loss scaler, which lowered the scale
    # with a non-finite loss: "rank R (host)" of each rank whose own micro-batches' loss was not finite
    non_finite_ranks: list[str] = field(default_factory=list)

    @property
    def no_loss_tokens(self) -> bool:
        return self.loss is None


def _token_totals(reduced: list[dict], like: torch.Tensor) -> torch.Tensor:
    """On the last pipeline stage: masked_loss_sum's (sum, tokens) pairs summed over micro-batches and DP x CP."""
    totals = torch.stack([item["lm_loss"] for item in reduced]).sum(0).to(like)
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return totals


def _from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """`value` (the last pipeline stage's) on every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(value, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return value


def _mean_loss_on_every_rank(reduced: list[dict], num_microbatches: int, per_token: bool) -> float | None:
    """The schedules return losses on the last pipeline stage only: average over DP, send to all stages.
    `per_token` losses come as (sum, tokens) pairs: their sums' ratio over the whole global batch. None where
    the global batch holds no loss tokens: its mean is no loss of 0 (the masked count, clamped, made it one)."""
    value = torch.zeros(2, dtype=torch.float64, device=compute_device())  # NCCL reduces CUDA tensors only
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        if per_token:
            totals = _token_totals(reduced, value)
            value[0], value[1] = totals[0] / totals[1].clamp(min=1.0), totals[1]
        else:
            # summed where they are: a float() each would wait on the device once per micro-batch
            value[0] = torch.stack([item["lm_loss"] for item in reduced]).to(value).sum() / num_microbatches
            value[1] = torch.stack([item["loss_tokens"] for item in reduced]).to(value).sum()
            dist.all_reduce(value, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            value[0] /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    loss, tokens = _from_last_stage(value).tolist()
    return loss if tokens > 0 else None


def _ranks_with_non_finite_losses(reduced: list[dict]) -> list[str]:
    """Which ranks' own losses (before the data-parallel mean every rank holds) were not finite. Collective
    over the world, so only taken where the mean is not finite, which every rank then knows."""
    return ranks_where(any(not torch.isfinite(item["lm_loss"]).all() for item in reduced))  # the last stage's


def _forward_backward(engine: Engine, data_iterator, num_microbatches: int, forward_only: bool,
                      summed: bool | None = None) -> list[dict]:
    """The schedule's run: this rank's losses of each micro-batch (on the last pipeline stage; none elsewhere);
    `summed`: forward_step's."""
    cfg = engine.cfg
    step_func = forward_step if summed is None else partial(forward_step, summed=summed)
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    return get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=iterators if len(engine.model) > 1 else iterators[0],
        model=engine.model,
        num_microbatches=num_microbatches,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size,
        forward_only=forward_only,
    )


@torch.no_grad()  # megatron's forward-only schedules leave autograd on: each forward would keep its activations
def validation_sums(engine: Engine, data_iterator, num_microbatches: int) -> torch.Tensor:
    """Forward only: the summed loss of one global batch's loss tokens and their count, [sum, tokens] in float64
    on every rank. Validation means over tokens (as Megatron-LM's evaluate), whatever train.per_token_loss says:
    a mean of micro-batch means weighs the tokens of a micro-batch with few loss tokens (prompt/response data,
    data.eod_mask_loss) more, so the curve depended on the micro-batch size and the data-parallel layout and
    differed from `megadiff evaluate`'s mean of the same samples."""
    reduced = _forward_backward(engine, data_iterator, num_microbatches, forward_only=True, summed=True)
    totals = torch.zeros(2, dtype=torch.float64, device=compute_device())  # NCCL reduces CUDA tensors only
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = _token_totals(reduced, totals)
    return _from_last_stage(totals)


def _clip_gradients(optimizer, grad_norm: float) -> None:
    """Scale the main gradients down to train.clip_grad by the global norm already taken, as megatron's
    step clips each (chained) optimizer's parameters by the one norm it takes itself."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        config = inner.config
        parameters = [] if config.clip_grad <= 0 or getattr(inner, "is_stub_optimizer", False) \
            else inner.get_parameters()
        if parameters:
            clip_grad_by_total_norm_fp32(parameters, config.clip_grad, grad_norm,
                                         config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _update(engine: Engine, loss: float, spike_guard: SpikeGuard | None) -> StepResult:
    """megatron's optimizer step, taken apart so that the one gradient norm it takes anyway also finds
    non-finite gradients and spikes: no other pass over the gradients, no other collective. The norm is
    reduced over every rank that holds a part of the gradients (the world under the distributed
    optimizer); data- and context-parallel replicas otherwise hold the same all-reduced gradients, a
    NaN from any one's backward included, so all ranks decide alike."""
    optimizer = engine.optimizer
    # fp16's loss scaler finds overflowing gradients itself: it skips their update and lowers the scale.
    # At its lowest scale it can lower nothing: gradients still not finite there are a NaN step's
    lowers_scale = engine.cfg.train.precision == "fp16" and \
        float(optimizer.get_loss_scale()) > optimizer.config.min_loss_scale
    if optimizer.prepare_grads():  # main gradients copied (fp16: unscaled, checked, the scale updated)
        return StepResult(loss=loss, grad_norm=None, updated=False, overflow=lowers_scale)
    grad_norm = float(optimizer.get_grad_norm())
    # a NaN or inf anywhere makes the norm so (as do gradients whose norm overflows fp32): an update
    # from them would poison every weight. The norm is reported as it is: with a finite loss, it alone
    # says what went wrong
    if not math.isfinite(grad_norm):
        return StepResult(loss=loss, grad_norm=grad_norm, updated=False)
    if spike_guard is not None and spike_guard.is_spike(loss, grad_norm):
        return StepResult(loss=loss, grad_norm=grad_norm, updated=False, spike=True)
    _clip_gradients(optimizer, grad_norm)
    return StepResult(loss=loss, grad_norm=grad_norm, updated=bool(optimizer.step_with_ready_grads()))


def train_step(engine: Engine, data_iterator, num_microbatches: int,
               before_update: Callable[[Engine], None] | None = None,
               spike_guard: SpikeGuard | None = None) -> StepResult:
    """Forward, backward and, unless the global batch holds no loss tokens, or the loss or a gradient is not
    finite (or `spike_guard` finds the loss or gradient norm spiking), an optimizer update.

    `before_update(engine)` sees the reduced gradients (param.main_grad) before the optimizer uses them.
    """
    for chunk in engine.model:
        chunk.zero_grad_buffer()
    engine.optimizer.zero_grad()
    reduced = _forward_backward(engine, data_iterator, num_microbatches, forward_only=False)
    loss = _mean_loss_on_every_rank(reduced, num_microbatches, engine.config.calculate_per_token_loss)
    if loss is None:  # nothing to learn from: Adam's moments (and weight decay) would still move the weights
        return StepResult(loss=None, grad_norm=None, updated=False)
    if not math.isfinite(loss):  # the same on every rank
        return StepResult(loss=loss, grad_norm=None, updated=False,
                          non_finite_ranks=_ranks_with_non_finite_losses(reduced))
    if before_update is not None:
        before_update(engine)
    return _update(engine, loss, spike_guard)
