"""megatron-core indexed datasets (<prefix>.bin tokens + <prefix>.idx index): atomic writing, checked reading."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megadiff.data.errors import DataError
from megadiff.files import temporary_name

UINT16_IDS = np.iinfo(np.uint16).max + 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype megatron reads for this vocabulary: its GPTDatasetConfig uses the same rule."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.int32)


LOSS_MASK_DTYPE = np.dtype(np.uint8)


def loss_mask_prefix(prefix: str | Path) -> str:
    """Where prompt/response data keep their loss mask: an indexed dataset with the tokens' documents."""
    return f"{prefix}-loss-mask"


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class AtomicIndexedWriter:
    """megatron's IndexedDatasetBuilder writing temporary files, renamed to <prefix>.bin/.idx on commit.

    Used as a context manager: leaving it without commit() (an error) deletes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_bin, self.tmp_idx = temporary_name(bin_path(prefix)), temporary_name(idx_path(prefix))
        self.builder = IndexedDatasetBuilder(str(self.tmp_bin), dtype=dtype.type)

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as concatenated ids and per-document lengths (0-length ones are skipped)."""
        offset = 0
        for length in lengths[lengths > 0]:
            self.builder.add_document(ids[offset:offset + length], [int(length)])
            offset += length

    def add_prepared(self, prefix: str | Path) -> None:
        """Append every document of another indexed dataset of the same dtype (its .bin is copied)."""
        self.builder.add_index(str(prefix))

    def commit(self) -> None:
        self.builder.finalize(str(self.tmp_idx))
        os.replace(self.tmp_bin, bin_path(self.prefix))
        os.replace(self.tmp_idx, idx_path(self.prefix))

    def __enter__(self) -> "AtomicIndexedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.builder.data_file.close()
        self.tmp_bin.unlink(missing_ok=True)
        self.tmp_idx.unlink(missing_ok=True)


@dataclass(frozen=True)
class IndexSummary:
    dtype: np.dtype
    sequence_lengths: np.ndarray   # tokens per sequence (what GPTDataset calls a document), EOD included

    @property
    def tokens(self) -> int:
        return int(self.sequence_lengths.sum())


def token_count(prefix: str | Path) -> int:
    """The tokens of <prefix>.bin from its size and the token width its .idx header names: read_index's
    `tokens` for a prefix it accepted, without reading an index of a token count per document."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    with open(idx_path(prefix), "rb") as stream:
        stream.seek(len(_INDEX_HEADER) + 8)  # the header, then the format version
        code = struct.unpack("<B", stream.read(1))[0]
    return bin_path(prefix).stat().st_size // DType.size(code)


def read_index(prefix: str | Path, key: str = "data.prefix") -> IndexSummary:
    """Read <prefix>.idx and check that <prefix>.bin holds exactly the tokens it describes."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bin_file, idx_file = bin_path(prefix), idx_path(prefix)
    missing = [str(p) for p in (bin_file, idx_file) if not p.is_file()]
    if missing:
        raise DataError(f"{key}: {' and '.join(missing)} not found; prepare the data first: "
                        f"megadiff prepare-data CONFIG (with data.prefix={prefix})")
    try:
        dataset = IndexedDataset(str(prefix), mmap=False)
    except (AssertionError, KeyError, ValueError, OSError, struct.error) as err:
        raise DataError(f"{key}: {idx_file} is not a readable megatron index ({err}); re-run prepare-data") from None
    index = dataset.index
    expected = int(index.sequence_lengths.astype(np.int64).sum()) * index.dtype_size
    actual = bin_file.stat().st_size
    if actual != expected:
        raise DataError(f"{key}: {idx_file} describes {expected} bytes of tokens but {bin_file} holds {actual}: "
                        "the two files do not belong together; re-run prepare-data")
    return IndexSummary(np.dtype(index.dtype), np.array(index.sequence_lengths, dtype=np.int64))
