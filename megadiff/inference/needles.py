"""`megadiff needles`: multi-needle retrieval from long contexts (the DIFF paper's key-information
retrieval, sections 3.4 and 3.3), to check what a 64K extension can use.

A case of length L: the tokenizer's text start (Llama's BOS; none for GPT-2's or tiktoken's), then
held-out text (the haystack: documents one after another, their EOD and text-start tokens left
out) holding N needles "The magic number of CITY is NUMBER." at evenly spread depths, one of them
(the first queried) moved to depth D (0 = start of the context, 1 = its end), then "What is
the magic number of CITY? The magic number of CITY is" and the answer " NUMBER". With R query
cities (the paper's R), the question asks for R of the needles ("What are the magic numbers of A
and B? The magic number of A is") and the answers follow one another (" X. The magic number of B
is Y"). A queried number counts as retrieved when greedy decoding would produce it, and no more
digits: with teacher forcing, one forward pass, the model's top token at every position of the
answer is the answer's next token, and the one after it does not begin with a digit; a case scores
the share of its R numbers retrieved. Only those positions' logits are formed, so 64K contexts need
no N x vocabulary logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np
import torch
from rich.table import Table

from megadiff.checkpoint.format import checkpoint_config, resolve_checkpoint_dir
from megadiff.checkpoint.single_process import CausalLM, checkpoint_tokenizer
from megadiff.config import ConfigError
from megadiff.data.checks import check_prepared_with, split_tokens
from megadiff.data.locations import training_blend
from megadiff.data.prepare import ensure_prepared
from megadiff.data.tokenizers import Tokenizer, encode_continuing, load_tokenizer
from megadiff.inference.evaluate import check_request, evaluation_config
from megadiff.inference.hf_attention import hf_attention_rows, refuse_megadiff_modeling_code
from megadiff.inference.hf_model import HFCausalLM, hf_run_config, hf_window, load_model
from megadiff.inference.outliers import attention_maps, softmax_scale
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import share, share_size, sum_across_ranks
from megadiff.inference.reporting import command_console, write_report

CITIES = ("Paris", "Lisbon", "Nairobi", "Lima", "Oslo", "Hanoi", "Quito", "Dakar", "Perth", "Riga", "Tunis",
          "Accra", "Kyoto", "Bergen", "Cusco", "Porto", "Seville", "Tallinn", "Windhoek", "Zagreb")


class Scorer(Protocol):
    def logits_at(self, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Case:
    tokens: list[int]                    # the whole input: context, question, answers
    needle_spans: list[tuple[int, int]]  # [start, end) of every needle, the queried ones first
    answer_span: tuple[int, int]         # the first queried number inside its needle
    question_start: int
    answer_spans: list[tuple[int, int]]  # [start, end) of each queried number after the question
    context_start: int = 0               # where the haystack begins: after the tokenizer's text start

    @property
    def answer_start(self) -> int:
        """Where the first answer begins (the question ends just before)."""
        return self.answer_spans[0][0]

    @property
    def answer(self) -> list[int]:
        """The first queried number's tokens."""
        return self.tokens[slice(*self.answer_spans[0])]


def _needle(tokenizer: Tokenizer, city: str, number: int) -> list[int]:
    return encode_continuing(tokenizer, f"\nThe magic number of {city} is {number}.\n")


def _find(piece: list[int], part: list[int]) -> int | None:
    return next((i for i in range(len(piece) - len(part) + 1) if piece[i:i + len(part)] == part), None)


def _question(tokenizer: Tokenizer, cities: list[str], numbers: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """The R texts before the R answers (the question, then ". The magic number of CITY is" for
    each further city), and the answers."""
    asked = cities[0] if len(cities) == 1 else f"{', '.join(cities[:-1])} and {cities[-1]}"
    verb = "is the magic number" if len(cities) == 1 else "are the magic numbers"
    prompts = [encode_continuing(tokenizer, f"\nWhat {verb} of {asked}? The magic number of {cities[0]} is")]
    prompts += [encode_continuing(tokenizer, f". The magic number of {city} is") for city in cities[1:]]
    return prompts, [encode_continuing(tokenizer, f" {number}") for number in numbers]


def build_case(tokenizer: Tokenizer, haystack: np.ndarray, length: int, depth: float, needles: int,
               rng: random.Random, queries: int = 1) -> Case:
    """One case of exactly `length` tokens asking for `queries` of the needles (see the module
    docstring); haystack: tokens to draw from."""
    cities = rng.sample(CITIES, needles)
    numbers = [rng.randrange(1_000_000, 10_000_000) for _ in cities]
    pieces = [_needle(tokenizer, city, number) for city, number in zip(cities, numbers)]
    prompts, answers = _question(tokenizer, cities[:queries], numbers[:queries])
    opening = list(tokenizer.text_start)  # the case is one text
    room = length - len(opening) - sum(map(len, pieces + prompts + answers))
    if room < 0:
        raise ConfigError(f"--lengths: {length} tokens are fewer than the needles, question and answer take "
                          f"({length - room})")
    if room > len(haystack):
        raise ConfigError(f"--lengths: {length} tokens need {room:,} haystack tokens; the held-out split has "
                          f"{len(haystack):,} (use longer held-out data: data.prefix=..., or shorter lengths)")
    start = rng.randrange(len(haystack) - room + 1)
    hay = _text_without_eods(haystack, start, room, {tokenizer.eod, *opening})
    # the distractors spread evenly over the context, the queried needle at `depth`
    places = [round(depth * room)] + [round((k + 0.5) / (needles - 1) * room) for k in range(needles - 1)]
    tokens, cursor, spans = list(opening), 0, [None] * needles
    for place, index in sorted((place, index) for index, place in enumerate(places)):
        tokens += hay[cursor:place]
        cursor = place
        spans[index] = (len(tokens), len(tokens) + len(pieces[index]))
        tokens += pieces[index]
    tokens += hay[cursor:]
    question_start, answer_spans = len(tokens), []
    for prompt, answer in zip(prompts, answers):
        tokens += prompt
        answer_spans.append((len(tokens), len(tokens) + len(answer)))
        tokens += answer
    offset = _find(pieces[0], answers[0])  # the number as the answer spells it; else the whole needle
    answer_span = spans[0] if offset is None else (spans[0][0] + offset, spans[0][0] + offset + len(answers[0]))
    return Case(tokens, spans, answer_span, question_start, answer_spans, len(opening))


def _text_without_eods(haystack: np.ndarray, start: int, count: int, bounds: set[int]) -> list[int]:
    """`count` tokens of the haystack from `start` on (wrapping around to its start), the tokens that
    end and begin its documents (`bounds`: the EOD, a BOS) left out: a document-masked model would not
    see a needle across one, and no model sees one inside a text."""
    tokens, read = [], 0
    while len(tokens) < count:
        if read == len(haystack):
            raise ConfigError(f"--lengths: the held-out split holds fewer than {count:,} tokens besides its "
                              "documents' ends (use longer held-out data: data.prefix=..., or shorter lengths)")
        cursor = (start + read) % len(haystack)
        window = haystack[cursor:cursor + min(count - len(tokens), len(haystack) - read)]
        tokens += [token for token in window.tolist() if token not in bounds]
        read += len(window)
    return tokens


@torch.no_grad()
def retrieved(model: Scorer, case: Case, tokenizer: Tokenizer) -> float:
    """The share of the queried numbers that greedy decoding would give where the case has them
    (teacher forcing, one pass), and end there: the token predicted after a number's last may not go
    on with a digit (" 80560208" does not retrieve 8056020). 1.0 or 0.0 with one query."""
    positions = [position for start, end in case.answer_spans for position in range(start - 1, end)]
    predicted = model.logits_at(torch.tensor([case.tokens]), positions)[0].argmax(-1).tolist()
    hits, cursor = 0, 0
    for start, end in case.answer_spans:
        answer, after = predicted[cursor:cursor + end - start], predicted[cursor + end - start]
        hits += answer == case.tokens[start:end] and not tokenizer.decode([after])[:1].isdigit()
        cursor += end - start + 1
    return hits / len(case.answer_spans)


@torch.no_grad()
def attention_rows(model: CausalLM, tokens: list[int], position: int) -> list[torch.Tensor]:
    """Per layer, [heads, position + 1]: the attention of token `position` over the tokens up to it.
    A differential head's row is A1 - lambda A2 divided by its sum 1 - lambda (the paper's
    normalized attention scores: a row sums to 1, single entries may be negative)."""
    rows = []

    def capture(module, args) -> None:
        scale = softmax_scale(module, args[0])
        probabilities = [torch.softmax(q[0, :, position:position + 1].float()
                                       @ k[0, :, :position + 1].float().transpose(-1, -2) * scale, dim=-1)[:, 0]
                         for q, k in attention_maps(module, args[0], args[1])]
        if len(probabilities) == 2:
            lam = module.current_lambda().float().reshape(-1, 1)
            rows.append((probabilities[0] - lam * probabilities[1]) / (1 - lam))
        else:
            rows.append(probabilities[0])

    handles = [layer.self_attention.core_attention.register_forward_pre_hook(capture)
               for layer in model.gpt.decoder.layers]
    try:
        model.hidden_states(torch.tensor([tokens[:position + 1]]))
    finally:
        for handle in handles:
            handle.remove()
    return rows


def attention_allocation(model: CausalLM | HFCausalLM, case: Case) -> tuple[float, float]:
    """(attention to the answer, attention noise) of the question's last token, the paper's Table 3:
    the normalized attention on the (first) queried number's tokens, and on the haystack (everything
    before the question but the needles and the text start: a Llama's BOS, its attention sink, is no
    context), each summed over those tokens and averaged over layers and heads."""
    position = case.answer_start - 1
    answer = torch.zeros(position + 1, dtype=torch.bool)
    answer[slice(*case.answer_span)] = True
    noise = torch.zeros(position + 1, dtype=torch.bool)
    noise[case.context_start:case.question_start] = True
    for start, end in case.needle_spans:
        noise[start:end] = False
    rows_of = hf_attention_rows if isinstance(model, HFCausalLM) else attention_rows
    rows = torch.cat(rows_of(model, case.tokens, position)).cpu()
    return rows[:, answer].sum(-1).mean().item(), rows[:, noise].sum(-1).mean().item()


def draw_cases(tokenizer: Tokenizer, haystack: np.ndarray, lengths: list[int], depths: list[float], needles: int,
               trials: int, seed: int, queries: int = 1) -> Iterator[Case]:
    """Every case of the grid, length by length, depth by depth, trial by trial, drawn from `seed`."""
    rng = random.Random(seed)
    return (build_case(tokenizer, haystack, length, depth, needles, rng, queries)
            for length in lengths for depth in depths for _ in range(trials))


def retrieval_grid(model: Scorer, tokenizer: Tokenizer, haystack: np.ndarray, lengths: list[int],
                   depths: list[float], needles: int, trials: int, seed: int, attention: bool = False,
                   on_case: Callable[[Case], None] | None = None, queries: int = 1) -> dict:
    """Accuracy per (length, depth) over `trials` cases each (other cities, numbers and haystack),
    each asking for `queries` of the needles;
    with `attention` (a CausalLM or HFCausalLM), also the attention to the answer and the noise per cell.
    Each rank scores its share of the cases (calling `on_case` after each); every rank draws them
    all, in one order, from `seed`."""
    measures = ("accuracy", "attention_to_answer", "attention_noise") if attention else ("accuracy",)
    # each case is drawn once before any is scored: a length the haystack (or the needles) cannot
    # fit is refused at once, not after every shorter length's cases were scored
    for _ in draw_cases(tokenizer, haystack, lengths, depths, needles, trials, seed, queries):
        pass
    cases = draw_cases(tokenizer, haystack, lengths, depths, needles, trials, seed, queries)
    results = torch.zeros(len(lengths) * len(depths) * trials, len(measures), dtype=torch.float64)
    for index, case in share(enumerate(cases)):
        results[index, 0] = retrieved(model, case, tokenizer)
        if attention:
            results[index, 1:] = torch.tensor(attention_allocation(model, case), dtype=torch.float64)
        if on_case is not None:
            on_case(case)
    cells = sum_across_ranks(results).view(len(lengths), len(depths), trials, len(measures)).mean(2)
    grids = {name: cells[..., column].tolist() for column, name in enumerate(measures)}
    return {"lengths": lengths, "depths": depths, "needles": needles, "queries": queries, "trials": trials, **grids,
            "mean_accuracy": cells[..., 0].mean().item()}


def held_out_tokens(cfg, split: str) -> np.ndarray:
    """The documents of `split` of the first prefix, one after another, read in place (a copy would
    hold the whole split: 24 GB for the 0.2% of a 1T-token corpus that a valid split of "998,2,0" gives)."""
    tokens = split_tokens(training_blend(cfg.data)[0][0], cfg.data.split, split)
    if tokens is None:
        raise ConfigError(f"data.split {cfg.data.split!r} gives the {split} split no documents")
    return tokens


def _check_cases_fit(load: str | None, hf: str | None, window: int | None, split: str, overrides: Iterable[str],
                     grid: dict) -> None:
    """Draws every case from the model's tokenizer and held-out split before the minutes of reading its
    weights (a checkpoint's, or the --hf directory's): a length the needles or the split cannot fit is refused
    then."""
    if load is not None:
        checkpoint_dir = resolve_checkpoint_dir(load)
        cfg = evaluation_config(checkpoint_config(checkpoint_dir), None, overrides)
        ensure_prepared(cfg)
        tokenizer = checkpoint_tokenizer(checkpoint_dir, cfg)
    else:
        cfg = evaluation_config(hf_run_config(hf, hf_window(hf, window)), None, overrides)
        ensure_prepared(cfg)
        tokenizer = load_tokenizer(hf, trust_remote_code=True)
    # the haystack is read as token ids: data prepared with another tokenizer would be other text
    check_prepared_with(cfg, tokenizer)
    for _ in draw_cases(tokenizer, held_out_tokens(cfg, split), **grid):
        pass


def needles_cli(load: str | None, lengths: Iterable[int], depths: Iterable[float], needles: int = 1, trials: int = 5,
                seed: int = 0, split: str = "valid", attention: bool = False, overrides: Iterable[str] = (),
                output: str | None = None, queries: int = 1, hf: str | None = None, dtype: str | None = None,
                window: int | None = None) -> int:
    """`megadiff needles --load RUN` (or `--hf DIR`: a transformers model, the haystack from the
    data.* overrides, prepared with its tokenizer): print (and with `output`, write as JSON) the grids."""
    lengths, depths = sorted(set(lengths)), sorted(set(depths))
    check_request("needles", split, overrides, needles=needles, trials=trials, lengths=min(lengths, default=0))
    if needles > len(CITIES) or not all(0 <= d <= 1 for d in depths) or not depths:
        raise ConfigError(f"--needles must be at most {len(CITIES)} and --depths within [0, 1]")
    if not 1 <= queries <= needles:
        raise ConfigError(f"--queries must be between 1 and --needles ({needles}), got {queries}")
    grid = dict(lengths=lengths, depths=depths, needles=needles, trials=trials, seed=seed, queries=queries)
    if attention:
        refuse_megadiff_modeling_code(hf, "needles --attention")
    if (load is None) != (hf is None):  # else load_model says to give one
        _check_cases_fit(load, hf, window, split, overrides, grid)
    model = load_model(load, hf, dtype, window)  # under torchrun it joins the ranks' process group
    console = command_console()
    # prepared by _check_cases_fit, load_model refusing all else: once more would say it is up to date twice
    cfg = evaluation_config(model.cfg, None, overrides)
    with command_progress("needles") as progress:
        task = ProgressTask(progress, f"{len(lengths)} lengths x {len(depths)} depths x {trials} trials",
                            share_size(len(lengths) * len(depths) * trials))
        report = retrieval_grid(model, model.tokenizer, held_out_tokens(cfg, split), lengths, depths, needles,
                                trials, seed, attention=attention,
                                on_case=lambda case: task.advance(1, len(case.tokens)), queries=queries)
    report.update(checkpoint=str(model.checkpoint_dir), trained_length=model.cfg.model.seq_length)
    window = "window" if hf is not None else "trained on"
    console.print(f"{report['checkpoint']}: retrieval of {queries} of {needles} needles, {trials} cases per cell "
                  f"({window} {report['trained_length']:,} tokens); mean accuracy {report['mean_accuracy']:.2f}")
    for name in ("accuracy", "attention_to_answer", "attention_noise"):
        if name in report:
            table = Table(title=name.replace("_", " "))
            table.add_column("length \\ depth")
            for depth in depths:
                table.add_column(f"{depth:g}", justify="right")
            for length, row in zip(lengths, report[name]):
                table.add_row(f"{length:,}", *(f"{value:.2f}" for value in row))
            console.print(table)
    write_report(console, report, output)
    return 0
