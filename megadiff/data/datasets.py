"""Training datasets: megatron-core's GPTDataset over the prepared prefixes, split and blended.

`build_datasets` returns (train, valid, test): megatron datasets whose items are dicts of
`tokens`, `labels` (tokens shifted by one), `loss_mask` and `position_ids`, each
model.seq_length long (no attention mask: the model applies a causal one). A split whose
data.split weight is 0, or of which no sample is asked, comes back as None. The
document/sample/shuffle indices are cached under <data.cache_dir>/indices, named by a hash that
covers the prepared files' sizes and manifest (data/prepared_dataset.py), so data prepared again
gets new ones.
A blend of prefixes without weights is weighted by their tokens.

Under torch.distributed every rank must call it: megatron builds the index cache on rank 0,
then the other ranks load it after a barrier (so data.cache_dir must be shared by all nodes).
It runs `check_training_data` first (on rank 0, for every rank), so bad data fails before any index is built.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

from megadiff.config import Config, DataConfig
from megadiff.config.loader import saved_config
from megadiff.data.checks import SPLITS, check_training_data_once
from megadiff.data.errors import DataError
from megadiff.data.indexed import token_count
from megadiff.data.locations import index_cache_dir, training_blend
from megadiff.data.prepared_dataset import PreparedGPTDataset, megatron_tokenizer
from megadiff.data.responses import ResponseMaskedGPTDataset
from megadiff.data.tokenizers import Tokenizer
from megadiff.data.upsampling import LengthUpsampledGPTDataset, LengthUpsampledGPTDatasetConfig
from megadiff.files import exclusive_lock, written_atomically

__all__ = ["build_datasets", "source_config", "source_names", "sources_read_again"]


def megatron_blend(data: DataConfig) -> tuple[list[str], Optional[list[float]]]:
    """training_blend(data) as megatron must get it. Without weights megatron reads each prefix of
    a blend once and stops the blend at the end of the shortest, however many samples were asked
    for: several prefixes without weights are weighted by their tokens instead."""
    prefixes, weights = training_blend(data)
    if weights is None and len(prefixes) > 1:
        weights = [float(token_count(prefix)) for prefix in prefixes]
    return prefixes, weights


def build_datasets(cfg: Config, tokenizer: Tokenizer, num_samples: tuple[int, int, int], seed: int,
                   is_built_on_rank: Callable[[], bool] = lambda: True):
    """(train, valid, test) with at least num_samples[i] samples each (None where it or data.split's weight is 0)."""
    # megatron would loop forever on a split without tokens
    check_training_data_once(cfg, tokenizer, [name for name, wanted in zip(SPLITS, num_samples) if wanted])
    data = cfg.data
    blend = megatron_blend(data)
    options = dict(
        random_seed=seed, sequence_length=cfg.model.seq_length, blend=blend, split=data.split,
        path_to_cache=str(index_cache_dir(data)), tokenizer=megatron_tokenizer(tokenizer),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
    )
    if data.length_upsampling:
        unit = data.length_upsampling_unit or cfg.model.seq_length
        dataset_cls, config = (LengthUpsampledGPTDataset,
                               LengthUpsampledGPTDatasetConfig(length_upsampling_unit=unit, **options))
    else:
        dataset_cls = ResponseMaskedGPTDataset if data.masks_loss else PreparedGPTDataset
        config = GPTDatasetConfig(**options)
    # a split none of whose samples is asked for is left out: megatron would index a whole epoch of it
    config.split_matrix = [bounds if wanted else None for bounds, wanted in zip(config.split_matrix, num_samples)]
    with _lone_process_is_rank_zero(), _building_alone(data), _index_cache_arrays_only():
        datasets = BlendedMegatronDatasetBuilder(dataset_cls, list(num_samples), is_built_on_rank, config).build()
    _check_sizes(datasets, num_samples, "data.blend" if data.blend else "data.prefix")
    return tuple(datasets)


def _check_sizes(datasets: list, num_samples: tuple[int, int, int], key: str) -> None:
    """Every split built holds the samples asked for: a shorter one would end training with an
    IndexError partway through."""
    for name, dataset, wanted in zip(SPLITS, datasets, num_samples):
        if dataset is not None and len(dataset) < wanted:
            raise DataError(f"{key}: the {name} split was built with {len(dataset):,} samples, fewer than the "
                            f"{wanted:,} asked for (train.iters or train.eval_iters times train.global_batch_size): "
                            "training would stop partway with an IndexError; lower those, or give the blend weights")


def sources_read_again(dataset) -> list[tuple[str, int, int]]:
    """(prefix, samples read of it, distinct samples its split's documents give) of each source of `dataset` (a
    split build_datasets built) read for more samples than one pass gives: megatron shuffles a second pass in, so
    some of its documents are read twice (or more) and others once. Length-upsampled sources repeat by design."""
    found = []
    for part, read in _samples_read(dataset):
        if isinstance(part, LengthUpsampledGPTDataset):
            continue
        extra = part.config.add_extra_token_to_sequence  # a sample reads seq_length + 1 tokens
        distinct = (part._get_num_tokens_per_epoch() - extra) // part.config.sequence_length
        if read > distinct:
            found.append((part.dataset_path, read, distinct))
    return found


def _samples_read(dataset) -> list[tuple[object, int]]:
    """(source, samples of it read) of a split: a BlendedDataset's reads counted from its index, not its sources'
    sizes, which megatron makes 0.5% larger than their shares (a share of exactly one pass is read once)."""
    if not hasattr(dataset, "dataset_index"):
        return [(dataset, dataset.num_samples)]
    reads = _samples_per_source(dataset.dataset_index, dataset.dataset_sample_index, len(dataset.datasets))
    return list(zip(dataset.datasets, reads))


# entries of a blend's dataset index read at a time, from its end
BLEND_INDEX_CHUNK = 1 << 20


def _samples_per_source(dataset_index, dataset_sample_index, sources: int) -> list[int]:
    """The samples a blend reads of each of its sources. megatron numbers a source's samples 0, 1, 2, ... in the
    order the blend reads them, so a source's count is one more than the number at its last place: the index is
    read back from its end until every source's last place is found (about a sample per source's share; counting
    the whole index read 2 bytes a sample, 0.5 GB at 1T tokens in 4K windows, at every start)."""
    reads, end = [0] * sources, len(dataset_index)
    unseen = set(range(sources))
    while unseen and end > 0:
        start = max(end - BLEND_INDEX_CHUNK, 0)
        found, from_end = numpy.unique(numpy.asarray(dataset_index[start:end])[::-1], return_index=True)
        for source, offset in zip(found.tolist(), from_end.tolist()):
            if source in unseen:
                unseen.discard(source)
                reads[source] = int(dataset_sample_index[end - 1 - offset]) + 1
        end = start
    return reads


def source_config(cfg: Config, prefix: str) -> Config:
    """`cfg` reading only `prefix` (one source of a blend), split as the blend splits it. `cfg` was checked
    as a whole already; checking it again would refuse a one-process evaluation of a run's checkpoint whose
    training layout does not fit the evaluated length (context or sequence parallelism at --seq-length)."""
    return saved_config(cfg.model_dump(mode="json"), [f"data.prefix={prefix}", "data.blend=[]"])


def source_names(prefixes: list[str]) -> list[str]:
    """Short names for a blend's prefixes in metrics: their file names, numbered where two share one."""
    names = [Path(prefix).name for prefix in prefixes]
    return [f"{name}-{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _building_alone(data: DataConfig) -> contextlib.AbstractContextManager:
    """Rank 0, which writes megatron's index cache, builds holding the cache's lock: another job sharing
    data.cache_dir (started at the same moment, or while this one writes) took files that exist for whole ones
    and read them torn ("mmap length is greater than file size"), or wrote them again in place under this one.
    The job's other ranks read after rank 0, within megatron's build: they take no lock."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return contextlib.nullcontext()
    return exclusive_lock(index_cache_dir(data) / ".build.lock", "another job building the data's index cache")


NPY_MAGIC = b"\x93NUMPY"


def _load_index_array(load: Callable, file, *args, **kwargs):
    """numpy.load of a cached index: a .npy array, never a pickle."""
    with open(file, "rb") as stream:
        if stream.read(len(NPY_MAGIC)) != NPY_MAGIC:
            raise DataError(f"{file} is no .npy array (a pickle or another file, not read: it could run code): "
                            "remove it, and the build writes it again")
    return load(file, *args, **{**kwargs, "allow_pickle": False})


def _save_index_array(save: Callable, file, *args, **kwargs) -> None:
    """numpy.save of an index array under its name only once whole: megatron writes each in place, so a rank 0
    killed while writing (a lost node, a time limit's SIGKILL) left a cut array that every later run on the cache
    took for whole ("mmap length is greater than file size"), and another job's rank 0 on another node, whose lock
    on the cache holds nothing there (a shared filesystem without cluster-wide flock), read it torn."""
    with written_atomically(file) as out:
        save(out, *args, **kwargs)


@contextlib.contextmanager
def _index_cache_arrays_only() -> Iterator[None]:
    """megatron reads its index cache with numpy.load(allow_pickle=True), which unpickles a file that is no .npy
    array: one put in a data.cache_dir that jobs, nodes or people share ran its code in every process that read
    it. The cache holds integer arrays only, which load without pickle (numpy.save writes them without); they are
    written whole or not at all (_save_index_array)."""
    load, save = numpy.load, numpy.save
    numpy.load = lambda file, *args, **kwargs: _load_index_array(load, file, *args, **kwargs)
    numpy.save = lambda file, *args, **kwargs: _save_index_array(save, file, *args, **kwargs)
    try:
        yield
    finally:
        numpy.load, numpy.save = load, save


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
