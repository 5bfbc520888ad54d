"""Stopping early without losing work: SIGTERM / SIGUSR1, or a wall-clock budget, ask for a
checkpoint and a clean exit at the next iteration boundary.

Shared by pre-training and adaptation (torch only, no megatron).

Both flags are all-reduced (MAX) over every rank each iteration, so all ranks stop after the same
iteration even when the signal reached only some of them or their clocks differ. A signal means
"preempted": the process exits with REQUEUE_EXIT_CODE, which the Slurm scripts turn into a requeue.
A spent time budget (Megatron's --exit-duration-in-mins) is a planned stop, like an exit interval.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megadiff.helper_processes import PREEMPTION_SIGNALS

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
REQUEUE_MARKER_ENV = "MEGADIFF_REQUEUE_MARKER"  # set by slurm/job.sh


def leave_requeue_marker(rank: int) -> None:
    """Rank 0 leaves the file $MEGADIFF_REQUEUE_MARKER names (when set), once the preemption checkpoint
    is committed: under torchrun a Slurm batch script sees torchrun's exit code (1 when a worker exits
    otherwise than 0), not REQUEUE_EXIT_CODE, and requeues on this file. A save that fails leaves none,
    so the job ends with the error rather than requeueing into it again."""
    marker = os.environ.get(REQUEUE_MARKER_ENV)
    if marker and rank == 0:
        try:
            Path(marker).touch()
        except OSError as err:  # the checkpoint is written: the job then needs resubmitting by hand
            print(f"megadiff: could not leave the requeue marker {marker} ({err.strerror})", file=sys.stderr)


class PreemptionHandler:
    """Installed as a run starts: `budget_minutes` from then on (None: no budget)."""

    def __init__(self, signals=PREEMPTION_SIGNALS, budget_minutes: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.received: int | None = None
        self.signalled = False  # agreed: some rank received a signal
        self.out_of_time = False  # agreed: some rank's budget is spent
        self._clock = clock
        self._deadline = None if budget_minutes is None else clock() + 60.0 * budget_minutes
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """True on every rank if any rank received a signal or ran out of time (collective; NCCL needs a
        CUDA `device`). Afterwards `signalled` and `out_of_time` say which, identically on every rank."""
        spent = self._deadline is not None and self._clock() >= self._deadline
        flags = torch.tensor([self.received is not None, spent], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.signalled, self.out_of_time = (bool(flag) for flag in flags.tolist())
        return self.signalled or self.out_of_time

    def exit_after_checkpoint(self, rank: int) -> int:
        """Once the stopping checkpoint is committed (a requeue resumes from it): after a signal, the requeue
        marker and REQUEUE_EXIT_CODE, on which the Slurm scripts requeue; otherwise 0."""
        if not self.signalled:
            return 0
        leave_requeue_marker(rank)
        return REQUEUE_EXIT_CODE

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal on another rank"
