"""`megadiff needles`: multi-needle retrieval from long contexts (the DIFF paper's key-information
retrieval, sections 3.4 and 3.3), to check what a 64K extension can use.

A case of length L: held-out text (the haystack) holding N needles "The magic number of CITY is
NUMBER." at evenly spread depths, one of them (the queried one) moved to depth D (0 = start of
the context, 1 = its end), then "What is the magic number of CITY? The magic number of CITY is"
and the answer " NUMBER". The case counts as retrieved when greedy decoding would produce the
answer: with teacher forcing, one forward pass, the model's top token at every answer position
is the answer's next token. Only those positions' logits are formed, so 64K contexts need no
N x vocabulary logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Protocol

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from megadiff.config import ConfigError
from megadiff.data.checks import split_documents
from megadiff.data.indexed import read_index
from megadiff.data.locations import training_blend
from megadiff.data.prepare import ensure_prepared
from megadiff.data.tokenizers import Tokenizer
from megadiff.inference.evaluate import check_request, evaluation_config, write_report
from megadiff.inference.loader import load_checkpoint

CITIES = ("Paris", "Lisbon", "Nairobi", "Lima", "Oslo", "Hanoi", "Quito", "Dakar", "Perth", "Riga", "Tunis",
          "Accra", "Kyoto", "Bergen", "Cusco", "Porto", "Seville", "Tallinn", "Windhoek", "Zagreb")


class Scorer(Protocol):
    def logits_at(self, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Case:
    tokens: list[int]       # the whole input: context, question, answer
    needle_start: int       # where the queried needle begins
    answer_start: int       # where the answer begins (the question ends just before)

    @property
    def answer(self) -> list[int]:
        return self.tokens[self.answer_start:]


def _needle(tokenizer: Tokenizer, city: str, number: int) -> list[int]:
    return tokenizer.encode(f"\nThe magic number of {city} is {number}.\n")


def build_case(tokenizer: Tokenizer, haystack: np.ndarray, length: int, depth: float, needles: int,
               rng: random.Random) -> Case:
    """One case of exactly `length` tokens (see the module docstring); haystack: tokens to draw from."""
    cities = rng.sample(CITIES, needles)
    numbers = [rng.randrange(1_000_000, 10_000_000) for _ in cities]
    pieces = [_needle(tokenizer, city, number) for city, number in zip(cities, numbers)]
    question = tokenizer.encode(f"\nWhat is the magic number of {cities[0]}? The magic number of {cities[0]} is")
    answer = tokenizer.encode(f" {numbers[0]}")
    room = length - sum(map(len, pieces)) - len(question) - len(answer)
    if room < 0:
        raise ConfigError(f"--lengths: {length} tokens are fewer than the needles, question and answer take "
                          f"({length - room})")
    if room > len(haystack):
        raise ConfigError(f"--lengths: {length} tokens need {room:,} haystack tokens; the held-out split has "
                          f"{len(haystack):,} (use longer held-out data: data.prefix=..., or shorter lengths)")
    start = rng.randrange(len(haystack) - room + 1)
    hay = haystack[start:start + room].tolist()
    # the distractors spread evenly over the context, the queried needle at `depth`
    places = [round(depth * room)] + [round((k + 0.5) / (needles - 1) * room) for k in range(needles - 1)]
    tokens, cursor, needle_start = [], 0, 0
    for place, index in sorted((place, index) for index, place in enumerate(places)):
        tokens += hay[cursor:place]
        cursor = place
        if index == 0:
            needle_start = len(tokens)
        tokens += pieces[index]
    tokens += hay[cursor:] + question
    return Case(tokens + answer, needle_start, len(tokens))


@torch.no_grad()
def retrieved(model: Scorer, case: Case) -> bool:
    """Would greedy decoding continue the question with the answer? (teacher forcing, one pass)"""
    positions = list(range(case.answer_start - 1, len(case.tokens) - 1))
    logits = model.logits_at(torch.tensor([case.tokens]), positions)[0]
    return logits.argmax(-1).tolist() == case.answer


def retrieval_grid(model: Scorer, tokenizer: Tokenizer, haystack: np.ndarray, lengths: list[int],
                   depths: list[float], needles: int, trials: int, seed: int) -> dict:
    """Accuracy per (length, depth) over `trials` cases each (other cities, numbers and haystack)."""
    rng = random.Random(seed)
    accuracy = [[sum(retrieved(model, build_case(tokenizer, haystack, length, depth, needles, rng))
                     for _ in range(trials)) / trials for depth in depths] for length in lengths]
    return {"lengths": lengths, "depths": depths, "needles": needles, "trials": trials, "accuracy": accuracy,
            "mean_accuracy": float(np.mean(accuracy))}


def held_out_tokens(cfg, split: str) -> np.ndarray:
    """The documents of `split` of the first prefix, concatenated (EOD ids between them, as prepared)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = training_blend(cfg.data)[0][0]
    splits = split_documents(read_index(prefix).sequence_lengths, cfg.data.split)
    if split not in splits:
        raise ConfigError(f"data.split {cfg.data.split!r} gives the {split} split no documents")
    begin, end, _ = splits[split]
    dataset = IndexedDataset(prefix)
    return np.concatenate([dataset[i] for i in range(begin, end)]).astype(np.int64)


def needles_cli(load: str, lengths: Iterable[int], depths: Iterable[float], needles: int = 1, trials: int = 5,
                seed: int = 0, split: str = "valid", overrides: Iterable[str] = (), output: str | None = None) -> int:
    """`megadiff needles --load RUN`: print (and with `output`, write as JSON) the accuracy grid."""
    lengths, depths = sorted(set(lengths)), sorted(set(depths))
    check_request("needles", split, overrides, needles=needles, trials=trials, lengths=min(lengths, default=0))
    if needles > len(CITIES) or not all(0 <= d <= 1 for d in depths) or not depths:
        raise ConfigError(f"--needles must be at most {len(CITIES)} and --depths within [0, 1]")
    console = Console(highlight=False, soft_wrap=True)
    model = load_checkpoint(load)
    cfg = evaluation_config(model, None, overrides)
    ensure_prepared(cfg)
    report = retrieval_grid(model, model.tokenizer, held_out_tokens(cfg, split), lengths, depths, needles, trials,
                            seed)
    report.update(checkpoint=str(model.checkpoint_dir), trained_length=model.cfg.model.seq_length)
    table = Table(title=f"{report['checkpoint']}: retrieval of 1 of {needles} needles, {trials} cases per cell "
                        f"(trained on {report['trained_length']:,} tokens); mean {report['mean_accuracy']:.2f}")
    table.add_column("length \\ depth")
    for depth in depths:
        table.add_column(f"{depth:g}", justify="right")
    for length, row in zip(lengths, report["accuracy"]):
        table.add_row(f"{length:,}", *(f"{value:.2f}" for value in row))
    console.print(table)
    write_report(console, report, output)
    return 0
