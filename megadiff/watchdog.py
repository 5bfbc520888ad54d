"""Every thread's stack, in a file of each rank's, when a training step outlasts most of the collective timeout.

A rank stuck outside a collective (a hung data read, a deadlock) printed nothing: its peers failed at the
timeout with only "Timed out waiting ... for recv", and torchrun named the rank whose timeout fired first,
a healthy one. Dumped a little before that timeout, the stuck rank's stack shows where it is (the others'
show them waiting in a collective). One file a rank, <directory>/rank<N>-<host>.txt: thousands of ranks'
stacks in one log would interleave. Files left empty, and then the directory, are removed at the end.
"""
from __future__ import annotations

import contextlib
import faulthandler
import socket
from pathlib import Path
from typing import IO

# of the collective timeout: late enough for no healthy step to reach it, early enough to come first
SHARE_OF_TIMEOUT = 0.9
STALLS_DIR = "stalls"  # under a run's output_dir


class StallWatchdog:
    """`with watchdog:` around each training step (its data read and its collectives)."""

    def __init__(self, timeout_minutes: float, directory: str | Path, rank: int):
        self.seconds = timeout_minutes * 60 * SHARE_OF_TIMEOUT
        self.path = Path(directory) / f"rank{rank}-{socket.gethostname()}.txt"
        self.file: IO | None = None

    def __enter__(self) -> "StallWatchdog":
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w")
        faulthandler.dump_traceback_later(self.seconds, file=self.file)
        return self

    def __exit__(self, *exc) -> None:
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.file is not None:
            self.file.close()
            self.file = None
            if self.path.stat().st_size == 0:
                self.path.unlink()
                with contextlib.suppress(OSError):  # left in place while another rank's file is there
                    self.path.parent.rmdir()
