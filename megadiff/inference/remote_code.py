"""Whose code a `--hf` directory would have transformers run.

The commands load a `--hf` directory with trust_remote_code, since megadiff's own exports (DINT, Shared DIFF,
`--remote-code` DIFF, Dex/DAA) ship their modeling code. A model from elsewhere whose config names code of its
own (auto_map) would run that code as it loads, unasked, where transformers itself asks first: such code is
refused unless the user passes --trust-remote-code, after reading it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megadiff.config import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent
# the modeling code megadiff copies into its exports, verbatim
SHIPPED_CODE = (PACKAGE / "convert" / "hf_code" / "configuration_megadiff.py",
                PACKAGE / "convert" / "hf_code" / "modeling_megadiff.py",
                PACKAGE / "adapt" / "modeling_adapted.py")
# the files whose auto_map may name code in another repository ("owner/repo--module.Class"), fetched and run
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _references_elsewhere(directory: Path) -> list[str]:
    """auto_map entries that name code in another repository."""
    found = []
    for name in AUTO_MAP_FILES:
        try:
            auto_map = json.loads((directory / name).read_text()).get("auto_map", {})
        except (OSError, ValueError, AttributeError):  # absent or unreadable: the loaders name it
            continue
        for value in auto_map.values() if isinstance(auto_map, dict) else ():
            found += [ref for ref in (value if isinstance(value, list) else [value])
                      if isinstance(ref, str) and "--" in ref]
    return found


def foreign_code(directory: str | Path) -> list[str]:
    """The code in `directory` that transformers could run and megadiff did not ship: its .py files that are
    no copy of megadiff's modeling code, and auto_map references to other repositories."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    shipped = {_digest(path) for path in SHIPPED_CODE}
    files = sorted(path.name for path in directory.glob("*.py") if _digest(path) not in shipped)
    return files + _references_elsewhere(directory)


def check_remote_code(directory: str | Path, trusted: bool) -> None:
    """Refuse `directory` (a --hf model) where it holds code megadiff did not ship, unless `trusted`."""
    foreign = [] if trusted else foreign_code(directory)
    if foreign:
        raise ConfigError(f"--hf {directory} holds code that megadiff did not ship ({', '.join(foreign)}), which "
                          "transformers would run as the model loads: read it, then pass --trust-remote-code to run "
                          "it (an export of an earlier megadiff holds that version's code)")
