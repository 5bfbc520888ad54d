"""`megadiff icl`: many-shot in-context classification (the DIFF paper's section 3.5, figures 6-7).

Demonstrations "sentence: TEXT\\nlabel: LABEL\\n\\n" drawn from the train split fill the context
(1, 2, 4, ... shots up to the most that fit the model's window, or `--shots`), then a test
example's "sentence: TEXT\\nlabel:" is answered by constrained decoding (Ratner et al., 2023):
greedy decoding that may only continue some label's " LABEL\\n\\n", so the answer is always a label.
The demonstrations of k shots are the first k of one seeded draw (more shots add to fewer).
`--orders N` answers every shot count with the same demonstrations in N seeded orders (figure 7's
robustness: the report gives the mean, worst and best accuracy); `--arrangement by-class` deals
them out class by class in turn (its second prompt format). Under torchrun each rank answers its
share of the test examples; rank 0 prints and writes the report.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import datasets
import torch
from rich.table import Table

from megadiff.checkpoint.single_process import CausalLM
from megadiff.config import ConfigError
from megadiff.data.tokenizers import Tokenizer, with_text_start
from megadiff.errors import first_line
from megadiff.inference.hf_model import HFCausalLM, load_model
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import reports, share, share_size, sum_across_ranks
from megadiff.inference.records import RankRecords, model_settings
from megadiff.inference.reporting import command_console, write_report

ARRANGEMENTS = ("random", "by-class")
# what ends a label in the demonstrations, so in constrained decoding too: a label ended otherwise
# would be followed by a token the model never saw after one (where a label is another's prefix)
LABEL_END = "\n\n"


@dataclass(frozen=True)
class Example:
    text: str
    label: str


def demonstration(example: Example) -> str:
    return f"sentence: {example.text}\nlabel: {example.label}{LABEL_END}"


def query(example: Example) -> str:
    return f"sentence: {example.text}\nlabel:"


def label_continuation(label: str) -> str:
    """What constrained decoding produces after a query: the label, ended so none is another's prefix."""
    return f" {label}{LABEL_END}"


def load_examples(dataset: str, config: str | None, split: str, text_key: str, label_key: str) -> list[Example]:
    """A split of a Hugging Face dataset (hub name or its cache), or DIR/SPLIT.jsonl; labels by
    name (a ClassLabel's names, else the values as text)."""
    try:
        if Path(dataset).is_file():  # a hub name has no file: read as one, it spent half a minute on retries
            raise ConfigError(f"--dataset {dataset} is a file: give the directory holding {split}.jsonl (and the "
                              "other split's file), or a Hugging Face dataset's name")
        if Path(dataset).is_dir():
            path = Path(dataset) / f"{split}.jsonl"
            # datasets' JSON reader fails on an empty file with a StopIteration
            with path.open(encoding="utf-8") as lines:
                if not any(line.strip() for line in lines):
                    raise ConfigError(f"{path} holds no examples")
            rows = datasets.load_dataset("json", data_files={split: str(path)})[split]
        else:
            rows = datasets.load_dataset(dataset, config, split=split)
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError,
            datasets.exceptions.DatasetGenerationError) as error:  # the last: a file that is not JSON lines
        cause = error.__cause__ or error
        raise ConfigError(f"cannot read the {split} split of {dataset}: {first_line(cause)}") from error
    if not len(rows):
        raise ConfigError(f"the {split} split of {dataset} holds no examples")
    missing = [key for key in (text_key, label_key) if key not in rows.column_names]
    if missing:
        raise ConfigError(f"{dataset} ({split}) has no column {missing}; it has {rows.column_names} "
                          "(--text-key, --label-key)")
    unlabelled = [index for index, row in enumerate(rows) if row[text_key] is None or row[label_key] is None]
    if unlabelled:  # scored against the label "None", they lowered the accuracy without a word
        raise ConfigError(f"{dataset} ({split}): {len(unlabelled)} examples lack their {text_key!r} or "
                          f"{label_key!r} (the first: row {unlabelled[0]})")
    feature = rows.features[label_key]
    name = feature.int2str if isinstance(feature, datasets.ClassLabel) else str
    return [Example(str(row[text_key]), name(row[label_key])) for row in rows]


def arranged(demonstrations: Sequence[Example], arrangement: str, order_seed: int) -> list[Example]:
    """The demonstrations in the order of `order_seed` (0: as drawn); by class: then dealt out one
    class after another (classes in the order they first come)."""
    ordered = list(demonstrations)
    if order_seed:
        random.Random(order_seed).shuffle(ordered)
    if arrangement == "random":
        return ordered
    by_class: dict[str, list[Example]] = {}
    for example in ordered:
        by_class.setdefault(example.label, []).append(example)
    rounds = max(len(group) for group in by_class.values())
    return [group[i] for i in range(rounds) for group in by_class.values() if i < len(group)]


def constrained_answer(model: CausalLM | HFCausalLM, prompt: list[int], labels: Sequence[list[int]],
                       context: SharedContext | None = None) -> int:
    """The index of the label that greedy decoding restricted to label continuations gives; the
    prompt runs once (past the `context`'s tokens when it starts with them), then each chosen
    token (KV cache) until one label is left (labels' token sequences are prefix-free)."""
    if context is None:
        cache, held = model.new_cache(max_length=len(prompt) + max(len(tokens) for tokens in labels)), 0
    else:
        cache, held = context.cache, context.hold(prompt)
    alive, step, pending = list(range(len(labels))), 0, prompt[held:]
    while len(alive) > 1:
        allowed = sorted({labels[i][step] for i in alive})
        logits = model.next_token_logits(torch.tensor([pending]), cache)[0]
        choice = allowed[int(logits[allowed].argmax())]
        alive = [i for i in alive if labels[i][step] == choice]
        pending, step = [choice], step + 1
    return alive[0]


class SharedContext:
    """The demonstrations every query of a grid cell follows, run once: a KV cache rewound to them
    for each prompt that starts with their tokens (a prompt cut to the window, or tokens merged
    across the boundary, runs whole instead)."""

    def __init__(self, model: CausalLM | HFCausalLM, ids: list[int]):
        self.model, self.ids = model, ids
        self.cache = model.new_cache(max_length=model.cfg.model.seq_length)
        self.mark = None

    def hold(self, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens the cache holds now (the demonstrations', or none)."""
        if not (len(self.ids) < len(prompt) and prompt[:len(self.ids)] == self.ids):
            self.cache.reset()
            self.mark = None
            return 0
        if self.mark is None:
            self.cache.reset()
            with torch.no_grad():
                self.model.next_token_logits(torch.tensor([self.ids]), self.cache)
            self.mark = self.cache.mark()
        self.cache.rewind(self.mark)
        return len(self.ids)


def label_tokens(tokenizer: Tokenizer, labels: Sequence[str]) -> list[list[int]]:
    """Each label's tokens as a demonstration holds them after its "label:" (" LABEL\\n\\n"), the next
    demonstration following: a byte-level BPE splits the newlines before a word otherwise than at the
    end of a text (GPT-2's "\\n", "\\n" there, one "\\n\\n" token here)."""
    tokens = [_in_demonstrations(tokenizer, label_continuation(label)) for label in labels]
    if len({tuple(t) for t in tokens}) < len(tokens):
        raise ConfigError("two labels encode to the same tokens")
    return tokens


def _in_demonstrations(tokenizer: Tokenizer, continuation: str) -> list[int]:
    """The tokens of a label's continuation after "label:", the next demonstration following, up to the
    continuation's end (as encoded alone where the tokenizer does not give that end back)."""
    prefix = len(tokenizer.encode("label:"))
    followed = tokenizer.encode("label:" + continuation + "sentence:")[prefix:]
    for count in range(1, len(followed) + 1):
        if tokenizer.decode(followed[:count]).endswith(LABEL_END):
            return followed[:count]
    return tokenizer.encode("label:" + continuation)[prefix:]


def label_names(draw: Sequence[Example], tests: Sequence[Example]) -> list[str]:
    return sorted({example.label for example in draw} | {example.label for example in tests})


def default_shots(tokenizer: Tokenizer, draw: Sequence[Example], tests: Sequence[Example], window: int) -> list[int]:
    """1, 2, 4, ... and the most demonstrations of the draw that fit the window beside the longest
    test query and label."""
    longest_label = max(len(tokens) for tokens in label_tokens(tokenizer, label_names(draw, tests)))
    room = window - longest_label - len(tokenizer.text_start) - max(len(tokenizer.encode(query(example)))
                                                                    for example in tests)
    shots, used = 0, 0
    for example in draw:
        used += len(tokenizer.encode(demonstration(example)))
        if used > room:
            break
        shots += 1
    if shots == 0:
        raise ConfigError(f"not one demonstration fits the model's window of {window} tokens beside a query")
    powers = [2 ** i for i in range(shots.bit_length()) if 2 ** i < shots]
    return powers + [shots]


# one answer: (shots, order, index of the test example)
Cell = tuple[int, int, int]


class AnswerCache:
    """`--cache PATH`: every answer appended to PATH_rankN.jsonl as it comes; a rerun of the same
    request (same checkpoint, window, dtype, data, examples and seed; any shots and orders) answers only the rest.
    `defaults`: the settings caches kept before the request held them were answered with (RankRecords)."""

    def __init__(self, path: str, request: dict, defaults: dict | None = None):
        self.records = RankRecords(path, request, "--cache", defaults)

    def answers(self) -> dict[Cell, bool]:
        """Every rank's answers so far."""
        return {(record["shots"], record["order"], record["example"]): record["correct"]
                for _, record in self.records.read()}

    def add(self, cell: Cell, correct: bool) -> None:
        shots, order, example = cell
        self.records.add({"shots": shots, "order": order, "example": example, "correct": correct})


def grid_cells(shots: Sequence[int], orders: int, examples: int) -> list[Cell]:
    return [(count, order, index) for count in shots for order in range(orders) for index in range(examples)]


def accuracy_grid(model: CausalLM | HFCausalLM, draw: Sequence[Example], tests: Sequence[Example], shots: Sequence[int],
                  orders: int, arrangement: str, on_answer: Callable[[int], None] | None = None,
                  known: dict[Cell, bool] | None = None, cache: AnswerCache | None = None) -> torch.Tensor:
    """[len(shots), orders] accuracy over `tests` (each rank answers its share; all return it all).
    A prompt longer than the window keeps its end, as the harness's models do. The `known`
    answers (AnswerCache.answers()) are taken as they are; `cache` keeps the others."""
    tokenizer, window = model.tokenizer, model.cfg.model.seq_length
    names = label_names(draw, tests)
    labels = label_tokens(tokenizer, names)
    room = window - max(len(tokens) for tokens in labels)
    known = known or {}
    correct = torch.zeros(len(shots), orders, dtype=torch.float64)
    cells = grid_cells(shots, orders, len(tests))
    if reports():  # the known answers count once, on one rank
        for count, order, index in cells:
            correct[shots.index(count), order] += known.get((count, order, index), False)
    current, context, demonstrations = None, None, ""
    for cell in share([cell for cell in cells if cell not in known]):  # a cell's examples come one after another
        count, order, index = cell
        if (count, order) != current:
            current = count, order
            demonstrations = "".join(demonstration(example) for example in arranged(draw[:count], arrangement, order))
            # the last cell's cache freed before the next one's is allocated: two caches of a 64K
            # window and a 6.8B model's weights take more than 80 GB
            context = None
            context = SharedContext(model, with_text_start(tokenizer, tokenizer.encode(demonstrations)))
        # one text, beginning as the tokenizer begins a text (Llama's BOS)
        prompt = with_text_start(tokenizer, tokenizer.encode(demonstrations + query(tests[index])))[-room:]
        with torch.no_grad():
            answer = names[constrained_answer(model, prompt, labels, context)] == tests[index].label
        correct[shots.index(count), order] += answer
        if cache is not None:
            cache.add(cell, answer)
        if on_answer is not None:
            on_answer(len(prompt))
    return sum_across_ranks(correct) / len(tests)


def icl_cli(load: str | None, dataset: str, dataset_config: str | None = None, text_key: str = "text",
            label_key: str = "label", train_split: str = "train", test_split: str = "test",
            shots: Sequence[int] | None = None, examples: int = 100, orders: int = 1, arrangement: str = "random",
            seed: int = 0, output: str | None = None, cache: str | None = None, hf: str | None = None,
            dtype: str | None = None, window: int | None = None) -> int:
    """`megadiff icl --load RUN --dataset NAME` (or `--hf DIR`: a transformers model, e.g. an adapted
    export): print (and write) accuracy by number of shots; with `cache`, answers are kept as they
    come and a rerun computes only the rest (AnswerCache)."""
    if examples < 1 or orders < 1 or (shots is not None and min(shots, default=0) < 1):
        raise ConfigError("--examples, --orders and every --shots must be >= 1")
    if arrangement not in ARRANGEMENTS:
        raise ConfigError(f"--arrangement must be one of {ARRANGEMENTS}")
    pool = load_examples(dataset, dataset_config, train_split, text_key, label_key)
    tests = load_examples(dataset, dataset_config, test_split, text_key, label_key)
    generator = random.Random(seed)
    draw, tests = generator.sample(pool, len(pool)), generator.sample(tests, min(examples, len(tests)))
    if shots is not None and max(shots) > len(draw):
        raise ConfigError(f"--shots {max(shots)} asks for more demonstrations than the {len(draw)} of the "
                          f"{train_split} split")
    model = load_model(load, hf, dtype, window)  # after the data's checks; under torchrun it joins the process group
    console = command_console()
    settings, own_settings = model_settings(model, window, dtype)
    window = settings["window"]
    shots = sorted(set(shots)) if shots else default_shots(model.tokenizer, draw, tests, window)
    answers = None if cache is None else AnswerCache(cache, {
        "checkpoint": str(Path(model.checkpoint_dir).resolve()), "dataset": dataset, "dataset_config": dataset_config,
        "text_key": text_key, "label_key": label_key, "train_split": train_split, "test_split": test_split,
        "examples": len(tests), "seed": seed, "arrangement": arrangement, "label_end": LABEL_END,
        "text_start": list(model.tokenizer.text_start), **settings},
        # caches from before labels ended as the demonstrations do, and prompts began with a BOS
        {**own_settings, "label_end": "\n", "text_start": []})
    known = {} if answers is None else answers.answers()
    cells = grid_cells(shots, orders, len(tests))
    to_answer = sum(cell not in known for cell in cells)
    if answers is not None:
        console.print(f"icl: {len(cells) - to_answer} answers from {cache}, {to_answer} to compute")
    with command_progress("icl") as progress:
        task = ProgressTask(progress, f"{len(shots)} shot counts x {orders} orders", share_size(to_answer))
        grid = accuracy_grid(model, draw, tests, shots, orders, arrangement, lambda tokens: task.advance(1, tokens),
                             known, answers)
    rows = [{"shots": count, "accuracy": row.mean().item(), "worst": row.min().item(), "best": row.max().item(),
             "by_order": row.tolist()} for count, row in zip(shots, grid)]
    report = {"checkpoint": str(model.checkpoint_dir), "dataset": dataset, "examples": len(tests),
              "labels": len({example.label for example in draw}), "arrangement": arrangement, "orders": orders,
              "window": window, "by_shots": rows}
    table = Table(title=f"{report['checkpoint']}: {dataset}, {len(tests)} test examples, {orders} order(s) "
                        f"({arrangement})")
    for column in ("shots", "accuracy", "worst", "best"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["shots"]), *(f"{row[key]:.3f}" for key in ("accuracy", "worst", "best")))
    console.print(table)
    write_report(console, report, output)
    return 0
