"""Length up-sampling for long-context training (DIFF paper 3.3, after Fu et al. 2024).

Each document of a split is repeated max(1, round(length / unit)) times per epoch before
megatron shuffles its document index (unit = data.length_upsampling_unit, default
model.seq_length). A document k units long is thus drawn k times as often as a document one
unit long: its sampling frequency is proportional to its length. Documents shorter than
half a unit are kept once, never dropped, so with the default unit only documents that fill
more than a training window are up-sampled, and an epoch grows by about tokens / unit
document entries. Blending and splitting are unchanged (the split still divides documents).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megadiff.data.prepared_dataset import PreparedGPTDataset


def length_repeats(lengths: np.ndarray, unit: int) -> np.ndarray:
    """How many times each document appears per epoch (round half up, at least once): floor(n / unit + 1/2)
    in integers, with no float copy of the lengths."""
    return np.maximum(1, (2 * np.asarray(lengths, dtype=np.int64) + unit) // (2 * unit))


@dataclass
class LengthUpsampledGPTDatasetConfig(GPTDatasetConfig):
    length_upsampling_unit: int = 0
    """Tokens per repeat; required (the default only satisfies dataclass field ordering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.length_upsampling_unit > 0, "length_upsampling_unit must be set"


class LengthUpsampledGPTDataset(PreparedGPTDataset):
    """megatron's GPTDataset over a split whose documents are repeated by `length_repeats`."""

    _upsampled = False

    def _get_num_tokens_per_epoch(self) -> int:
        # megatron asks this first when it builds the indices (on one rank, on a cache miss), and never
        # otherwise: only the building rank makes the repeated document list (1.5e9 documents of a 1T-
        # token corpus: some 30 GB while it is made), every other rank loads the cached indices
        if not self._upsampled:
            repeats = length_repeats(self.dataset.sequence_lengths[self.indices], self.config.length_upsampling_unit)
            self.indices, self._upsampled = np.repeat(self.indices, repeats), True
        return GPTDataset._get_num_tokens_per_epoch(self)  # repeated documents: no range, summed one by one

    def _build_document_sample_shuffle_indices(self):
        split_documents = self.indices
        try:
            return super()._build_document_sample_shuffle_indices()
        finally:  # the repeated list is let go once the indices are built
            self.indices, self._upsampled = split_documents, False

    @staticmethod
    def _key_config_attributes() -> list[str]:
        # the unit changes the indices, so it belongs in the hash that names their cache files
        return PreparedGPTDataset._key_config_attributes() + ["length_upsampling_unit"]
