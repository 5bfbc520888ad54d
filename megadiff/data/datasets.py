"""Training datasets: megatron-core's GPTDataset over the prepared prefixes, split and blended.

`build_datasets` returns (train, valid, test): megatron datasets whose items are dicts of
`tokens`, `labels` (tokens shifted by one), `loss_mask` and `position_ids`, each
model.seq_length long (no attention mask: the model applies a causal one). A split whose
data.split weight is 0 comes back as None. Sample order depends only on the seed; the
document/sample/shuffle indices are cached under <data.cache_dir>/indices.

Under torch.distributed every rank must call it: megatron builds the index cache on rank 0,
then the other ranks load it after a barrier (so data.cache_dir must be shared by all nodes).
It runs `check_training_data` first, so bad data fails before any index is built.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megadiff.config import Config, build_config
from megadiff.data.checks import check_training_data
from megadiff.data.locations import index_cache_dir, training_blend
from megadiff.data.responses import ResponseMaskedGPTDataset
from megadiff.data.tokenizers import Tokenizer
from megadiff.data.upsampling import LengthUpsampledGPTDataset, LengthUpsampledGPTDatasetConfig

__all__ = ["MegatronTokenizerView", "build_datasets", "megatron_tokenizer", "source_config", "source_names"]


@dataclass(frozen=True)
class MegatronTokenizerView:
    """What megatron's datasets read from a tokenizer; unique_identifiers enters their cache hash."""
    vocab_size: int
    eod: int
    unique_identifiers: dict


def megatron_tokenizer(tokenizer: Tokenizer) -> MegatronTokenizerView:
    return MegatronTokenizerView(tokenizer.vocab_size, tokenizer.eod,
                                 {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod})


def build_datasets(cfg: Config, tokenizer: Tokenizer, num_samples: tuple[int, int, int], seed: int,
                   is_built_on_rank: Callable[[], bool] = lambda: True):
    """(train, valid, test) with at least num_samples[i] samples each (None where data.split gives 0)."""
    check_training_data(cfg, tokenizer)  # megatron would loop forever on a split without tokens
    data = cfg.data
    options = dict(
        random_seed=seed, sequence_length=cfg.model.seq_length, blend=training_blend(data), split=data.split,
        path_to_cache=str(index_cache_dir(data)), tokenizer=megatron_tokenizer(tokenizer),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
    )
    if data.length_upsampling:
        unit = data.length_upsampling_unit or cfg.model.seq_length
        dataset_cls, config = (LengthUpsampledGPTDataset,
                               LengthUpsampledGPTDatasetConfig(length_upsampling_unit=unit, **options))
    else:
        dataset_cls = ResponseMaskedGPTDataset if data.masks_loss else GPTDataset
        config = GPTDatasetConfig(**options)
    with _lone_process_is_rank_zero():
        train, valid, test = BlendedMegatronDatasetBuilder(dataset_cls, list(num_samples), is_built_on_rank,
                                                           config).build()
    return train, valid, test


def source_config(cfg: Config, prefix: str) -> Config:
    """`cfg` reading only `prefix` (one source of a blend), split as the blend splits it."""
    return build_config(cfg.model_dump(mode="json"), [f"data.prefix={prefix}", "data.blend=[]"])


def source_names(prefixes: list[str]) -> list[str]:
    """Short names for a blend's prefixes in metrics: their file names, numbered where two share one."""
    names = [Path(prefix).name for prefix in prefixes]
    return [f"{name}-{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


@contextlib.contextmanager
def _lone_process_is_rank_zero() -> Iterator[None]:
    """Without a process group, let torch.distributed.get_rank() answer 0 while megatron builds.

    megatron-core 0.16.1's BlendedDataset calls it on an index-cache miss even when no process
    group exists (its GPTDataset checks is_initialized() first), so a blend could not be built
    in a lone process (a notebook, a tool, a test) without this.
    """
    if torch.distributed.is_initialized():
        yield
        return
    get_rank = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = get_rank
