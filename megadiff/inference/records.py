"""Results kept as they come, so long evaluations resume: one JSON line per result, appended,
flushed and synced before the next; a rerun reads them back and computes only the rest. A line
cut short by a crash is dropped (its result is computed again)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """The records in `path` (none when it does not exist)."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class RecordWriter:
    """Appends records to `path` (created with its directory on the first one)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def append(self, record: dict) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a")
            if self.path.stat().st_size and not self._ends_with_newline():
                self.file.write("\n")  # after a cut-short line, start a fresh one
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as existing:
            existing.seek(-1, os.SEEK_END)
            return existing.read(1) == b"\n"

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
