"""Helper processes of a training process (a data loader's workers, a checkpoint writer's manager) and the
preemption signals. Torch-free: a spawned helper imports this module alone, in a tenth of a second where torch
took three (at every run's first checkpoint, on every rank)."""
from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time

from megadiff.errors import MegadiffError

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# the longest path a socket binds to: sockaddr_un's sun_path, 108 bytes with its terminating NUL
SOCKET_PATH_LIMIT = 107
# multiprocessing's sockets lie in a directory of its own, each named by 8 random characters as the directory is
OWN_DIR = "pymp-" + "x" * 8
SOCKET = "listener-" + "x" * 8
# node-local directories with short paths, where TMPDIR's are too long for a socket
SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


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


def _socket_fits(directory: str) -> bool:
    return len(os.fsencode(os.path.join(directory, SOCKET))) <= SOCKET_PATH_LIMIT


def socket_directory(library=multiprocessing) -> str:
    """multiprocessing's directory for this process's sockets (a manager's listener, the file descriptors a data
    loader's worker hands over), chosen short where TMPDIR's would make their paths too long for a socket: Slurm
    sites give jobs a TMPDIR of 80 characters and more, and a checkpoint writer's manager then failed at start-up
    (a bare EOFError), a data loader's worker silently (the run waited forever for its first batch). Forked
    helpers inherit it; it is removed as this process exits. `library`: multiprocessing or a copy of it with
    state of its own (`multiprocess`, which Hugging Face datasets' workers use)."""
    config = library.current_process()._config  # where multiprocessing's util.get_temp_dir records it
    if _socket_fits(config.get("tempdir") or os.path.join(tempfile.gettempdir(), OWN_DIR)):
        return library.util.get_temp_dir()
    base = next((base for base in SHORT_TEMP_DIRS
                 if os.access(base, os.W_OK | os.X_OK) and _socket_fits(os.path.join(base, OWN_DIR))), None)
    if base is None:
        raise MegadiffError(f"TMPDIR {tempfile.gettempdir()} is too long for the sockets of this run's helper "
                            f"processes (a socket's path holds {SOCKET_PATH_LIMIT} bytes; "
                            f"{len(OWN_DIR) + len(SOCKET) + 2} go to multiprocessing's names below TMPDIR), and none "
                            f"of {', '.join(SHORT_TEMP_DIRS)} can be written: set TMPDIR to a shorter directory")
    directory = tempfile.mkdtemp(prefix="pymp-", dir=base)
    # as multiprocessing's own directory is removed: after the other exit handlers, which may use its sockets
    library.util.Finalize(None, shutil.rmtree, args=(directory, True), exitpriority=-100)
    config["tempdir"] = directory
    return directory
