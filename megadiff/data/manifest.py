"""<prefix>.manifest.json: what a prepared dataset was made from, written last as its completion mark.

prepare-data skips its work when the manifest's fingerprint (sources with their sizes and
modification times, text key, tokenizer, token dtype) equals the current one and the
.bin/.idx still have the sizes it recorded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megadiff.data.indexed import bin_path, idx_path
from megadiff.files import write_atomically

FORMAT = 1


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def read_manifest(prefix: str | Path) -> Optional[dict]:
    try:
        return json.loads(manifest_path(prefix).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _output_sizes(prefix: str | Path) -> Optional[list[int]]:
    files = (bin_path(prefix), idx_path(prefix))
    return [f.stat().st_size for f in files] if all(f.is_file() for f in files) else None


def is_up_to_date(prefix: str | Path, fingerprint: dict) -> bool:
    manifest = read_manifest(prefix)
    return (manifest is not None and manifest.get("format") == FORMAT and manifest.get("fingerprint") == fingerprint
            and manifest.get("output_bytes") == _output_sizes(prefix))


def write_manifest(prefix: str | Path, fingerprint: dict, stats: dict) -> None:
    manifest = {"format": FORMAT, "fingerprint": fingerprint, "stats": stats, "output_bytes": _output_sizes(prefix)}
    write_atomically(manifest_path(prefix), (json.dumps(manifest, indent=2) + "\n").encode())


def remove_manifest(prefix: str | Path) -> None:
    manifest_path(prefix).unlink(missing_ok=True)
