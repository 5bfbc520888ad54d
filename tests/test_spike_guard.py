"""The spike guard's decisions against numpy's mean and sample deviation of the window."""
from __future__ import annotations

import numpy as np

from megadiff.training.spikes import SpikeGuard


def _threshold(values: list[float], sigma: float) -> float:
    return float(np.mean(values) + sigma * np.std(values, ddof=1))


def test_no_decision_before_the_window_is_full():
    guard = SpikeGuard(sigma=3.0, window=4)
    assert not any(guard.is_spike(loss, 1.0) for loss in (1.0, 1e6, 2.0, 1e9))


def test_loss_or_grad_norm_above_the_threshold_spikes():
    losses, norms = [3.0, 2.9, 2.8, 2.75], [1.0, 1.2, 0.9, 1.1]
    for loss, norm, spikes in [(_threshold(losses, 3.0) * 1.001, 1.0, True),
                               (_threshold(losses, 3.0) * 0.999, 1.0, False),
                               (2.7, _threshold(norms, 3.0) * 1.001, True),
                               (2.7, _threshold(norms, 3.0) * 0.999, False)]:
        guard = SpikeGuard(sigma=3.0, window=4)
        for previous_loss, previous_norm in zip(losses, norms):
            guard.is_spike(previous_loss, previous_norm)
        assert guard.is_spike(loss, norm) is spikes, (loss, norm)


def test_the_window_slides_and_keeps_spikes():
    guard = SpikeGuard(sigma=3.0, window=3)
    decisions = [guard.is_spike(loss, 1.0) for loss in (2.0, 2.1, 1.9, 50.0, 2.0, 60.0)]
    assert decisions == [False, False, False, True, False, False]  # 60 after 50 joined: no longer 3 sigma out
    assert guard.losses == [50.0, 2.0, 60.0] and len(guard.grad_norms) == 3


def test_a_guard_rebuilt_from_its_history_decides_the_same():
    guard = SpikeGuard(sigma=2.0, window=5)
    for loss in (3.0, 2.8, 2.9, 2.7, 2.6, 2.65):
        guard.is_spike(loss, loss / 2)
    rebuilt = SpikeGuard(2.0, 5, **guard.history())
    following = [(2.5, 1.2), (9.0, 1.0), (2.4, 8.0), (2.3, 1.1)]
    assert [guard.is_spike(*step) for step in following] == [rebuilt.is_spike(*step) for step in following]


def test_the_history_keeps_both_windows_apart():
    """A resumed run rebuilds its guard from history(): a loss window saved as the gradient norms' would
    make it skip (or apply) steps the uninterrupted run did not."""
    guard = SpikeGuard(sigma=3.0, window=3)
    for loss, norm in [(3.0, 0.5), (2.9, 0.6), (2.8, 0.4), (2.7, 0.55)]:
        guard.is_spike(loss, norm)
    assert guard.history() == {"losses": [2.9, 2.8, 2.7], "grad_norms": [0.6, 0.4, 0.55]}
    rebuilt = SpikeGuard(3.0, 3, **guard.history())
    assert rebuilt.is_spike(2.7, 5.0) and guard.is_spike(2.7, 5.0)  # a gradient-norm spike, the loss in range


def test_a_guard_resumed_with_a_smaller_window_decides_on_its_last_steps():
    """train.spike_window lowered on resume: the saved history is longer than the new window, whose statistics
    are those of the last `window` steps; the resumed run's first step is guarded like every other."""
    history = [3.0, 2.9, 2.8, 2.75, 2.7, 2.72]
    resumed = SpikeGuard(3.0, 4, losses=history, grad_norms=[1.0] * len(history))
    spike = _threshold(history[-4:], 3.0) * 1.001
    assert resumed.is_spike(spike, 1.0)
    assert resumed.losses == history[-3:] + [spike]
