"""Where data lives by default: everything megadiff writes on its own goes under data.cache_dir."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

from megadiff.config.schema import DataConfig
from megadiff.config.validate import parse_blend
from megadiff.data.errors import DataError
from megadiff.data.manifest import tokenizer_identity
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN


def tokenizer_tag(spec: str) -> str:
    """A file-name-safe tokenizer name: packaged ones by name, directories by name + a hash of what they read text
    into (tokenizer_identity; of the path where there is none to read). By path, the nodes of a run reading their
    own copies of one tokenizer (data.tokenizer may be node-local) looked for the bundled corpus under as many
    prefixes, all but rank 0's never prepared."""
    if spec in PACKAGED_TIKTOKEN:
        return spec
    path = Path(spec).resolve()
    identity = _identity_or_path(spec, path)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.name) + "-" + hashlib.sha1(identity.encode()).hexdigest()[:8]


def _identity_or_path(spec: str, path: Path) -> str:
    """tokenizer_identity(spec); the path of a directory that is no tokenizer, or none that can be read, which
    loading it then names (the tokenizers library raises a bare Exception for a broken tokenizer.json)."""
    try:
        return tokenizer_identity(spec) or str(path)
    except Exception:  # noqa: BLE001
        return str(path)


def corpus_dir(data: DataConfig) -> Path:
    return Path(data.cache_dir) / "corpus"


def data_prefix(data: DataConfig) -> str:
    """data.prefix, or for a bundled corpus <cache_dir>/prepared/<corpus>-<tokenizer>."""
    if data.prefix:
        return data.prefix
    if data.bundled_corpus:
        return str(Path(data.cache_dir) / "prepared" / f"{data.bundled_corpus}-{tokenizer_tag(data.tokenizer)}")
    raise DataError("data.prefix: not set; give the prefix of the prepared data (<prefix>.bin/.idx), "
                    "or set data.bundled_corpus=kjv")


def index_cache_dir(data: DataConfig) -> Path:
    """megatron's document/sample/shuffle index cache (one set of .npy files per split, seed and length)."""
    return Path(data.cache_dir) / "indices"


def training_blend(data: DataConfig) -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, weights or None) pre-training reads: data.blend, or [data_prefix(data)]."""
    return parse_blend(data.blend) if data.blend else ([data_prefix(data)], None)
