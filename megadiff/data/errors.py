"""The one error bad data raises, before any compute."""
from __future__ import annotations

from megadiff.config import ConfigError


class DataError(ConfigError):
    """Data that cannot be used as configured; the message names the file or config key.

    A ConfigError, so the CLI reports it like a bad config (exit status 2, no traceback).
    """
