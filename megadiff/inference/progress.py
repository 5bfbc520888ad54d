"""Progress bars of the checkpoint commands: rank 0's share of the work, on stderr (the report
goes to stdout), with a rate that counts every rank's tokens."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from megadiff.console import progress_bars
from megadiff.inference.ranks import reports
from megadiff.parallel import rank_and_world


def command_progress(command: str) -> Progress:
    """The command's bars (one task per source or grid), shown by rank 0 only."""
    # the description as written: evaluate's is a data prefix, and a path holding brackets was cut (data/E[v2]
    # shown as data/E) or raised a MarkupError (data/F[/v2], once the work was done when printing to a file)
    return progress_bars(TextColumn(f"{command} {{task.description}}", markup=False), BarColumn(), MofNCompleteColumn(),
                         TextColumn("{task.fields[rate]}"), TextColumn("eta"), TimeRemainingColumn(),
                         console=Console(stderr=True), disable=not reports())


class ProgressTask:
    """One bar over this rank's `items` (its share of the work), in tokens/s of all ranks (taking
    the others to go as fast as this one)."""

    def __init__(self, progress: Progress, description: str, items: int):
        self.world = rank_and_world()[1]
        self.progress = progress
        self.task = progress.add_task(description, total=items, rate="")
        self.started, self.tokens = time.perf_counter(), 0

    def advance(self, items: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens * self.world / (time.perf_counter() - self.started)
        ranks = f" on {self.world} ranks" if self.world > 1 else ""
        self.progress.update(self.task, advance=items, rate=f"{rate:,.0f} tokens/s{ranks}")
