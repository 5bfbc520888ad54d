"""prepare-data: text (data.sources or a bundled corpus) -> tokenizer -> megatron indexed dataset.

Every document becomes one sequence of <prefix>.bin followed by the tokenizer's EOD id
(documents with no tokens are skipped), in source order whatever data.workers is. Outputs
appear atomically and <prefix>.manifest.json is written last; a second run with the same
sources and tokenizer finds it and does nothing, so preparing again is always safe.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from megadiff.config import Config, DataConfig, load_config
from megadiff.data.corpus import write_bundled_corpus
from megadiff.data.errors import DataError
from megadiff.data.indexed import AtomicIndexedWriter, bin_path, idx_path, token_dtype
from megadiff.data.locations import corpus_dir, data_prefix
from megadiff.data.manifest import is_up_to_date, read_manifest, remove_manifest, write_manifest
from megadiff.data.sources import Source, load_texts, resolve_sources
from megadiff.data.tokenize_workers import encode_in_order
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN, Tokenizer, load_tokenizer
from megadiff.files import exclusive_lock

DOCUMENTS_PER_BATCH = 256


def prepare_from_config(config_path: str, overrides: Iterable[str] = ()) -> int:
    """`megadiff prepare-data CONFIG [key=value ...]`."""
    prepare(load_config(config_path, overrides).data)
    return 0


def ensure_prepared(cfg: Config) -> None:
    """Pre-training's first data step: prepare a bundled corpus whose data is missing or stale.

    Safe to call from several processes at once (they take turns on a lock file and the
    later ones find the work done); pre-training calls it on global rank 0, then a barrier.
    Data from data.sources is left to `megadiff prepare-data`, run beforehand.
    """
    if cfg.data.bundled_corpus:
        prepare(cfg.data)


def prepare(data: DataConfig, console: Console | None = None) -> dict:
    """Prepare data.sources (or data.bundled_corpus) at data_prefix(data); returns the manifest's stats."""
    console = console or Console()
    prefix = data_prefix(data)
    with exclusive_lock(f"{prefix}.lock"):
        entries = ([str(write_bundled_corpus(data.bundled_corpus, corpus_dir(data)))] if data.bundled_corpus
                   else data.sources)
        sources = resolve_sources(entries)
        tokenizer = load_tokenizer(data.tokenizer)
        fingerprint = _fingerprint(sources, data, tokenizer)
        if is_up_to_date(prefix, fingerprint):
            stats = read_manifest(prefix)["stats"]
            console.print(f"prepare-data: {prefix} is up to date ({stats['documents']:,} documents, "
                          f"{stats['tokens']:,} tokens); nothing to do", soft_wrap=True)
            return stats
        remove_manifest(prefix)
        stats = _tokenize(prefix, sources, data, tokenizer)
        write_manifest(prefix, fingerprint, stats)
    _print_summary(console, prefix, stats)
    return stats


def _fingerprint(sources: list[Source], data: DataConfig, tokenizer: Tokenizer) -> dict:
    spec = data.tokenizer if data.tokenizer in PACKAGED_TIKTOKEN else str(Path(data.tokenizer).resolve())
    return {
        "sources": [source.fingerprint() for source in sources],
        "text_key": data.text_key,
        "tokenizer": {"spec": spec, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
        "dtype": token_dtype(tokenizer.vocab_size).name,
    }


class _TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        rate = task.fields["tokens"] / task.elapsed if task.elapsed else 0.0
        return Text(f"{task.fields['tokens']:,} tokens  {rate:,.0f} tokens/s")


def _tokenize(prefix: str, sources: list[Source], data: DataConfig, tokenizer: Tokenizer) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    # datasets converts the sources to Arrow first; keep that copy beside the output, and only for this run
    work_dir = tempfile.mkdtemp(prefix=".prepare-", dir=Path(prefix).parent)
    try:
        texts = load_texts(sources, data.text_key, work_dir)
        if len(texts) == 0:
            raise DataError(f"data.sources: no documents in {', '.join(s.describe() for s in sources)}")
        documents, tokens = 0, 0
        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            _TokensPerSecond(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                            console=Console(stderr=True))
        with AtomicIndexedWriter(prefix, dtype) as writer, progress:
            task = progress.add_task("tokenizing", total=len(texts), tokens=0)
            start = time.perf_counter()
            batches = (batch["text"] for batch in texts.iter(batch_size=DOCUMENTS_PER_BATCH))
            for ids, lengths in encode_in_order(batches, data.tokenizer, dtype.name, data.workers):
                writer.add_documents(ids, lengths)
                documents, tokens = documents + int((lengths > 0).sum()), tokens + int(lengths.sum())
                progress.update(task, advance=len(lengths), tokens=tokens)
            if documents == 0:
                raise DataError(f"data.sources: {len(texts):,} documents but no tokens (all texts are empty) in "
                                f"{', '.join(s.describe() for s in sources)}")
            writer.commit()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    seconds = time.perf_counter() - start
    return {"documents": documents, "skipped_empty": len(texts) - documents, "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_second": round(tokens / max(seconds, 1e-9)),
            "dtype": dtype.name, "tokenizer": tokenizer.name}


def _print_summary(console: Console, prefix: str, stats: dict) -> None:
    table = Table(title=f"prepare-data: {prefix}", show_header=False)
    table.add_row("documents", f"{stats['documents']:,}" + (f" ({stats['skipped_empty']:,} empty skipped)"
                                                            if stats["skipped_empty"] else ""))
    table.add_row("tokens (EOD included)", f"{stats['tokens']:,} as {stats['dtype']}, tokenizer {stats['tokenizer']}")
    table.add_row("speed", f"{stats['tokens_per_second']:,} tokens/s ({stats['seconds']:.1f} s)")
    for path in (bin_path(prefix), idx_path(prefix)):
        table.add_row("output", f"{path} ({path.stat().st_size:,} bytes)")
    console.print(table)
