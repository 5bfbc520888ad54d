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


def length_repeats(lengths: np.ndarray, unit: int) -> np.ndarray:
    """How many times each document appears per epoch (round half up, at least once)."""
    return np.maximum(1, np.floor(np.asarray(lengths, dtype=np.float64) / unit + 0.5)).astype(np.int64)


@dataclass
class LengthUpsampledGPTDatasetConfig(GPTDatasetConfig):
    length_upsampling_unit: int = 0
    """Tokens per repeat; required (the default only satisfies dataclass field ordering)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.length_upsampling_unit > 0, "length_upsampling_unit must be set"


class LengthUpsampledGPTDataset(GPTDataset):
    """megatron's GPTDataset over a split whose documents are repeated by `length_repeats`."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config) -> None:
        repeats = length_repeats(indexed_dataset.sequence_lengths[indexed_indices], config.length_upsampling_unit)
        super().__init__(indexed_dataset, dataset_path, np.repeat(indexed_indices, repeats), num_samples,
                         index_split, config)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        # the unit changes the indices, so it belongs in the hash that names their cache files
        return GPTDataset._key_config_attributes() + ["length_upsampling_unit"]
