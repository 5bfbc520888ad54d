"""A conversion's steps on the console as they start and end, with their time: a 13B model takes
minutes to read, write and check, and a step that prints nothing looks like one that hangs."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console


@contextmanager
def step(console: Console, action: str) -> Iterator[None]:
    """'megadiff convert: ACTION ...' now, 'megadiff convert: ACTION: N s' once it is done."""
    console.print(f"megadiff convert: {action} ...")
    started = time.perf_counter()
    yield
    console.print(f"megadiff convert: {action}: {time.perf_counter() - started:.1f} s")
