"""megatron-core indexed datasets (<prefix>.bin tokens + <prefix>.idx index): atomic writing, checked reading."""
from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from megadiff.data.errors import DataError
from megadiff.files import temporary_name

UINT16_IDS = np.iinfo(np.uint16).max + 1
# megatron's .idx header: magic, format version, token dtype code, sequence count, document count + 1
INDEX_HEADER_FORMAT = "<9sQBQQ"
INDEX_HEADER_BYTES = struct.calcsize(INDEX_HEADER_FORMAT)
MAX_DOCUMENT_TOKENS = np.iinfo(np.int32).max  # the .idx's sequence lengths are int32
# megatron-core's datasets number a prefix's documents in int32 (its document index): past this, ids wrap
# negative and numpy reads them from the end, so the valid split read training documents, silently
MAX_DOCUMENTS = np.iinfo(np.int32).max
# the entries of each .idx array written at once
WRITE_CHUNK = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype megatron reads for this vocabulary: its GPTDatasetConfig uses the same rule."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.int32)


LOSS_MASK_DTYPE = np.dtype(np.uint8)


def refuse_too_many_documents(documents: int, prefix: str | Path) -> None:
    if documents > MAX_DOCUMENTS:
        raise DataError(f"{prefix}: {documents:,} documents; megatron-core's datasets number at most {MAX_DOCUMENTS:,} "
                        "in one prefix (int32 ids): prepare the sources as several prefixes, each from a share of "
                        "them, and list those in data.blend")


def loss_mask_prefix(prefix: str | Path) -> str:
    """Where prompt/response data keep their loss mask: an indexed dataset with the tokens' documents."""
    return f"{prefix}-loss-mask"


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class AtomicIndexedWriter:
    """Writes <prefix>.bin/.idx as megatron's IndexedDatasetBuilder does (one sequence per document),
    into temporary files renamed on commit.

    It holds 4 bytes per document (their lengths) and handles whole batches and whole parts at
    once: megatron's builder keeps Python lists of ~125 bytes per document, computes the offsets in
    a Python loop and runs gc.collect() for every index it appends, so merging the parts of a
    1T-token corpus (~1.5 billion documents) would take ~190 GB and, with thousands of parts, days.
    Used as a context manager: leaving it without commit() (an error) deletes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self.tmp_bin, self.tmp_idx = temporary_name(bin_path(prefix)), temporary_name(idx_path(prefix))
        self.data_file = open(self.tmp_bin, "wb")
        self.lengths: list[np.ndarray] = []  # int32 tokens per document, as the .idx stores them

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as concatenated ids and per-document lengths (0-length ones are skipped)."""
        lengths = lengths[lengths > 0]
        if len(lengths) and lengths.max() > MAX_DOCUMENT_TOKENS:  # astype would wrap it into a corrupt index
            raise DataError(f"{self.prefix}: a document of {int(lengths.max()):,} tokens; megatron's index holds at "
                            f"most {MAX_DOCUMENT_TOKENS:,} per document: split it into several")
        self.data_file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.lengths.append(lengths.astype(np.int32))

    def add_prepared(self, prefix: str | Path) -> None:
        """Append every document of another indexed dataset of the same dtype (its .bin is copied)."""
        dtype, sequences, documents = read_header(prefix)
        if dtype != self.dtype or documents != sequences + 1:
            raise DataError(f"{idx_path(prefix)}: {dtype} tokens in {sequences} sequences of {documents - 1} "
                            f"documents; only {self.dtype} tokens, one sequence per document, can be appended")
        # a copy: a memory map per part would hold a file descriptor each until the commit
        self.lengths.append(np.array(sequence_lengths(prefix, sequences)))
        with open(bin_path(prefix), "rb") as part:
            shutil.copyfileobj(part, self.data_file)

    def commit(self) -> None:
        from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

        self.data_file.close()
        count = sum(len(lengths) for lengths in self.lengths)
        with open(self.tmp_idx, "wb") as index:
            index.write(_INDEX_HEADER + struct.pack("<QBQQ", 1, DType.code_from_dtype(self.dtype.type), count,
                                                    count + 1))
            for piece in self._pieces():
                index.write(piece.tobytes())
            offset = 0  # the byte offset of each document in the .bin
            for piece in self._pieces():
                sizes = piece.astype(np.int64) * self.dtype.itemsize  # int32 x itemsize passes 2^31 at 512M tokens
                ends = np.cumsum(sizes) + offset
                index.write((ends - sizes).tobytes())
                offset = int(ends[-1])
            for start in range(0, count + 1, WRITE_CHUNK):  # document i is sequence i
                index.write(np.arange(start, min(start + WRITE_CHUNK, count + 1), dtype=np.int64).tobytes())
        os.replace(self.tmp_bin, bin_path(self.prefix))
        os.replace(self.tmp_idx, idx_path(self.prefix))

    def _pieces(self) -> Iterator[np.ndarray]:
        """The lengths in slices of at most WRITE_CHUNK: the offsets of a whole part at once would take
        8 more bytes per document."""
        for lengths in self.lengths:
            for start in range(0, len(lengths), WRITE_CHUNK):
                yield lengths[start:start + WRITE_CHUNK]

    def __enter__(self) -> "AtomicIndexedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.data_file.close()
        self.tmp_bin.unlink(missing_ok=True)
        self.tmp_idx.unlink(missing_ok=True)


@dataclass(frozen=True)
class IndexSummary:
    dtype: np.dtype
    sequence_lengths: np.ndarray   # tokens per sequence (what GPTDataset calls a document), EOD included;
                                   # int32, memory-mapped from the .idx
    sequence_pointers: np.ndarray  # each sequence's byte offset in the .bin; int64, memory-mapped

    def tokens_between(self, begin: int, end: int) -> int:
        """The tokens of sequences begin..end-1, from the offsets of the first and last (a few bytes read, where
        summing their lengths reads 4 bytes a document)."""
        if end <= begin:
            return 0
        start, last = int(self.sequence_pointers[begin]), int(self.sequence_pointers[end - 1])
        return (last - start) // self.dtype.itemsize + int(self.sequence_lengths[end - 1])

    @property
    def tokens(self) -> int:
        return self.tokens_between(0, len(self.sequence_lengths))


def read_header(prefix: str | Path) -> tuple[np.dtype, int, int]:
    """(token dtype, sequences, documents + 1) from <prefix>.idx's header: megatron's _IndexReader's checks."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    with open(idx_path(prefix), "rb") as stream:
        fields = struct.unpack(INDEX_HEADER_FORMAT, stream.read(INDEX_HEADER_BYTES))
    header, version, code, sequences, documents = fields
    if header != _INDEX_HEADER or version != 1:
        raise ValueError(f"bad header or version {version}")
    return np.dtype(DType.dtype_from_code(code)), sequences, documents


def sequence_lengths(prefix: str | Path, sequences: int) -> np.ndarray:
    """The int32 tokens per sequence of <prefix>.idx, memory-mapped: 4 bytes a document stay on disk
    (6 GB for a 1T-token corpus, on every rank that checks it)."""
    return np.memmap(idx_path(prefix), dtype=np.int32, mode="r", offset=INDEX_HEADER_BYTES, shape=(sequences,))


def sequence_pointers(prefix: str | Path, sequences: int) -> np.ndarray:
    """The int64 byte offsets of <prefix>.idx's sequences in its .bin, memory-mapped (after the lengths)."""
    return np.memmap(idx_path(prefix), dtype=np.int64, mode="r", offset=INDEX_HEADER_BYTES + 4 * sequences,
                     shape=(sequences,))


def token_count(prefix: str | Path) -> int:
    """The tokens of <prefix>.bin from its size and the token width its .idx header names: read_index's
    `tokens` for a prefix it accepted, without reading an index of a token count per document."""
    return bin_path(prefix).stat().st_size // read_header(prefix)[0].itemsize


def refuse_unprepared(prefix: str | Path, key: str = "data.prefix") -> None:
    """<prefix>.bin and <prefix>.idx are there, else a DataError naming `key` (a check as cheap as a stat)."""
    missing = [str(p) for p in (bin_path(prefix), idx_path(prefix)) if not p.is_file()]
    if missing:
        relative = "" if Path(prefix).is_absolute() else (
            f" (a relative prefix is read from the current directory, {Path.cwd()}: run where the config was made "
            "for, or give the data's path)")
        raise DataError(f"{key}: {' and '.join(missing)} not found{relative}; prepare the data first: "
                        f"megadiff prepare-data CONFIG (with data.prefix={prefix})")


def _readable_header(prefix: str | Path, key: str) -> tuple[np.dtype, int]:
    """(token dtype, sequences) of <prefix>.idx, whose files are there, whose header is megatron's and whose size
    holds the arrays that header describes (a check of a few bytes)."""
    idx_file = idx_path(prefix)
    refuse_unprepared(prefix, key)
    try:
        dtype, sequences, documents = read_header(prefix)
        described = INDEX_HEADER_BYTES + 12 * sequences + 8 * documents  # lengths, offsets, document indices
        if idx_file.stat().st_size < described:
            raise ValueError(f"{idx_file.stat().st_size} bytes, fewer than the {described} its header describes")
    except (ValueError, OSError, struct.error) as err:
        raise _unreadable(prefix, key, err) from None
    return dtype, sequences


def _unreadable(prefix: str | Path, key: str, why: Exception | str) -> DataError:
    return DataError(f"{key}: {idx_path(prefix)} is not a readable megatron index ({why}); re-run prepare-data")


def _refuse_another_bin(prefix: str | Path, key: str, expected: int) -> None:
    """<prefix>.bin holds `expected` bytes, what its .idx describes."""
    actual = bin_path(prefix).stat().st_size
    if actual != expected:
        raise DataError(f"{key}: {idx_path(prefix)} describes {expected} bytes of tokens but {bin_path(prefix)} holds "
                        f"{actual}: the two files do not belong together; re-run prepare-data")


def open_index(prefix: str | Path, key: str = "data.prefix") -> IndexSummary:
    """<prefix>.idx, checked by reading a few bytes: the files are there, the .idx is megatron's, and the .bin ends
    where its last document does (by its offset and length), which a copy cut short or a .bin of other data does
    not. What a rank that leaves read_index to another one checks of its own files, and what a start reads of data
    read_index passed before."""
    dtype, sequences = _readable_header(prefix, key)
    summary = IndexSummary(dtype, sequence_lengths(prefix, sequences), sequence_pointers(prefix, sequences))
    _refuse_another_bin(prefix, key, summary.tokens * dtype.itemsize)
    return summary


def read_index(prefix: str | Path, key: str = "data.prefix") -> IndexSummary:
    """open_index, and every document's length read (4 bytes a document, GBs for a large corpus): none negative,
    and the .bin holds exactly the tokens they add up to."""
    summary = open_index(prefix, key)
    lengths = summary.sequence_lengths
    if len(lengths) and lengths.min() < 0:  # lengths that still add up to the .bin's size would be misread silently
        raise _unreadable(prefix, key, f"a negative document length ({int(lengths.min())})")
    _refuse_another_bin(prefix, key, int(lengths.sum(dtype=np.int64)) * summary.dtype.itemsize)
    return summary
