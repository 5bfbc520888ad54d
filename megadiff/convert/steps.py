"""A conversion's steps on the console as they start and end, with their time (a 13B model takes
minutes to read, write and check, and a step that prints nothing looks like one that hangs), and its
claim on the directory it writes."""
from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path

from rich.console import Console

from megadiff.console import timed_step
from megadiff.convert.hf_layout import ConversionError
from megadiff.files import claimed


def step(console: Console, action: str) -> AbstractContextManager:
    """'megadiff convert: ACTION ...' now, 'megadiff convert: ACTION: N s' once it is done."""
    return timed_step(console, f"megadiff convert: {action}")


def writing_alone(out: Path) -> AbstractContextManager:
    """Held by the conversion writing `out` (its lock, `<out>.lock`, beside it while it runs): two into one --save
    at once each removed the other's staged files as it started, leaving an export without its weights, or a mix."""
    return claimed(f"{os.path.abspath(out)}.lock", lambda holder: ConversionError(
        f"--save {out} is being written by another conversion ({holder}): wait for it to end, or give another "
        "--save"))
