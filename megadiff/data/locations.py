"""Where data lives by default: everything megadiff writes on its own goes under data.cache_dir."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

from megadiff.config.schema import DataConfig
from megadiff.config.validate import parse_blend
from megadiff.data.errors import DataError
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN


def tokenizer_tag(spec: str) -> str:
    """A file-name-safe tokenizer name: packaged ones by name, directories by name + a hash of their path."""
    if spec in PACKAGED_TIKTOKEN:
        return spec
    path = Path(spec).resolve()
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.name) + "-" + hashlib.sha1(str(path).encode()).hexdigest()[:8]


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
