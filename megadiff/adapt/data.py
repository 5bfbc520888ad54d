"""Adaptation data: local text / JSON-lines files, tokenized with the model's own tokenizer,
packed into fixed-length sequences, read in a seeded order.

Documents are tokenized without special tokens (a special token's text in a document is text),
each preceded by what the tokenizer itself puts before a text (its text_start: Llama's BOS; nothing for
GPT-2's or Qwen's) and followed by the tokenizer's EOS; the token stream is cut into `seq_length`
pieces (the tail of each map batch of documents is dropped, as in transformers' run_clm). The
order is one seeded permutation per epoch, so the sample behind any (iteration, micro-step,
rank) is a pure function of those numbers: resuming at iteration k reads exactly what an
uninterrupted run would have read.

With data.messages_key (instruction tuning: DAA on Tulu 3's SFT mixture, Dex on OpenHermes-2.5)
each record's conversation is rendered by the chat template (megadiff/data/conversations.py) and
packed the same way beside a loss mask, and the labels keep the assistant's turns only (-100,
which transformers ignores, elsewhere).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megadiff.adapt.settings import JSON_SUFFIXES, DataSection
from megadiff.config import ConfigError
from megadiff.data.conversations import PROBE, encode_conversation, resolve_chat_template
from megadiff.data.tokenizers import HFTokenizer, document_start
from megadiff.helper_processes import socket_directory


IGNORED_LABEL = -100  # transformers' cross entropy skips these labels


def _load_documents(data: DataSection, column: str):
    """One datasets.Dataset of the records' text (or with data.messages_key, conversation) as a `column` column,
    files in the given order, as prepare-data reads them (data/sources.py: an empty file holds no records; a
    missing field, bytes that are no UTF-8 or a line that is no JSON are refused naming the file). Records
    without the field, or with an empty one, are skipped: they hold no document."""
    from megadiff.data.sources import Source, load_texts, record_fields

    fields = record_fields(data.text_key, messages_key=data.messages_key)
    sources = [Source(f"data.files[{i}]", "json" if name.endswith(JSON_SUFFIXES) else "text", files=(Path(name),))
               for i, name in enumerate(data.files)]
    records = load_texts(sources, fields, data.cache_dir)
    return records.filter(lambda batch: [bool(value) for value in batch[column]], batched=True,
                          desc="skipping records without text")


def build_packed_dataset(data: DataSection, tokenizer):
    """datasets.Dataset of `input_ids` rows (and with data.messages_key, `loss_mask` rows), each
    exactly data.seq_length tokens."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("model.tokenizer: the tokenizer has no eos token to separate documents")
    seq_length = data.seq_length
    conversations = data.messages_key is not None
    # the model's tokenizer as megadiff's conversations read one: no special tokens added, EOS as EOD
    view = HFTokenizer("model.tokenizer", tokenizer)
    template = _chat_template(data, view) if conversations else None

    start = document_start(view)

    def tokenize(batch):  # a special token's text in a document is text, as prepare-data reads it
        ids = tokenizer(batch["text"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return {"input_ids": [start + row + [eos] for row in ids]}

    def tokenize_conversations(batch):
        encoded = [encode_conversation(messages, template, view) for messages in batch["messages"]]
        return {"input_ids": [ids for ids, _ in encoded], "loss_mask": [mask for _, mask in encoded]}

    def pack(batch):
        columns = {}
        for name in batch:
            stream = [token for row in batch[name] for token in row]
            usable = len(stream) - len(stream) % seq_length
            columns[name] = [stream[i:i + seq_length] for i in range(0, usable, seq_length)]
        return columns

    column = "messages" if conversations else "text"
    documents = _load_documents(data, column)
    if data.workers > 1:  # datasets' workers report to a manager, whose socket lies in multiprocess's directory
        import multiprocess  # datasets' own multiprocessing, loaded with it
        socket_directory(multiprocess)
    tokens = documents.map(tokenize_conversations if conversations else tokenize, batched=True,
                           remove_columns=[column], desc="tokenizing",
                           num_proc=data.workers if data.workers > 1 else None)  # rows keep their order
    packed = tokens.map(pack, batched=True, desc=f"packing into {seq_length}-token sequences")
    if len(packed) == 0:
        raise ConfigError(f"data.files: fewer than data.seq_length={seq_length} tokens in {data.files}")
    return packed.with_format("torch")


def _chat_template(data: DataSection, tokenizer: HFTokenizer) -> str:
    """data.chat_template or the tokenizer's own, checked on a short conversation before any tokenizing;
    refused with document masking where it ends turns with the EOS."""
    template = resolve_chat_template(data, tokenizer)
    ids, _ = encode_conversation(PROBE, template, tokenizer)
    if data.document_masking and tokenizer.eod in ids[:-1]:
        raise ConfigError(f"data.document_masking: the chat template ends turns with the tokenizer's EOS "
                          f"({tokenizer.hf.eos_token!r}), so document masking would cut each conversation at every "
                          "turn; set data.document_masking=false")
    return template


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
    first + ((i * grad_accum + m) * world + rank) * micro_batch + j, i the 0-based iteration, first 0 but in a
    rerun that reads with another global batch than its checkpoint's run (see resume_at).
    `document_eos`: the EOS its documents end with when attention is masked by document."""

    def __init__(self, dataset, seed: int, micro_batch: int, grad_accum: int, rank: int, world: int,
                 document_eos: int | None = None):
        self.dataset = dataset
        self.document_eos = document_eos
        self.order = SampleOrder(len(dataset), seed)
        self.micro_batch, self.grad_accum, self.rank, self.world = micro_batch, grad_accum, rank, world
        self.global_batch = micro_batch * grad_accum * world
        self._first = 0

    def resume_at(self, iteration: int, samples_read: int) -> None:
        """Iteration `iteration` (0-based) reads on from sample `samples_read`, the count its checkpoint's run
        had read: a rerun with another global batch (another micro-batch size or grad_accum, on as many ranks:
        resume.py) neither skips nor reads again the samples after it, which iteration x its own global batch
        would."""
        self._first = samples_read - iteration * self.global_batch

    def samples_read(self, iterations: int) -> int:
        """The samples read by the end of the first `iterations` iterations."""
        return self._first + iterations * self.global_batch

    def _rows(self, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of the micro-batch from `first_sample` on: labels are the ids, but
        where a loss mask leaves a token out."""
        rows = [self.dataset[self.order.row(first_sample + j)] for j in range(self.micro_batch)]
        input_ids = torch.stack([row["input_ids"] for row in rows])
        if "loss_mask" not in rows[0]:
            return input_ids, input_ids
        kept = torch.stack([row["loss_mask"] for row in rows]).bool()
        return input_ids, input_ids.masked_fill(~kept, IGNORED_LABEL)

    def micro_batch_at(self, iteration: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) [micro_batch, seq_length]."""
        slot = (iteration * self.grad_accum + micro_step) * self.world + self.rank
        return self._rows(self._first + slot * self.micro_batch)

    def calibration_batches(self, count: int) -> list[torch.Tensor]:
        """The input ids of the first `count` micro-batches of the order, the same on every rank."""
        return [self._rows(i * self.micro_batch)[0] for i in range(count)]
