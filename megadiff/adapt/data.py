"""Adaptation data: local text / JSON-lines files, tokenized with the model's own tokenizer,
packed into fixed-length sequences, read in a seeded order.

Documents are tokenized without special tokens and each is followed by the tokenizer's EOS;
the token stream is cut into `seq_length` pieces (the tail of each map batch of documents is
dropped, as in transformers' run_clm). The order is one seeded permutation per epoch, so the
sample behind any (iteration, micro-step, rank) is a pure function of those numbers: resuming
at iteration k reads exactly what an uninterrupted run would have read.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from megadiff.adapt.settings import JSON_SUFFIXES, DataSection
from megadiff.config import ConfigError


def _load_documents(files: list[str], text_key: str, cache_dir: Optional[str]):
    """One datasets.Dataset with a 'text' column, files in the given order."""
    from datasets import concatenate_datasets, load_dataset

    parts = []
    for i, name in enumerate(files):
        if name.endswith(JSON_SUFFIXES):
            part = load_dataset("json", data_files=name, split="train", cache_dir=cache_dir)
            if text_key not in part.column_names:
                raise ConfigError(f"data.text_key: {text_key!r} is not a field of {name} "
                                  f"(fields: {part.column_names})")
            part = part.select_columns([text_key])
            if text_key != "text":
                part = part.rename_column(text_key, "text")
        else:
            part = load_dataset("text", data_files=name, split="train", sample_by="document", cache_dir=cache_dir)
        parts.append(part)
    return concatenate_datasets(parts)


def build_packed_dataset(data: DataSection, tokenizer):
    """datasets.Dataset of `input_ids` rows, each exactly data.seq_length tokens."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("model.tokenizer: the tokenizer has no eos token to separate documents")
    seq_length = data.seq_length

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + [eos] for row in ids]}

    def pack(batch):
        stream = [token for row in batch["input_ids"] for token in row]
        usable = len(stream) - len(stream) % seq_length
        return {"input_ids": [stream[i:i + seq_length] for i in range(0, usable, seq_length)]}

    documents = _load_documents(data.files, data.text_key, data.cache_dir)
    tokens = documents.map(tokenize, batched=True, remove_columns=["text"], desc="tokenizing",
                           num_proc=data.workers if data.workers > 1 else None)  # rows keep their order
    packed = tokens.map(pack, batched=True, desc=f"packing into {seq_length}-token sequences")
    if len(packed) == 0:
        raise ConfigError(f"data.files: fewer than data.seq_length={seq_length} tokens in {data.files}")
    return packed.with_format("torch")


class SampleOrder:
    """Global sample number -> dataset row: epoch e reads permutation(seed + e)."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows = num_rows
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def row(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_rows)
        if epoch not in self._cache:
            self._cache = {epoch: np.random.default_rng(self.seed + epoch).permutation(self.num_rows)}
        return int(self._cache[epoch][position])


class BatchReader:
    """Micro-batches for (iteration, micro-step) on this rank: global sample numbers
    ((i * grad_accum + m) * world + rank) * micro_batch + j, i the 0-based iteration.
    `document_eos`: the EOS its documents end with when attention is masked by document."""

    def __init__(self, dataset, seed: int, micro_batch: int, grad_accum: int, rank: int, world: int,
                 document_eos: int | None = None):
        self.dataset = dataset
        self.document_eos = document_eos
        self.order = SampleOrder(len(dataset), seed)
        self.micro_batch, self.grad_accum, self.rank, self.world = micro_batch, grad_accum, rank, world

    def _rows(self, first_sample: int) -> torch.Tensor:
        rows = [self.order.row(first_sample + j) for j in range(self.micro_batch)]
        return torch.stack([self.dataset[r]["input_ids"] for r in rows])

    def micro_batch_at(self, iteration: int, micro_step: int) -> torch.Tensor:
        slot = (iteration * self.grad_accum + micro_step) * self.world + self.rank
        return self._rows(slot * self.micro_batch)

    def calibration_batches(self, count: int) -> list[torch.Tensor]:
        """The first `count` micro-batches of the order, the same on every rank."""
        return [self._rows(i * self.micro_batch) for i in range(count)]
