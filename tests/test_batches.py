"""The training loop's micro-batches (training/batches.py): each step's in order, read a step ahead."""
from __future__ import annotations

import multiprocessing
import socket
import time

import psutil
import pytest
import torch

from megadiff.data.errors import DataError
from megadiff.training.batches import BATCH_KEYS, IterationBatches, MicroBatchSampler, micro_batch_loader

MICRO_BATCHES = 8


class CountingSamples(torch.utils.data.Dataset):
    """Sample i holds i; every read counts in memory the loader's workers share."""

    def __init__(self, reads):
        self.reads = reads

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> dict:
        with self.reads.get_lock():
            self.reads.value += 1
        return {key: torch.full((4,), index) for key in BATCH_KEYS}


def _samples(iteration) -> list[int]:
    return [int(batch["tokens"][0, 0]) for batch in iteration]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_read_the_next_step_while_this_one_runs(workers):
    reads = multiprocessing.Value("i", 0)
    sampler = MicroBatchSampler(total_samples=10 * MICRO_BATCHES, consumed_samples=0, global_batch_size=MICRO_BATCHES,
                                micro_batch_size=1, data_parallel_rank=0, data_parallel_size=1)
    loader = micro_batch_loader(CountingSamples(reads), sampler, workers, micro_batches_per_step=MICRO_BATCHES)
    before = set(psutil.Process().children())
    with IterationBatches(loader, MICRO_BATCHES, num_chunks=1, vocab_size=1000) as batches:
        assert _samples(batches.next_iteration()) == list(range(MICRO_BATCHES))
        loader_workers = set(psutil.Process().children()) - before
        assert len(loader_workers) == workers
        deadline = time.monotonic() + 10  # the step's compute, during which the workers read on
        while reads.value < 2 * MICRO_BATCHES and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reads.value >= 2 * MICRO_BATCHES, "the next step's micro-batches were not all read ahead"
        assert _samples(batches.next_iteration()) == list(range(MICRO_BATCHES, 2 * MICRO_BATCHES))
    # they ignore SIGTERM: left to the interpreter's exit, multiprocessing waited for them forever
    assert not any(worker.is_running() for worker in loader_workers), "the loader's workers outlived it"


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("bad", [-1, 512])
def test_ids_outside_the_vocabulary_are_refused_naming_the_node(bad, workers):
    """Read from a damaged .bin on one node: the embedding's IndexError (a device-side assert on a GPU), or in the
    vocabulary's padded rows no error at all. The refusal is the message alone, with a loader's workers too."""
    sampler = MicroBatchSampler(total_samples=4, consumed_samples=0, global_batch_size=2, micro_batch_size=1,
                                data_parallel_rank=0, data_parallel_size=1)
    with IterationBatches(micro_batch_loader(Damaged(bad), sampler, workers), 2, 1, vocab_size=512) as batches:
        assert [batch["tokens"].shape for batch in batches.next_iteration()] == [(1, 4)] * 2
        with pytest.raises(DataError) as refused:
            batches.next_iteration()
    assert str(refused.value) == (f"data: token id {bad} in a micro-batch {socket.gethostname()} read, outside "
                                  "model.vocab_size (512): the prepared .bin this node reads is damaged, or not the "
                                  "one the others read")


class Damaged(torch.utils.data.Dataset):
    """Four samples, the last with a label outside a 512-id vocabulary."""

    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        sample = {key: torch.arange(4) for key in BATCH_KEYS}
        if index == 3:
            sample["labels"] = torch.tensor([1, 2, 3, self.bad])
        return sample


def _steps(sampler: MicroBatchSampler, micro_batches_per_step: int) -> list[list[int]]:
    """Each step's samples, its micro-batches joined, as one data-parallel rank reads them."""
    micro = list(sampler)
    assert len(micro) == len(sampler)
    return [sum(micro[i:i + micro_batches_per_step], []) for i in range(0, len(micro), micro_batches_per_step)]


@pytest.mark.parametrize("dp, micro_batch_size", [(1, 1), (2, 1), (2, 3), (3, 2), (6, 1)])
@pytest.mark.parametrize("consumed", [0, 12, 24])
def test_data_parallel_ranks_read_their_slices_of_each_global_batch(dp, micro_batch_size, consumed):
    """Global batch g is samples [12g, 12g + 12), rank r its r-th slice, whatever the data-parallel size; a
    resumed run (from `consumed` samples) reads what the uninterrupted one reads from there. 50 samples: the
    last two make no whole global batch and are left."""
    per_rank = 12 // dp
    ranks = [_steps(MicroBatchSampler(50, consumed, 12, micro_batch_size, rank, dp), per_rank // micro_batch_size)
             for rank in range(dp)]
    global_batches = list(range(consumed // 12, 4))
    for rank, steps in enumerate(ranks):
        assert steps == [list(range(12 * g + rank * per_rank, 12 * g + (rank + 1) * per_rank)) for g in global_batches]


@pytest.mark.parametrize("settings, refusal", [
    (dict(global_batch_size=12, micro_batch_size=1, data_parallel_size=5), "global batch 12 does not split"),
    (dict(global_batch_size=12, micro_batch_size=4, data_parallel_size=2), "micro-batches of 4 over 2"),
    (dict(global_batch_size=12, micro_batch_size=1, data_parallel_size=1, consumed_samples=18),
     "resuming at 18 consumed samples, which is not a whole number of global batches of 12"),
])
def test_batch_layouts_that_do_not_split_are_refused(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        MicroBatchSampler(**{"total_samples": 48, "consumed_samples": 0, "data_parallel_rank": 0, **settings})
