"""Files someone else could hand a user: what a loader must refuse without running."""
from __future__ import annotations

from pathlib import Path


class OpensAFile:
    """Unpickled, it calls open(path, "w"): what a pickle can make its reader run, any code alike."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")
