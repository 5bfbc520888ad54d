"""Document texts -> token ids with an EOD after each document, in order, on several processes.

Workers are spawned (not forked: pre-training may call this from a process that already runs
threads) and import only this light module, the tokenizer, which each loads once, and for
conversations transformers' chat template renderer.
"""
from __future__ import annotations

import collections
import multiprocessing
from typing import Iterable, Iterator, Optional

import numpy as np

from megadiff.data.conversations import encode_conversation, no_loss_on_the_first
from megadiff.data.tokenizers import document_start, load_tokenizer

Encoded = tuple[np.ndarray, np.ndarray]  # (ids of the batch, concatenated; tokens per document, 0 = skipped)
# and, for prompt/response pairs and conversations, the loss mask beside the ids: 1 on a response's
# (an assistant turn's) tokens and its EOD
EncodedPairs = tuple[np.ndarray, np.ndarray, np.ndarray]


def encode_documents(texts: list[Optional[str]], tokenizer_spec: str, dtype: str) -> Encoded:
    """A document that encodes to no tokens (empty or missing text) is skipped, not stored as a lone EOD.
    A special token's text in a document is text: only the EOD appended ends the document, which
    begins as the tokenizer begins a text (document_start: Llama's BOS)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    start = document_start(tokenizer)
    pieces, lengths = [], []
    for text in texts:
        ids = tokenizer.encode_ordinary(text) if text else []
        if ids:
            ids = start + ids + [tokenizer.eod]
        pieces.append(np.asarray(ids, dtype=dtype))
        lengths.append(len(ids))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype), np.asarray(lengths, dtype=np.int64)


def encode_pairs(prompts: list[Optional[str]], responses: list[Optional[str]], tokenizer_spec: str,
                 dtype: str) -> EncodedPairs:
    """Each pair -> document_start (Llama's BOS), the prompt and response encoded as one text, EOD; the loss on
    the tokens holding response characters and on the EOD, but never on the document's first token. A pair with an
    empty response (it would teach nothing) or without a prompt (null: the response would be taught as an answer
    to nothing) is skipped; an empty prompt is given, and kept."""
    tokenizer = load_tokenizer(tokenizer_spec)
    start = document_start(tokenizer)
    documents = []
    for prompt, response in zip(prompts, responses):
        if not response or prompt is None:
            documents.append(([], []))
            continue
        ids, mask = _encode_pair(prompt, response, tokenizer)
        documents.append((start + ids + [tokenizer.eod], no_loss_on_the_first([0] * len(start) + mask + [1])))
    return _masked(documents, dtype)


def _encode_pair(prompt: str, response: str, tokenizer) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of prompt + response as one text, as TRL encodes a prompt and its completion: encoded
    alone, a response would begin as a text begins (SentencePiece writes a space before it) and the tokens at
    the edge split apart. A token spanning the edge takes the loss. A tokenizer without character offsets (a
    slow one) encodes them apart."""
    try:
        ids, offsets = tokenizer.encode_with_offsets(prompt + response, ordinary=True)
    except NotImplementedError:
        question, answer = tokenizer.encode_ordinary(prompt), tokenizer.encode_ordinary(response)
        return question + answer, [0] * len(question) + [1] * len(answer)
    return ids, [int(end > len(prompt)) for _, end in offsets]


def encode_conversations(conversations: list, template: str, tokenizer_spec: str, dtype: str) -> EncodedPairs:
    """Each conversation -> its rendering's ids and EOD, the mask on the assistant's turns
    (data/conversations.py); one without assistant text is skipped."""
    tokenizer = load_tokenizer(tokenizer_spec)
    return _masked([encode_conversation(messages, template, tokenizer) for messages in conversations], dtype)


def _masked(documents: list[tuple[list[int], list[int]]], dtype: str) -> EncodedPairs:
    """EncodedPairs of documents given as (ids, loss mask)."""
    if not documents:
        return np.zeros(0, dtype), np.zeros(0, np.int64), np.zeros(0, np.uint8)
    ids = np.concatenate([np.asarray(ids, dtype=dtype) for ids, _ in documents])
    masks = np.concatenate([np.asarray(mask, dtype=np.uint8) for _, mask in documents])
    return ids, np.asarray([len(ids) for ids, _ in documents], dtype=np.int64), masks


class Encoder:
    """Encodes batches of texts in input order: inline for one worker, else on a pool of spawned
    processes kept until the encoder's context ends (prepare-data encodes many parts with one pool)."""

    def __init__(self, tokenizer_spec: str, dtype: str, workers: int):
        self.tokenizer_spec, self.dtype, self.workers = tokenizer_spec, dtype, workers
        self._pool = None

    def __enter__(self) -> "Encoder":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def encode_in_order(self, batches: Iterable[list[Optional[str]]]) -> Iterator[Encoded]:
        """At most a few batches per worker in flight, so memory stays flat."""
        return self._in_order(encode_documents, ((texts,) for texts in batches))

    def encode_pairs_in_order(self, batches: Iterable[tuple[list, list]]) -> Iterator[EncodedPairs]:
        """Batches of (prompts, responses), as encode_in_order."""
        return self._in_order(encode_pairs, batches)

    def encode_conversations_in_order(self, batches: Iterable[list], template: str) -> Iterator[EncodedPairs]:
        """Batches of conversations (lists of messages) rendered by `template`, as encode_in_order."""
        return self._in_order(encode_conversations, ((conversations, template) for conversations in batches))

    def _in_order(self, encode, batches: Iterable[tuple]) -> Iterator:
        if self.workers == 1:
            for batch in batches:
                yield encode(*batch, self.tokenizer_spec, self.dtype)
            return
        if self._pool is None:  # started by the first part that needs tokenizing, not for finished ones
            self._pool = multiprocessing.get_context("spawn").Pool(
                self.workers, initializer=load_tokenizer, initargs=(self.tokenizer_spec,))
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(self._pool.apply_async(encode, (*batch, self.tokenizer_spec, self.dtype)))
            if len(pending) >= 4 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
