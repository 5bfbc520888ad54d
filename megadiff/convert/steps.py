"""A conversion's steps on the console as they start and end, with their time (a 13B model takes
minutes to read, write and check, and a step that prints nothing looks like one that hangs), and its
claim on the directory it writes."""
from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console

from megadiff.convert.hf_layout import ConversionError
from megadiff.files import claimed


@contextmanager
def step(console: Console, action: str) -> Iterator[None]:
    """'megadiff convert: ACTION ...' now, 'megadiff convert: ACTION: N s' once it is done."""
    console.print(f"megadiff convert: {action} ...")
    started = time.perf_counter()
    yield
    console.print(f"megadiff convert: {action}: {time.perf_counter() - started:.1f} s")


def writing_alone(out: Path) -> AbstractContextManager:
    """Held by the conversion writing `out` (its lock, `<out>.lock`, beside it while it runs): two into one --save
    at once each removed the other's staged files as it started, leaving an export without its weights, or a mix."""
    return claimed(f"{os.path.abspath(out)}.lock", lambda holder: ConversionError(
        f"--save {out} is being written by another conversion ({holder}): wait for it to end, or give another "
        "--save"))
