"""Which samples each data-parallel rank reads at each iteration, resumable from a sample count.

Global batch g covers dataset samples [g * GBS, (g + 1) * GBS); data-parallel rank r reads the
r-th contiguous slice of it, in micro-batches. The position is the number of consumed samples,
so a resumed run (same global batch size) reads exactly what the uninterrupted run would have,
whatever the data-parallel size. Every pipeline stage and tensor-parallel rank of one
data-parallel rank reads the same micro-batches.
"""
from __future__ import annotations

import math
import socket
from functools import partial
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from megadiff.data.errors import DataError
from megadiff.helper_processes import ignore_preemption_signals, socket_directory
from megadiff.models.documents import document_cu_seqlens

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class MicroBatchSampler(Sampler[list[int]]):
    def __init__(self, total_samples: int, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        per_rank = global_batch_size // data_parallel_size
        if per_rank * data_parallel_size != global_batch_size or per_rank % micro_batch_size:
            raise ValueError(f"global batch {global_batch_size} does not split into micro-batches of "
                             f"{micro_batch_size} over {data_parallel_size} data-parallel ranks")
        if consumed_samples % global_batch_size:
            raise ValueError(f"resuming at {consumed_samples} consumed samples, which is not a whole number of "
                             f"global batches of {global_batch_size}: keep train.global_batch_size when resuming")
        self.total, self.start = total_samples, consumed_samples
        self.global_batch, self.micro_batch, self.per_rank = global_batch_size, micro_batch_size, per_rank
        self.rank = data_parallel_rank

    def __len__(self) -> int:
        return (self.total - self.start) // self.global_batch * (self.per_rank // self.micro_batch)

    def __iter__(self) -> Iterator[list[int]]:
        for batch_start in range(self.start, self.total - self.global_batch + 1, self.global_batch):
            mine = batch_start + self.rank * self.per_rank
            for micro_start in range(mine, mine + self.per_rank, self.micro_batch):
                yield list(range(micro_start, micro_start + self.micro_batch))


def _collate(samples: list[dict], document_eod: int | None) -> dict[str, torch.Tensor]:
    batch = {key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]) for key in BATCH_KEYS}
    if document_eod is not None:
        batch["cu_seqlens"] = document_cu_seqlens(batch["tokens"], document_eod)
    return batch


def micro_batch_loader(dataset, sampler: MicroBatchSampler, num_workers: int = 0,
                       document_eod: int | None = None, micro_batches_per_step: int = 1) -> DataLoader:
    """Micro-batches of BATCH_KEYS; with `document_eod`, also the "cu_seqlens" of their documents.

    Workers read a whole step's micro-batches ahead, so the next step's are ready when it starts (a
    step takes them all at once: with torch's default of two per worker, the rest were read while
    the GPU waited)."""
    ahead = max(2, math.ceil(micro_batches_per_step / num_workers)) if num_workers else None
    if num_workers:
        socket_directory()  # the workers hand each batch's shared memory over a socket there
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=partial(_collate, document_eod=document_eod),
                      num_workers=num_workers, pin_memory=torch.cuda.is_available(), prefetch_factor=ahead,
                      persistent_workers=num_workers > 0, worker_init_fn=ignore_preemption_signals)


def check_token_ids(batch: dict[str, torch.Tensor], vocab_size: int) -> None:
    """Ids outside the vocabulary, read from a damaged .bin: the embedding's IndexError (a device-side assert on
    a GPU), or, in the padded rows, no error at all. Checked here, in the training process: from a loader's
    worker the refusal came wrapped in the worker's traceback."""
    for key in ("tokens", "labels"):
        low, high = torch.aminmax(batch[key])
        if low < 0 or high >= vocab_size:
            raise DataError(f"data: token id {int(low if low < 0 else high)} in a micro-batch {socket.gethostname()} "
                            f"read, outside model.vocab_size ({vocab_size}): the prepared .bin this node reads is "
                            "damaged, or not the one the others read")


class IterationBatches:
    """Hands out one iteration's micro-batches, once per model chunk (the interleaved schedule
    pulls each micro-batch through every virtual stage)."""

    def __init__(self, loader: DataLoader, num_microbatches: int, num_chunks: int, vocab_size: int):
        self._source = iter(loader)
        self.num_microbatches, self.num_chunks, self.vocab_size = num_microbatches, num_chunks, vocab_size

    def close(self) -> None:
        """Stops the loader's workers. They ignore SIGTERM (preemption signals reach them too), and at the
        interpreter's exit multiprocessing terminates its children, then joins them: a loader still held there
        (by an error's traceback) hung the process forever. torch has no public call for it."""
        shutdown = getattr(self._source, "_shutdown_workers", None)  # absent without workers
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> "IterationBatches":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def next_iteration(self):
        batches = [next(self._source) for _ in range(self.num_microbatches)]
        for batch in batches:
            check_token_ids(batch, self.vocab_size)
        if torch.cuda.is_available():  # cu_seqlens stays on the host: attention slices documents by it
            batches = [{k: v if k == "cu_seqlens" else v.cuda(non_blocking=True) for k, v in b.items()}
                       for b in batches]
        iterators = [iter(batches) for _ in range(self.num_chunks)]
        return iterators if self.num_chunks > 1 else iterators[0]
