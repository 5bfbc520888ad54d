"""Where the evaluation commands print and write their reports: rank 0 alone under torchrun."""
from __future__ import annotations

import json

from rich.console import Console

from megadiff.console import plain_console
from megadiff.files import write_atomically
from megadiff.inference.ranks import reports


def command_console() -> Console:
    """Where a command prints: rank 0's console; the other ranks' is silent."""
    return plain_console(quiet=not reports())


def write_report(console: Console, report: dict, output: str | None) -> None:
    """The report as JSON at `output`, when asked for (by rank 0)."""
    if output and reports():  # whole or not at all: a kill while writing kept neither the last report nor this
        write_atomically(output, json.dumps(report, indent=1).encode())
        console.print(f"wrote {output}")
