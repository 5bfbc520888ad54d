"""Preemption: SIGTERM / SIGUSR1 ask for a checkpoint and a clean exit at the next iteration boundary.

Shared by pre-training and adaptation (torch only, no megatron).

The flag is all-reduced (MAX) over every rank each iteration, so all ranks stop after the same
iteration even when the signal reached only some of them. The process then exits with
REQUEUE_EXIT_CODE, which the Slurm scripts turn into a requeue.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"


class PreemptionHandler:
    def __init__(self, signals=PREEMPTION_SIGNALS):
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """True on every rank if any rank received a signal (collective; NCCL needs a CUDA `device`)."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal on another rank"
