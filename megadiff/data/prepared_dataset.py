"""megatron's GPTDataset over one prepared prefix, its index cache keyed by that prefix's own files.

megatron names a dataset's cached indices by a hash of its path, sample count, split and config (the
tokenizer's identifiers among them), nothing of the data: data prepared again under the same prefix
would reuse indices built for the old files. Each dataset here hands megatron a tokenizer view that
also holds a digest of its own prefix's files, so preparing one prefix of a blend again rebuilds that
prefix's indices (and the blend's) but not its neighbours' (a 1T-token prefix's take minutes), and a
cache's description stays a few lines whatever the number of prefixes and of their source files.
"""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, replace

from megatron.core.datasets.gpt_dataset import GPTDataset

from megadiff.data.indexed import bin_path, idx_path
from megadiff.data.manifest import read_manifest, tokenizer_identity
from megadiff.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class MegatronTokenizerView:
    """What megatron's datasets read from a tokenizer; unique_identifiers enters their cache hash."""
    vocab_size: int
    eod: int
    unique_identifiers: dict

    def for_prefix(self, prefix: str) -> MegatronTokenizerView:
        return replace(self, unique_identifiers={**self.unique_identifiers, "data": prepared_files_digest(prefix)})


def megatron_tokenizer(tokenizer: Tokenizer) -> MegatronTokenizerView:
    """The tokenizer by what it is, not where it is: named by its directory's path, a node reading its own copy
    (data.tokenizer may be node-local) at another path looked for index files of another name than those rank 0
    built, and failed with a FileNotFoundError."""
    identity = tokenizer_identity(tokenizer.name) or tokenizer.name  # a packaged encoding's: its name, as before
    return MegatronTokenizerView(tokenizer.vocab_size, tokenizer.eod,
                                 {"name": identity, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod})


def prepared_files_digest(prefix: str) -> str:
    """A digest of the sizes of <prefix>.bin/.idx and of what its manifest says they were made from:
    alike on every node (a copy of the files keeps both, not their modification times), other for data
    prepared again."""
    manifest = read_manifest(prefix) or {}
    identity = {"bytes": [path.stat().st_size for path in (bin_path(prefix), idx_path(prefix))],
                "made_from": manifest.get("fingerprint")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class PreparedGPTDataset(GPTDataset):
    """GPTDataset whose cache hash covers its prefix's files (`config.tokenizer`: a MegatronTokenizerView)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config) -> None:
        config = copy.copy(config)  # every dataset of a blend shares it
        config.tokenizer = config.tokenizer.for_prefix(dataset_path)
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # megatron reads the split's documents only to build its indices, done now: kept as the range its builder
        # gave, not as its array of 4 bytes a document (8 GB for a 1T-token corpus, on every rank, for the whole run)
        self.indices = range(int(self.indices[0]), int(self.indices[-1]) + 1) if len(self.indices) else range(0)

    def _get_num_tokens_per_epoch(self) -> int:
        """The split's tokens, from the offsets of its first and last documents (megatron's builder gives a split
        the range of its documents): megatron sums a copy of their lengths, 4 bytes a document (8 GB
        for a 1T-token corpus), on the rank building the indices and, for sources_read_again, at each start."""
        if not len(self.indices):
            return 0
        first, last = int(self.indices[0]), int(self.indices[-1])
        index = self.dataset.index
        (start, _, _), (end, length, _) = index[first], index[last]  # byte offsets, tokens
        return int(end - start) // index.dtype_size + int(length)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        # data.split fixes the bounds; the split matrix also says which other splits a build asks for
        # (build_datasets leaves out those it asks nothing of), which must not name other index files
        return [key for key in GPTDataset._key_config_attributes() if key != "split_matrix"]
