"""`megadiff evaluate`: a checkpoint's held-out loss, overall and by position in the sequence.

The samples are the checkpoint's own validation (or test) split, i.e. documents its run never
trained on, cut as training cuts them (megatron's GPTDataset), or any prepared data named with
`data.*` overrides. `--seq-length` longer than the run's probes RoPE extrapolation or checks a
64K extension. Reported: the mean next-token loss and its perplexity, and per position bucket
the mean loss of the positions in it and the cumulative mean up to its end (the DIFF paper's
long-context curve: it should keep falling as the context grows). JSON with --output.
The loss is also split as the DIFF paper's ablations (its table 6, after Zoology) split it: on
"AR-hit" tokens, which complete a bigram seen earlier in the context (associative recall), and on
the others (inference/recall.py). Only the tokens training takes the loss on are scored: the
dataset's loss mask, i.e. a prompt/response run's responses and, with data.eod_mask_loss, no EOD.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megadiff.checkpoint.format import checkpoint_config, resolve_checkpoint_dir
from megadiff.checkpoint.single_process import CausalLM
from megadiff.config import Config, ConfigError
from megadiff.config.loader import saved_config
from megadiff.config.validate import validate_data
from megadiff.data.checks import check_training_data_once, split_documents
from megadiff.data.datasets import build_datasets, megatron_blend, source_config
from megadiff.data.errors import DataError
from megadiff.data.indexed import open_index, refuse_unprepared
from megadiff.data.locations import training_blend
from megadiff.data.prepare import ensure_prepared
from megadiff.inference.hf_model import HFCausalLM, hf_run_config, hf_window, load_model
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import share, share_size, sum_across_ranks
from megadiff.inference.recall import (
    DEFAULT_SAMPLE_TOKENS, FrequentBigrams, blend_recall, recall_hits, recall_split,
)
from megadiff.inference.reporting import command_console, write_report

SPLITS = ("valid", "test")


def evaluation_config(model_cfg: Config, seq_length: int | None, overrides: Iterable[str]) -> Config:
    """The checkpoint's config (a model's `cfg`) with the evaluation's sequence length and data overrides
    (checked: the rest was the training run's to check)."""
    # the held-out documents each once: a length-upsampled run (the 64K extension) repeats its long documents in
    # every split, so its first samples would hold some twice and leave others out
    overrides = ["data.length_upsampling=false", "data.length_upsampling_unit=null", *overrides]
    named = {override.split("=", 1)[0].strip() for override in overrides}
    if named & {"data.prefix", "data.blend"} and "data.bundled_corpus" not in named:
        # the held-out text is the data named, not a bundled corpus the run trained on: that corpus would
        # be prepared at the prefix named (a mistyped one), or refused for the data there
        overrides.insert(0, "data.bundled_corpus=null")
    if "data.prefix" in named and "data.blend" not in named:
        # a run's data.blend takes the place of its data.prefix: kept, it was evaluated instead of the prefix named
        overrides.insert(0, "data.blend=[]")
    if seq_length is not None:
        overrides.append(f"model.seq_length={seq_length}")
    cfg = saved_config(model_cfg.model_dump(mode="json"), overrides)
    validate_data(cfg.data)
    return cfg


def check_before_loading(load: str | None, hf: str | None, window: int | None, seq_length: int | None,
                         overrides: Iterable[str]) -> None:
    """The data.* overrides and the held-out data they name, checked against the settings the checkpoint (or the
    --hf directory's export) saved, before the minutes of reading its weights: a mistyped key or prefix was found
    only once the model had loaded. A bundled corpus is prepared later, on first use."""
    if (load is None) == (hf is None):
        return  # load_model says to give one of them
    saved = checkpoint_config(resolve_checkpoint_dir(load)) if load is not None else \
        hf_run_config(hf, hf_window(hf, window))
    cfg = evaluation_config(saved, seq_length, overrides)
    prefixes, _ = training_blend(cfg.data)
    if not cfg.data.bundled_corpus:
        for prefix in prefixes:
            refuse_unprepared(prefix, "data.blend" if cfg.data.blend else "data.prefix")


def distinct_samples(cfg, split: str) -> int | None:
    """How many samples one pass over `split`'s documents of cfg's one prefix gives (asked for more,
    megatron's GPTDataset shuffles a second epoch, i.e. repeats, in among them); None for a
    split data.split gives no share."""
    (prefix,), _ = training_blend(cfg.data)
    splits = split_documents(open_index(prefix), cfg.data.split)  # the data was checked (read_index) first
    if split not in splits:
        return None
    _, _, tokens = splits[split]
    return max((tokens - 1) // cfg.model.seq_length, 0)  # a sample reads seq_length + 1 tokens


def held_out_dataset(cfg, tokenizer, split: str, sequences: int, console: Console):
    """`split`'s samples of cfg's one prefix (source_config) as training cuts them: at most
    `sequences`, and no document twice."""
    distinct = distinct_samples(cfg, split)
    if distinct is not None and sequences > distinct:
        console.print(f"evaluate: the {split} split of {cfg.data.prefix} holds {distinct} distinct sequences of "
                      f"{cfg.model.seq_length} tokens; evaluating those")
        sequences = distinct
    wanted = (0, sequences, 0) if split == "valid" else (0, 0, sequences)
    dataset = build_datasets(cfg, tokenizer, wanted, seed=cfg.train.seed)[SPLITS.index(split) + 1]
    if dataset is None:
        raise ConfigError(f"data.split {cfg.data.split!r} gives the {split} split no documents; evaluate the other "
                          "split or set data.split")
    return dataset


def sample_batches(dataset, indices: Sequence[int], batch_size: int,
                   keys: tuple[str, ...] = ("tokens", "labels")) -> Iterator[tuple[torch.Tensor, ...]]:
    """The `keys` fields [b, N] (as int64) of the dataset's samples at `indices`, `batch_size` at a time."""
    for start in range(0, len(indices), batch_size):
        items = [dataset[i] for i in indices[start:start + batch_size]]
        yield tuple(torch.from_numpy(np.stack([np.asarray(item[key]) for item in items])).long() for key in keys)


@torch.no_grad()
def position_losses(model: CausalLM | HFCausalLM, dataset, sequences: int, batch_size: int, on_batch=None,
                    document_eod: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[sequences, N] next-token losses (fp32, on the CPU) of the dataset's first `sequences` samples
    (with `document_eod`, attending within documents, as data.document_masking trains) and [sequences,
    N] booleans: which of them training takes the loss on. Each rank computes its share of the rows;
    every rank returns them all."""
    mine = list(share(range(sequences)))
    losses = torch.zeros(sequences, len(dataset[0]["labels"]))
    scored = torch.zeros_like(losses)
    rows, masks = [], []
    for tokens, labels, loss_mask in sample_batches(dataset, mine, batch_size, ("tokens", "labels", "loss_mask")):
        rows.append(model(tokens, labels, document_eod).float().cpu())
        masks.append(loss_mask.float())
        if on_batch is not None:
            on_batch(len(tokens))
    if rows:
        losses[mine], scored[mine] = torch.cat(rows), torch.cat(masks)
    return sum_across_ranks(losses), sum_across_ranks(scored).bool()


def summarize(losses: torch.Tensor, buckets: int, scored: torch.Tensor | None = None) -> dict:
    """Mean loss, perplexity and per-bucket (mean, cumulative mean) of the `scored` [sequences, N]
    losses (all of them by default)."""
    return blend_summary([(losses, scored, 1.0)], buckets)


def blend_summary(sources: list[tuple[torch.Tensor, torch.Tensor | None, float]], buckets: int) -> dict:
    """summarize() of a blend from its sources' (losses, scored, weight): each source's scored tokens
    count as much in all as its weight (normalised here) says, so that, where every position is
    scored, the loss position by position is the weighted mean of the sources'."""
    sums, counts, sequences, tokens = 0.0, 0.0, 0, 0
    for losses, scored, weight in sources:
        scored = torch.ones_like(losses, dtype=torch.bool) if scored is None else scored
        if not scored.any():
            raise DataError("evaluate: the samples hold no token the loss is taken on (every label is masked: "
                            "prompts only, or EODs with data.eod_mask_loss); evaluate more --sequences")
        per_token = weight / int(scored.sum())
        sums = sums + losses.double().where(scored, 0.0).sum(0) * per_token
        counts = counts + scored.double().sum(0) * per_token
        sequences, tokens = sequences + losses.shape[0], tokens + int(scored.sum())
    return summarize_positions(sums, counts, sequences, tokens, buckets)


def summarize_positions(sums: torch.Tensor, counts: torch.Tensor, sequences: int, tokens: int, buckets: int) -> dict:
    """summarize() from the (weighted) sum of the scored losses and their count at each position [N]."""
    seq_length = sums.numel()
    edges = np.linspace(0, seq_length, min(buckets, seq_length) + 1).round().astype(int)

    def mean(total: torch.Tensor, count: torch.Tensor) -> float:
        return (total / count).item() if count > 0 else float("nan")

    cumulative_sums, cumulative_counts = sums.cumsum(0), counts.cumsum(0)
    rows = [{"positions": [int(lo), int(hi)], "mean_loss": mean(sums[lo:hi].sum(), counts[lo:hi].sum()),
             "cumulative_loss": mean(cumulative_sums[hi - 1], cumulative_counts[hi - 1])}
            for lo, hi in zip(edges[:-1], edges[1:])]
    loss = mean(sums.sum(), counts.sum())
    return {"sequences": sequences, "seq_length": seq_length, "tokens": tokens, "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)), "by_position": rows}


def check_request(command: str, split: str, overrides: Iterable[str], **counts: int) -> None:
    """The command line's own mistakes, before a checkpoint is read."""
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {SPLITS}, got {split!r}")
    too_small = [f"--{name.replace('_', '-')}" for name, value in counts.items() if value < 1]
    if too_small:
        raise ConfigError(f"{', '.join(too_small)} must be >= 1")
    unexpected = [o for o in overrides if not o.startswith("data.")]
    if unexpected:
        raise ConfigError(f"{command} takes data.* overrides only (the model is the checkpoint's), got {unexpected}")


def evaluate(load: str | None, split: str = "valid", seq_length: int | None = None, sequences: int = 16,
             batch_size: int = 1, buckets: int = 8, overrides: Iterable[str] = (), output: str | None = None,
             frequent_bigrams: float | None = None, bigram_sample_tokens: int | None = None, hf: str | None = None,
             dtype: str | None = None, window: int | None = None) -> int:
    """`megadiff evaluate --load RUN` (or `--hf DIR`: a transformers model, its held-out text named
    by the data.* overrides): print (and with `output`, write as JSON) the held-out losses; with
    `frequent_bigrams` (per million), Zoology's filter on the AR hits (inference/recall.py)."""
    sample_tokens = DEFAULT_SAMPLE_TOKENS if bigram_sample_tokens is None else bigram_sample_tokens
    check_request("evaluate", split, overrides, sequences=sequences, batch_size=batch_size, buckets=buckets,
                  bigram_sample_tokens=sample_tokens)
    if frequent_bigrams is not None and not frequent_bigrams > 0:
        raise ConfigError(f"--frequent-bigrams must be > 0 (occurrences per million), got {frequent_bigrams}")
    frequent = None if frequent_bigrams is None else FrequentBigrams(frequent_bigrams, sample_tokens)
    check_before_loading(load, hf, window, seq_length, overrides)
    model = load_model(load, hf, dtype, window)  # first: under torchrun it joins the ranks' process group
    console = command_console()
    cfg = evaluation_config(model.cfg, seq_length, overrides)
    ensure_prepared(cfg)
    # every source checked before the first is evaluated: a blend's later source prepared with another tokenizer
    # (or too short for one sample) was refused only when its turn came, the earlier ones' hours at 64K lost
    check_training_data_once(cfg, model.tokenizer, (split,))
    prefixes, weights = megatron_blend(cfg.data)  # an unweighted blend is weighted by tokens, as in training
    progress = command_progress("evaluate")
    with progress:
        per_source = [_source_losses(model, source_config(cfg, prefix), split, sequences, batch_size, console,
                                     progress, frequent) for prefix in prefixes]
    splits = [recall_split(losses, hits, scored) for losses, scored, hits in per_source]
    if len(prefixes) == 1:
        losses, scored, _ = per_source[0]
        report = {**summarize(losses, buckets, scored), "recall": splits[0]}
    else:
        report = blend_summary([(losses, scored, weight) for (losses, scored, _), weight in zip(per_source, weights)],
                               buckets)
        report["recall"] = blend_recall(splits, weights)
        report["sources"] = [{"prefix": prefix, "weight": weight, **summarize(losses, buckets, scored),
                              "recall": split}
                             for prefix, weight, (losses, scored, _), split in zip(prefixes, weights, per_source,
                                                                                   splits)]
    report.update(checkpoint=str(model.checkpoint_dir), split=split, data=prefixes,
                  document_masking=cfg.data.document_masking,
                  frequent_bigrams=None if frequent is None else asdict(frequent))
    _print(console, report)
    write_report(console, report, output)
    return 0


def _source_losses(model: CausalLM | HFCausalLM, cfg, split: str, sequences: int, batch_size: int, console: Console,
                   progress: Progress, frequent: FrequentBigrams | None) -> tuple[torch.Tensor, ...]:
    """position_losses() (losses, scored) and recall_hits() of cfg's one prefix, with a progress bar of its own."""
    dataset = held_out_dataset(cfg, model.tokenizer, split, sequences, console)
    count = min(sequences, len(dataset))
    task = ProgressTask(progress, cfg.data.prefix, share_size(count))

    def advance(batch: int) -> None:
        task.advance(batch, batch * cfg.model.seq_length)

    eod = model.tokenizer.eod if cfg.data.document_masking else None
    losses, scored = position_losses(model, dataset, count, batch_size, advance, eod)
    if frequent is not None:  # tens of seconds at the default sample on one rank
        console.print(f"evaluate: counting bigrams in up to {frequent.sample_tokens:,} training tokens of "
                      f"{cfg.data.prefix}")
    return losses, scored, recall_hits(dataset, count, eod, frequent, cfg.data, model.tokenizer.text_start)


def _print(console: Console, report: dict) -> None:
    table = Table(title=f"{report['checkpoint']}: {report['split']} loss {report['loss']:.4f} "
                        f"(perplexity {report['perplexity']:.2f}) over {report['tokens']:,} tokens")
    for column in ("positions", "mean loss", "cumulative mean loss"):
        table.add_column(column, justify="right")
    for row in report["by_position"]:
        lo, hi = row["positions"]
        table.add_row(f"{lo:,}-{hi - 1:,}", f"{row['mean_loss']:.4f}", f"{row['cumulative_loss']:.4f}")
    console.print(table)
    recall, frequent = report["recall"], report["frequent_bigrams"]
    rare = "" if frequent is None else f", rarer than {frequent['per_million']:g} per million training bigrams"
    console.print(f"AR-hit tokens (a bigram seen before in the context{rare}): loss {recall['ar_hit']['loss']:.4f} "
                  f"over "
                  f"{recall['ar_hit']['tokens']:,}; the others: {recall['others']['loss']:.4f} over "
                  f"{recall['others']['tokens']:,}")
    for source in report.get("sources", ()):
        console.print(f"  {source['prefix']} (weight {source['weight']:g}): loss {source['loss']:.4f}, perplexity "
                      f"{source['perplexity']:.2f}, {source['sequences']} sequences")
