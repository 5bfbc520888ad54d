"""The console megadiff's commands print to."""
from __future__ import annotations

import os
import sys

from rich.console import Console


class _PlainConsole(Console):
    def on_broken_pipe(self) -> None:
        """Its reader went away (`megadiff pretrain ... | head`): the printing ends, not the command, as rich's
        own ending does (exit code 1, mid-run, nothing said): a training run goes on, logging to its files."""
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())
        self.quiet = True
        try:
            print("megadiff: its output's reader went away: going on without printing", file=sys.stderr, flush=True)
        except OSError:  # standard error gone as well
            pass


def plain_console(**options) -> Console:
    """rich's console printing text as written: with markup, a path or name holding brackets was cut
    (output_dir runs/E[v1] printed as runs/E) or raised a MarkupError (runs/F[/v1], at a run's start)."""
    return _PlainConsole(soft_wrap=True, markup=False, highlight=False, **options)
