"""Every thread's stack on stderr when an iteration outlasts most of the collective timeout.

A rank stuck outside a collective (a hung data read, a deadlock) printed nothing: its peers failed at the
timeout with only "Timed out waiting ... for recv", and torchrun named the rank whose timeout fired first,
a healthy one. Dumped a little before that timeout, the stuck rank's stack shows where it is.
"""
from __future__ import annotations

import faulthandler
import sys

# of the collective timeout: late enough for no healthy iteration to reach it, early enough to come first
SHARE_OF_TIMEOUT = 0.9


class StallWatchdog:
    def __init__(self, timeout_minutes: float):
        self.seconds = timeout_minutes * 60 * SHARE_OF_TIMEOUT
        # the process's own stderr (a file descriptor faulthandler can write to from its thread): the one a
        # launcher collects, whatever sys.stderr was replaced with
        self.stream = sys.__stderr__

    def arm(self) -> None:
        """Call as each iteration starts: the dump comes if it is still running `seconds` later."""
        if self.stream is not None:
            faulthandler.dump_traceback_later(self.seconds, file=self.stream)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
