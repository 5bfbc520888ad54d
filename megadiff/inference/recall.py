"""The DIFF paper's split of the held-out loss (its table 6, after Zoology): "AR-hit" tokens, each
the second of a bigram already seen in its context (associative recall), and the others.

Zoology also counts bigrams that are frequent in the training data among the others (a model
predicts them from memory, not from its context; DIFF: the others are "the tokens that cannot be
recalled from the context or frequent tokens"). With a FrequentBigrams filter, a repeated bigram
that occurs at least `per_million` times per million bigrams of the source's training split is not
an AR hit; `sample_tokens` of the split are counted, as evenly spread windows, every rank counting
its share of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megadiff.config import ConfigError
from megadiff.data.checks import split_tokens
from megadiff.inference.ranks import share, sum_across_ranks

# windows of the training split the bigram count reads: spread enough to sample a corpus whose
# files were concatenated in order, long enough that their edges lose next to no bigrams
SAMPLE_WINDOWS = 64
# tokens whose bigram keys are held at once (16 bytes each, with their positions)
COUNT_CHUNK_TOKENS = 1 << 24
DEFAULT_SAMPLE_TOKENS = 100_000_000


@dataclass(frozen=True)
class FrequentBigrams:
    """Zoology's filter: a bigram that occurs at least `per_million` times per million bigrams of
    the training split (counted over `sample_tokens` of it) is not an AR hit."""
    per_million: float
    sample_tokens: int = DEFAULT_SAMPLE_TOKENS


def bigram_keys(current: np.ndarray, following: np.ndarray) -> np.ndarray:
    """One int64 per (token, next token) pair: token ids are below 2**31."""
    return (current.astype(np.int64) << 32) | following.astype(np.int64)


def context_bigrams(dataset, sequences: int, document_eod: int | None = None,
                    text_start: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """[sequences, N] bigram keys of (the token at each position, the next one) and [sequences, N]
    booleans: whether that bigram is already in the position's context (with `document_eod`, in
    its document). A next token that begins a document (`text_start`: Llama's BOS after each EOD)
    is never a hit: it is the data's framing, recalled from nothing."""
    keys, repeated = [], []
    for index in range(sequences):
        tokens, labels = (np.asarray(dataset[index][key]) for key in ("tokens", "labels"))
        row = bigram_keys(tokens, labels)
        seen, hits = set(), []
        for key, current, label in zip(row.tolist(), tokens.tolist(), labels.tolist()):
            hits.append(key in seen and label not in text_start)
            seen.add(key)
            if current == document_eod:
                seen.clear()
        keys.append(row)
        repeated.append(hits)
    return np.stack(keys).reshape(sequences, -1), np.asarray(repeated, dtype=bool).reshape(sequences, -1)


def sample_windows(begin: int, end: int, sample_tokens: int, windows: int = SAMPLE_WINDOWS) -> list[tuple[int, int]]:
    """Non-overlapping [start, stop) token ranges of [begin, end), `sample_tokens` in all, spread from
    its first token to its last (the whole range when it is no longer)."""
    total = end - begin
    if sample_tokens >= total:
        return [(begin, end)]
    windows = min(windows, sample_tokens)
    sizes = np.diff(np.linspace(0, sample_tokens, windows + 1).round().astype(np.int64))
    gaps = (total - sample_tokens) // max(windows - 1, 1)
    ranges, start = [], begin
    for size in sizes.tolist():
        ranges.append((start, start + size))
        start += size + gaps
    return ranges


def training_bigram_rates(prefix: str, data_split: str, keys: np.ndarray, sample_tokens: int) -> np.ndarray:
    """How often each bigram key in `keys` occurs per million bigrams of the training split of `prefix`."""
    tokens = split_tokens(prefix, data_split, "train")
    if tokens is None:
        raise ConfigError(f"--frequent-bigrams counts bigrams in the training split, and data.split {data_split!r} "
                          f"gives {prefix} none")
    wanted = np.unique(keys)
    counts = torch.zeros(len(wanted), dtype=torch.float64)
    end = len(tokens)
    # a piece's last bigram starts at its last token: it reads one token further (within the split)
    pieces = [(start, min(start + COUNT_CHUNK_TOKENS + 1, stop + 1, end))
              for window_start, stop in sample_windows(0, end, sample_tokens)
              for start in range(window_start, stop, COUNT_CHUNK_TOKENS)]
    for start, stop in share(pieces):
        piece = np.asarray(tokens[start:stop])
        found = bigram_keys(piece[:-1], piece[1:])
        slots = np.minimum(np.searchsorted(wanted, found), len(wanted) - 1)
        matches = slots[wanted[slots] == found]
        counts += torch.from_numpy(np.bincount(matches, minlength=len(wanted)).astype(np.float64))
    counted = sum(stop - start - 1 for start, stop in pieces)
    rates = sum_across_ranks(counts).numpy() * 1e6 / max(counted, 1)
    return rates[np.searchsorted(wanted, keys)]


def recall_hits(dataset, sequences: int, document_eod: int | None = None, frequent: FrequentBigrams | None = None,
                training_data=None, text_start: tuple[int, ...] = ()) -> torch.Tensor:
    """[sequences, N] booleans: which positions are AR hits (context_bigrams). With `frequent`,
    `training_data` (a data config naming one prefix, as source_config() makes them) holds the
    training split whose frequent bigrams are left out."""
    keys, hits = context_bigrams(dataset, sequences, document_eod, text_start)
    if frequent is not None and hits.any():
        rates = training_bigram_rates(training_data.prefix, training_data.split, keys[hits], frequent.sample_tokens)
        hits[hits] = rates < frequent.per_million
    return torch.from_numpy(hits)


def recall_split(losses: torch.Tensor, hits: torch.Tensor, scored: torch.Tensor) -> dict:
    """Mean loss and token count of the `scored` AR-hit positions and of the other scored ones."""
    def part(mask: torch.Tensor) -> dict:
        count = int(mask.sum())
        return {"loss": losses[mask].double().mean().item() if count else float("nan"), "tokens": count}
    return {"ar_hit": part(hits & scored), "others": part(~hits & scored)}


def blend_recall(splits: list[dict], weights: list[float]) -> dict:
    """recall_split() of a blend: each slice's loss weighted as blend_summary weights the sources, over
    the sources that have tokens in that slice (NaN where none has)."""
    def blended(name: str) -> dict:
        present = [(split[name]["loss"], weight) for split, weight in zip(splits, weights) if split[name]["tokens"]]
        total = sum(weight for _, weight in present)
        return {"loss": sum(loss * weight for loss, weight in present) / total if present else float("nan"),
                "tokens": sum(split[name]["tokens"] for split in splits)}
    return {name: blended(name) for name in ("ar_hit", "others")}
