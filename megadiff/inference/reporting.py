"""Where the evaluation commands print and write their reports: rank 0 alone under torchrun."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from megadiff.console import plain_console
from megadiff.inference.ranks import reports


def command_console() -> Console:
    """Where a command prints: rank 0's console; the other ranks' is silent."""
    return plain_console(quiet=not reports())


def write_report(console: Console, report: dict, output: str | None) -> None:
    """The report as JSON at `output`, when asked for (by rank 0)."""
    if output and reports():
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))
        console.print(f"wrote {output}")
