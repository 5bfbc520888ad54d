"""prepare-data: text (data.sources or a bundled corpus) -> tokenizer -> megatron indexed dataset.

Every document becomes one sequence of <prefix>.bin followed by the tokenizer's EOD id
(documents with no tokens are skipped), in source order whatever data.workers is. With
data.response_key (supervised fine-tuning) a record's prompt (data.text_key) and response make
one document, and <prefix>-loss-mask.bin/.idx holds 1 on each response's tokens and its EOD;
with data.messages_key a record's conversation, rendered by the chat template, makes one, the
mask on the assistant's turns (data/conversations.py).

Each source file (consecutive small txt files together) is tokenized on its own first, into a part
under <prefix>.parts/ (its own .bin/.idx, its manifest written last); then the parts are concatenated
into <prefix>.bin/.idx,
<prefix>.manifest.json is written last and the parts are deleted. A run that stops keeps its
finished parts, so running it again tokenizes only the rest; `--part I/N` tokenizes every N-th
part only, for N processes or nodes sharing the work before one plain run merges. A run with
the same sources and tokenizer as the manifest's does nothing, so preparing again is always safe.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch.distributed as dist
from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from megadiff.config import Config, DataConfig, load_config
from megadiff.console import plain_console, progress_bars
from megadiff.data.conversations import resolve_chat_template
from megadiff.data.corpus import write_bundled_corpus
from megadiff.data.errors import DataError
from megadiff.data.indexed import (
    LOSS_MASK_DTYPE, AtomicIndexedWriter, bin_path, idx_path, loss_mask_prefix, refuse_too_many_documents,
    token_dtype,
)
from megadiff.data.locations import corpus_dir, data_prefix
from megadiff.data.manifest import (
    is_up_to_date, manifest_path, read_manifest, remove_manifest, tokenizer_fingerprint, write_manifest,
)
from megadiff.data.sources import Source, load_texts, record_fields, resolve_sources
from megadiff.data.tokenize_workers import Encoder
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN, Tokenizer, load_tokenizer
from megadiff.files import HeldElsewhere, exclusive_lock, held_shared, shared_lock

DOCUMENTS_PER_BATCH = 256
PARTS_SUFFIX = ".parts"
# what prepared prompt/response data and conversations count besides: the tokens the loss is taken
# on (responses or the assistant's turns, and their EODs), and the EOD ids inside documents (a
# chat template that writes the tokenizer's EOS at every turn's end), which document masking
# would cut the documents at
MASKED_STATS = ("loss_tokens", "inner_eods")


def prepare_from_config(config_path: str, overrides: Iterable[str] = (), part: Optional[str] = None) -> int:
    """`megadiff prepare-data CONFIG [key=value ...] [--part I/N]`."""
    data = load_config(config_path, overrides).data
    if part is None:
        prepare(data)
    else:
        prepare_share(data, *parse_share(part))
    return 0


def parse_share(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise DataError(f"--part: expected I/N with 0 <= I < N (e.g. 0/4 ... 3/4), got {text!r}")
    return index, count


def ensure_prepared(cfg: Config) -> None:
    """Pre-training's first data step: prepare a bundled corpus whose data is missing or stale.

    Safe to call from several processes at once (they take turns on a lock file and the
    later ones find the work done); pre-training calls it on global rank 0, then a barrier.
    Data from data.sources is left to `megadiff prepare-data`, run beforehand.
    """
    if cfg.data.bundled_corpus:
        # the checkpoint commands call it on every rank of torchrun (needles before the ranks' group forms):
        # each said the data was up to date
        prepare(cfg.data, plain_console(quiet=_launched_rank() != 0))


def _launched_rank() -> int:
    """This process's rank: its process group's, else the one torchrun or Slurm's scripts set (RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


WAIT_FOR_PREPARING_SECONDS = 60


@contextlib.contextmanager
def not_being_prepared(prefixes: Iterable[str]) -> Iterator[None]:
    """Shared locks on the prefixes' `<prefix>.lock`, which preparing takes exclusively, while a run opens their
    files: prepare-data replacing them meanwhile made a starting run say they were missing, or fail reading them.
    A minute's wait first: finding data up to date holds the lock for a moment too."""
    with contextlib.ExitStack() as held:
        for prefix in prefixes:
            try:
                held.enter_context(held_shared(f"{prefix}.lock", wait_seconds=WAIT_FOR_PREPARING_SECONDS))
            except HeldElsewhere:
                raise DataError(f"data.prefix: {prefix} is being prepared (a process preparing it, prepare-data or a "
                                f"run's bundled corpus, holds {prefix}.lock): run again once it ends") from None
        yield


@dataclass(frozen=True)
class _Plan:
    data: DataConfig
    prefix: str
    sources: list[Source]
    parts: list[Source]
    tokenizer: Tokenizer
    chat_template: Optional[str]
    fingerprint: dict

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.tokenizer.vocab_size)

    def part_prefix(self, index: int) -> Path:
        return parts_dir(self.prefix) / f"{index:05d}"

    @property
    def outputs(self) -> list[tuple[Callable[[Path], Path | str], str, np.dtype]]:
        """(a part's files of the output, the output's prefix, its dtype) of every indexed dataset
        written: the tokens, and prompt/response or conversation data's loss mask."""
        outputs = [(lambda part: part, self.prefix, self.dtype)]
        if self.data.masks_loss:
            outputs.append((loss_mask_prefix, loss_mask_prefix(self.prefix), LOSS_MASK_DTYPE))
        return outputs

    def output_prefixes(self, part: Optional[Path] = None) -> list[str | Path]:
        """The indexed datasets written at the prefix (or at a part's): what its manifest records."""
        return [output if part is None else of_part(part) for of_part, output, _ in self.outputs]

    def up_to_date(self, console: Console) -> Optional[dict]:
        """The manifest's stats when the prepared data matches the sources (and say so), else None."""
        if not is_up_to_date(self.prefix, self.fingerprint, self.output_prefixes()):
            return None
        stats = read_manifest(self.prefix)["stats"]
        console.print(f"prepare-data: {self.prefix} is up to date ({stats['documents']:,} documents, "
                      f"{stats['tokens']:,} tokens); nothing to do", soft_wrap=True)
        return stats


def parts_dir(prefix: str | Path) -> Path:
    return Path(f"{prefix}{PARTS_SUFFIX}")


def _plan(data: DataConfig) -> _Plan:
    """Call with the prefix's lock held: a bundled corpus is written here (whole, by a rename: shares holding
    the lock shared may each write it)."""
    prefix = data_prefix(data)
    entries = [str(write_bundled_corpus(data.bundled_corpus, corpus_dir(data)))] if data.bundled_corpus \
        else data.sources
    # a prefix inside a source directory must not read its own manifest and parts as sources, nor a source directory
    # holding data.cache_dir (data/ holds data/cache by default) what runs write there: a bundled corpus's
    # jsonl, megatron's index descriptions (.txt)
    ignored = (manifest_path(prefix), parts_dir(prefix), Path(data.cache_dir))
    sources = resolve_sources(entries, ignored=ignored)
    tokenizer = load_tokenizer(data.tokenizer)
    chat_template = resolve_chat_template(data, tokenizer)
    parts = [part for source in sources for part in source.parts()]
    return _Plan(data, prefix, sources, parts, tokenizer, chat_template,
                 _fingerprint(sources, data, tokenizer, chat_template))


def prepare(data: DataConfig, console: Console | None = None) -> dict:
    """Prepare data.sources (or data.bundled_corpus) at data_prefix(data); returns the manifest's stats."""
    console = console or plain_console()
    lock = f"{data_prefix(data)}.lock"
    # checked holding the lock shared first: most calls find the data prepared (every rank of a checkpoint command
    # calls it), and took turns loading the tokenizer and checking the sources (seconds each, for every rank)
    with shared_lock(lock, "another process preparing this data"):
        stats = _checked_plan(data, console)[1]
    if stats is not None:
        return stats
    with exclusive_lock(lock, "another process preparing this data"):
        plan, stats = _checked_plan(data, console)  # again: another process may have prepared it meanwhile
        if stats is not None:
            return stats
        _remove_outputs(plan)
        part_stats = _prepare_parts(plan, range(len(plan.parts)))
        stats = _merge(plan, part_stats)
        write_manifest(plan.prefix, plan.fingerprint, stats, plan.output_prefixes())
        shutil.rmtree(parts_dir(plan.prefix))
    _print_summary(console, plan.output_prefixes(), stats, data)
    return stats


def _checked_plan(data: DataConfig, console: Console) -> tuple[_Plan, Optional[dict]]:
    """The plan, and the manifest's stats where the data prepared at its prefix is up to date (said so)."""
    plan = _plan(data)
    _refuse_replacing_other_data(plan)
    return plan, plan.up_to_date(console)


def _remove_outputs(plan: _Plan) -> None:
    """The prefix's data of other sources or tokenizer, before any of its new data is written: a failed or
    killed run would leave it there to be trained on, with the manifest that told it apart gone."""
    remove_manifest(plan.prefix)
    for prefix in plan.output_prefixes():
        for path in (bin_path(prefix), idx_path(prefix)):
            path.unlink(missing_ok=True)
            # a merge killed before its rename: a corpus-sized file at each preemption, never read
            for leftover in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
                leftover.unlink()


def prepare_share(data: DataConfig, index: int, count: int, console: Console | None = None) -> None:
    """Tokenize parts index, index + count, ... only (one of `count` processes sharing the work);
    a plain `prepare` afterwards finds them done and merges."""
    console = console or plain_console()
    # shared: shares plan (a tokenizer loaded, every source file checked) and tokenize side by side, where taking
    # turns on it serialised their starts (minutes for hundreds of shares of 10,000 files); a plain run, which
    # merges and removes the parts, holds it exclusively, so it waits for the shares running and they for it
    with shared_lock(f"{data_prefix(data)}.lock", "a plain prepare-data of this data (it tokenizes, then merges)"):
        plan, stats = _checked_plan(data, console)
        if stats is not None:
            return
        mine = range(index, len(plan.parts), count)
        _prepare_parts(plan, mine)
    console.print(f"prepare-data: --part {index}/{count} of {plan.prefix} done ({len(mine)} of its {len(plan.parts)} "
                  "parts); once every share is done, run prepare-data without --part to merge them", soft_wrap=True)


def _refuse_replacing_other_data(plan: _Plan) -> None:
    """A bundled corpus is prepared at data.prefix where one is given: data prepared there from other
    sources (a demo config given data.prefix=... to train on one's own data) would be overwritten."""
    if not (plan.data.bundled_corpus and plan.data.prefix) or not bin_path(plan.prefix).exists():
        return
    manifest = read_manifest(plan.prefix)
    made_from = None if manifest is None else _source_names(manifest["fingerprint"]["sources"])
    if made_from == _source_names(plan.fingerprint["sources"]):
        return  # the corpus itself, prepared before (perhaps with another tokenizer or data.cache_dir)
    raise DataError(f"data.prefix: {plan.prefix} holds data prepared from {made_from or 'sources no manifest names'}, "
                    f"which data.bundled_corpus={plan.data.bundled_corpus} would replace with the bundled corpus: set "
                    "data.bundled_corpus=null to use that data, or give another data.prefix for the corpus")


def _source_names(fingerprints: list) -> list:
    """The files of sources' fingerprints as a bundled corpus names them (corpus/kjv.jsonl, in whichever
    data.cache_dir), or the hub datasets, without their sizes and times."""
    return [[list(Path(entry[0]).parts[-2:]) if isinstance(entry, list) else entry for entry in source]
            for source in fingerprints]


def _fingerprint(sources: list[Source], data: DataConfig, tokenizer: Tokenizer, chat_template: Optional[str]) -> dict:
    return {
        "sources": [source.fingerprint() for source in sources],
        "text_key": data.text_key,
        # a txt file's BOM dropped (before: read as a character beginning its document)
        **({"txt_bom": "dropped"} if any(source.builder == "text" for source in sources) else {}),
        # a pair encoded as one text (before: its prompt and response apart, which changed SentencePiece's text);
        # a record without its prompt skipped (before: its response was trained on alone)
        **({"response_key": data.response_key, "pair_encoding": "one text", "without_prompt": "skipped"}
           if data.response_key is not None else {}),
        # encoded as one text (before: piece by piece, which split tokens at the turns' edges); {% generation %} blocks
        # found by the marks they write (before: by transformers' tracker, which gave a block written by a macro or
        # inside a filter the range of earlier text)
        **({"messages_key": data.messages_key, "chat_template": hashlib.sha256(chat_template.encode()).hexdigest(),
            "conversation_encoding": "one text", "generation_blocks": "marked"} if chat_template is not None else {}),
        # a document's first token takes no loss (before: without a start token, an empty prompt's response or an
        # opening assistant turn was learnt from the document packed before it)
        **({"first_token": "context"} if data.masks_loss else {}),
        # a token holding a split character's first bytes (tiktoken's) takes its loss (before: its offsets left it out)
        **({"split_characters": "whole"} if data.masks_loss and data.tokenizer in PACKAGED_TIKTOKEN else {}),
        "tokenizer": tokenizer_fingerprint(data.tokenizer, tokenizer, documents=chat_template is None),
        "dtype": token_dtype(tokenizer.vocab_size).name,
    }


class _TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        if "tokens" not in task.fields:
            return Text("")
        rate = task.fields["tokens"] / task.elapsed if task.elapsed else 0.0
        return Text(f"{task.fields['tokens']:,} tokens  {rate:,.0f} tokens/s")


def _prepare_parts(plan: _Plan, indices: range) -> dict[int, dict]:
    """{part index: its stats}: parts already prepared from the same file are kept, the others tokenized."""
    progress = progress_bars(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                             _TokensPerSecond(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                             console=Console(stderr=True))
    stats, documents = {}, 0
    with Encoder(plan.data.tokenizer, plan.dtype.name, plan.data.workers) as encoder, progress:
        overall = progress.add_task("parts", total=len(indices), visible=len(indices) > 1)
        for index in indices:
            stats[index] = _prepare_part(plan, index, encoder, progress)
            progress.advance(overall)
            # refused as soon as the parts pass it, not after the rest of a corpus was tokenized; a running count
            # (summing the parts done at each part was quadratic in a corpus's thousands of files)
            documents += stats[index]["documents"]
            refuse_too_many_documents(documents, plan.prefix)
    return stats


def _prepare_part(plan: _Plan, index: int, encoder: Encoder, progress: Progress) -> dict:
    prefix, source = plan.part_prefix(index), plan.parts[index]
    fingerprint = plan.fingerprint | {"sources": [source.fingerprint()]}
    # a plain run and --part runs may reach the same part
    with exclusive_lock(f"{prefix}.lock", "another process preparing this part"):
        if is_up_to_date(prefix, fingerprint, plan.output_prefixes(prefix)):
            return read_manifest(prefix)["stats"]
        remove_manifest(prefix)
        label = f"tokenizing part {index + 1}/{len(plan.parts)}" if len(plan.parts) > 1 else "tokenizing"
        stats = _tokenize(prefix, source, plan, encoder, progress, label)
        write_manifest(prefix, fingerprint, stats, plan.output_prefixes(prefix))
    return stats


def _deciding_fields(data: DataConfig) -> dict[str, tuple[str, str]]:
    """{column: (setting, field)} of what a record without any of them is skipped for: its text, its prompt and
    response (a response without its prompt would teach answering a question never asked), or its conversation."""
    return record_fields(data.text_key, data.response_key, data.messages_key)


def _records_missing_a_field(texts, data: DataConfig) -> int:
    """How many records lack one of _deciding_fields (null: a misspelt key, or records of another format)."""
    import pyarrow.compute as pc

    missing = None
    for column in _deciding_fields(data):
        null = pc.is_null(texts.data.column(column))
        missing = null if missing is None else pc.or_(missing, null)
    return int(pc.sum(missing).as_py() or 0)


def _stats(plan: _Plan, texts: int, documents: int, missing: int, tokens: int, seconds: float,
           masked: dict | None = None) -> dict:
    """What a part or the whole holds; `missing`: the records skipped without a _deciding_fields one (a misspelt key, or
    records of another format); `masked` (MASKED_STATS), of prompt/response data and conversations."""
    return {"documents": documents, "skipped_empty": texts - documents, "skipped_missing": missing, "tokens": tokens,
            **(masked or {}), "seconds": round(seconds, 3), "tokens_per_second": round(tokens / max(seconds, 1e-9)),
            "dtype": plan.dtype.name, "tokenizer": plan.tokenizer.name}


def _tokenize(prefix: Path, source: Source, plan: _Plan, encoder: Encoder, progress: Progress, label: str) -> dict:
    # datasets converts the source to Arrow first; keep that copy beside the output, and only for this part
    work_dir = tempfile.mkdtemp(prefix=".prepare-", dir=prefix.parent)
    try:
        data = plan.data
        texts = load_texts([source], record_fields(data.text_key, data.response_key, data.messages_key), work_dir)
        missing = _records_missing_a_field(texts, data)
        documents, tokens, masked = 0, 0, dict.fromkeys(MASKED_STATS, 0)
        task = progress.add_task(label, total=len(texts), tokens=0)
        start = time.perf_counter()
        batches = texts.iter(batch_size=DOCUMENTS_PER_BATCH)
        with contextlib.ExitStack() as files:
            writer = files.enter_context(AtomicIndexedWriter(prefix, plan.dtype))
            if data.masks_loss:
                masks = files.enter_context(AtomicIndexedWriter(loss_mask_prefix(prefix), LOSS_MASK_DTYPE))
            if data.messages_key is not None:
                encoded = encoder.encode_conversations_in_order((batch["messages"] for batch in batches),
                                                                plan.chat_template)
            elif data.response_key is not None:
                encoded = encoder.encode_pairs_in_order((batch["text"], batch["response"]) for batch in batches)
            else:
                encoded = encoder.encode_in_order(batch["text"] for batch in batches)
            for ids, lengths, *mask in encoded:
                writer.add_documents(ids, lengths)
                if mask:
                    masks.add_documents(mask[0], lengths)
                    masked["loss_tokens"] += int(mask[0].sum(dtype=np.int64))
                    masked["inner_eods"] += int((ids == plan.tokenizer.eod).sum()) - int((lengths > 0).sum())
                documents, tokens = documents + int((lengths > 0).sum()), tokens + int(lengths.sum())
                progress.update(task, advance=len(lengths), tokens=tokens)
            writer.commit()
            if data.masks_loss:  # written after the tokens: a part's manifest still comes last
                masks.commit()
        progress.remove_task(task)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return _stats(plan, len(texts), documents, missing, tokens, time.perf_counter() - start,
                  masked if data.masks_loss else None)


def _merge(plan: _Plan, part_stats: dict[int, dict]) -> dict:
    """Concatenate the parts that hold documents, in source order, into <prefix>.bin/.idx."""
    texts = sum(s["documents"] + s["skipped_empty"] for s in part_stats.values())
    documents, tokens = (sum(s[key] for s in part_stats.values()) for key in ("documents", "tokens"))
    missing = sum(s.get("skipped_missing", 0) for s in part_stats.values())  # parts prepared before it was counted
    described = ", ".join(s.describe() for s in plan.sources)
    if texts == 0:
        raise DataError(f"data.sources: no documents in {described}")
    if documents == 0:
        raise DataError(f"data.sources: {texts:,} documents but no tokens (all texts are empty) in {described}")
    filled = [plan.part_prefix(i) for i in sorted(part_stats) if part_stats[i]["documents"]]
    for of_part, output, dtype in plan.outputs:
        if len(filled) == 1:  # nothing to concatenate: the part becomes the output
            os.replace(bin_path(of_part(filled[0])), bin_path(output))
            os.replace(idx_path(of_part(filled[0])), idx_path(output))
            continue
        with AtomicIndexedWriter(output, dtype) as writer:
            for part in filled:
                writer.add_prepared(of_part(part))
            writer.commit()
    masked = {key: sum(s.get(key, 0) for s in part_stats.values()) for key in MASKED_STATS} \
        if plan.data.masks_loss else None
    return _stats(plan, texts, documents, missing, tokens, sum(s["seconds"] for s in part_stats.values()), masked)


def _skipped(stats: dict, data: DataConfig) -> str:
    """The records skipped, for the documents line; those without the field apart (a wrong key?)."""
    skipped, missing = stats["skipped_empty"], stats.get("skipped_missing", 0)
    if not skipped:
        return ""
    if not missing:
        return f" ({skipped:,} empty skipped)"
    fields = " or ".join(f"{key!r} ({setting})" for setting, key in _deciding_fields(data).values())
    return f" ({skipped:,} skipped: {missing:,} without the field {fields}, {skipped - missing:,} empty)"


def _print_summary(console: Console, prefixes: list[str], stats: dict, data: DataConfig) -> None:
    """The stats and the files written: the tokens' (and a loss mask's) .bin and .idx."""
    table = Table(title=f"prepare-data: {prefixes[0]}", show_header=False)
    table.add_row("documents", f"{stats['documents']:,}" + _skipped(stats, data))
    table.add_row("tokens (EOD included)", f"{stats['tokens']:,} as {stats['dtype']}, tokenizer {stats['tokenizer']}")
    if "loss_tokens" in stats:
        table.add_row("loss tokens (responses or assistant turns, EOD)", f"{stats['loss_tokens']:,} "
                      f"({100 * stats['loss_tokens'] / max(stats['tokens'], 1):.1f}% of the tokens)")
    if stats.get("inner_eods"):
        table.add_row("EOD inside documents", f"{stats['inner_eods']:,}: the EOD ends turns too (a chat template "
                      "writing the tokenizer's EOS); train without data.document_masking, which would cut there")
    # the parts' own times: a run that merges parts tokenized earlier (--part) spends none of them itself
    table.add_row("tokenizing speed", f"{stats['tokens_per_second']:,} tokens/s ({stats['seconds']:.1f} s of "
                  "tokenizing, the parts' together)")
    for path in (file for prefix in prefixes for file in (bin_path(prefix), idx_path(prefix))):
        table.add_row("output", f"{path} ({path.stat().st_size:,} bytes)")
    console.print(table)
