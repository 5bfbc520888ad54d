"""The console megadiff's commands print to."""
from __future__ import annotations

from rich.console import Console


def plain_console(**options) -> Console:
    """rich's console printing text as written: with markup, a path or name holding brackets was cut
    (output_dir runs/E[v1] printed as runs/E) or raised a MarkupError (runs/F[/v1], at a run's start)."""
    return Console(soft_wrap=True, markup=False, highlight=False, **options)
