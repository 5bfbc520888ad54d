"""The loss-spike guard (train.skip_spike_sigma): a step whose loss or gradient norm stands more
than sigma standard deviations above the mean of the previous `window` steps is not applied, as
OLMo-core's SkipStepOptimizer does. Every step joins the window, spikes too, so a lasting change of
level is accepted after a while rather than skipped for ever. Every rank holds the same loss
(averaged over data-parallel ranks) and the same global gradient norm: all agree on their own.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class SpikeGuard:
    sigma: float
    window: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # a run resumed with a smaller train.spike_window gets a longer saved history: untrimmed, the window never
        # counted as full at its first step, which went unguarded whatever its loss
        self.losses, self.grad_norms = self.losses[-self.window:], self.grad_norms[-self.window:]

    def is_spike(self, loss: float, grad_norm: float) -> bool:
        """Whether this step spikes (never before the window is full); then adds it to the window."""
        spike = len(self.losses) == self.window and (_above(loss, self.losses, self.sigma)
                                                     or _above(grad_norm, self.grad_norms, self.sigma))
        self.losses = (self.losses + [loss])[-self.window:]
        self.grad_norms = (self.grad_norms + [grad_norm])[-self.window:]
        return spike

    def history(self) -> dict:
        """What a checkpoint keeps, so a resumed run decides as the uninterrupted one."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}


def _above(value: float, previous: list[float], sigma: float) -> bool:
    return value > statistics.fmean(previous) + sigma * statistics.stdev(previous)
