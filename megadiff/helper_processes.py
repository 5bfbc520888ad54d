"""Helper processes of a training process (a data loader's workers, a checkpoint writer's manager) and the
preemption signals. Torch-free: a spawned helper imports this module alone, in a tenth of a second where torch
took three (at every run's first checkpoint, on every rank)."""
from __future__ import annotations

import os
import signal
import threading
import time

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_preemption_signals(*_) -> None:
    """For a helper process (a data loader's worker, a checkpoint writer's manager): Slurm's `scancel --signal`
    and time-limit SIGTERM reach every process of the job step, and the default action would kill the helper
    before the training process checkpoints with it and exits for requeue."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def follow_the_trainer(trainer: int) -> None:
    """Initializer of a helper process the training process (pid `trainer`) spawns: it ignores the preemption
    signals, and exits once the trainer is gone (killed outright, a spawned helper would outlive it, and now
    a plain kill too)."""
    ignore_preemption_signals()

    def exit_without_the_trainer() -> None:
        while os.getppid() == trainer:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_without_the_trainer, daemon=True).start()
