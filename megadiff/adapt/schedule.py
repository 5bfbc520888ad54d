"""The learning-rate schedule of adaptation: linear warmup, then cosine decay (Dex appendix F.1:
cosine, warmup ratio 0.03), as a multiplier of train.lr per optimizer step."""
from __future__ import annotations

import math
from functools import partial

from torch.optim.lr_scheduler import LambdaLR

from megadiff.adapt.settings import TrainSection


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier for optimizer step `step` (0-based): (step + 1) / warmup during warmup (the first
    step already trains), then cosine from 1 towards min_ratio, which it would reach one step after the
    last: every step trains (with the recipes' min_lr_ratio of 0, a last step at min_ratio trained nothing),
    and the peak is taken once."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step + 1 - warmup_steps) / (total_steps + 1 - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(train: TrainSection):
    """A DeepSpeed `lr_scheduler` callable: optimizer -> LambdaLR (its state is in DeepSpeed checkpoints)."""
    warmup = round(train.warmup_ratio * train.iters)
    return partial(_scheduler, multiplier=partial(lr_multiplier, warmup_steps=warmup, total_steps=train.iters,
                                                  min_ratio=train.min_lr_ratio))


def _scheduler(optimizer, multiplier):
    return LambdaLR(optimizer, multiplier)


def resume_schedule(scheduler: LambdaLR, train: TrainSection) -> str | None:
    """After a checkpoint is loaded: this run's schedule from the next step on. The loaded state holds the
    saving run's peak lr (as the scheduler's base) and the lr its schedule set last, others where
    train.lr, train.iters or the warmup changed. Returns what the change does to the lr, to be said: a
    lengthened run steps back up its stretched cosine (or into a longer warmup), without a word otherwise."""
    was = scheduler.get_last_lr()[0]  # the checkpoint's schedule's lr for the next update
    scheduler.base_lrs = [train.lr] * len(scheduler.optimizer.param_groups)
    for group, multiplier in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = train.lr * multiplier(scheduler.last_epoch)
    now = scheduler.optimizer.param_groups[0]["lr"]
    if math.isclose(was, now, rel_tol=1e-6, abs_tol=1e-12):
        return None
    return (f"the lr schedule differs from the checkpoint's (train.lr, train.iters, train.warmup_ratio or "
            f"train.min_lr_ratio): update {scheduler.last_epoch + 1:,} takes lr {now:.4g}, where the checkpoint's "
            f"schedule had {was:.4g}; this run's config sets the schedule, at the checkpoint's position")
