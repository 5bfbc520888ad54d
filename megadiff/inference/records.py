"""Results kept as they come, so long evaluations resume: one JSON line per result, appended,
flushed and synced before the next; a rerun reads them back and computes only the rest. A line
cut short by a crash is dropped (its result is computed again)."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from megadiff.config import ConfigError
from megadiff.errors import refused_together
from megadiff.files import appears
from megadiff.inference.ranks import gather_across_ranks
from megadiff.parallel import rank_and_world


@contextmanager
def utf8_input(what: str):
    """A user's file or standard input that is not UTF-8 text (a binary file given by mistake), refused naming
    it and the byte, not a traceback from the codec."""
    try:
        yield
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def lines_of(path: Path) -> list[str]:
    """A JSON-lines file's lines, split at "\n" alone: str.splitlines() also splits at U+2028, U+2029 and
    U+0085, which JSON written with ensure_ascii=False holds raw inside its strings."""
    return path.read_text(encoding="utf-8").split("\n")


def read_records(path: Path) -> list[dict]:
    """The records in `path` (none when it does not exist)."""
    records = []
    if path.exists():
        for line in lines_of(path):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def append_record(path: Path, record: dict) -> None:
    """`record` as the last line of `path` (created with its directory if need be); after a line a
    crash cut short, on a line of its own. Seconds of work lie between two records: opening the
    file each time costs nothing that matters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as out:  # appends wherever it reads
        cut_short = False
        if out.seek(0, os.SEEK_END):
            out.seek(-1, os.SEEK_END)
            cut_short = out.read(1) != b"\n"
        out.write((b"\n" if cut_short else b"") + json.dumps(record).encode() + b"\n")
        out.flush()
        os.fsync(out.fileno())


class RankRecords:
    """The records of one request in PATH_rankN.jsonl, a file per rank (so ranks never write one
    file together): every rank reads all of them, refusing another request's, and appends to its own.
    `defaults`: keys a request gained after records were first kept, at the value the older records,
    lacking them, were made with; a stored request lacking one is this one where it holds that value."""

    def __init__(self, path: str | Path, request: dict, option: str, defaults: dict | None = None):
        self.path, self.request, self.option = Path(path), request, option
        self.defaults = defaults or {}
        self.own_file = self._file_of(rank_and_world()[0])

    def read(self) -> list[tuple[Path, dict]]:
        """(file, record) of every rank's records so far (read by all ranks before any writes more). Collective."""
        files = self._files()
        return refused_together(lambda: [(file, record) for file in files for record in self._records_of(file)])

    def _files(self) -> list[Path]:
        """Every rank's file: those listed (ranks of earlier runs on more ranks too) and, by name, those of the
        ranks of this run that wrote one: a shared filesystem may list a file another node just made a moment
        late (NFS's directory caches), and its results, missing, were taken for never made."""
        written = gather_across_ranks(torch.tensor([int(self.own_file.exists())]))
        by_name = {self._file_of(rank) for rank, wrote in enumerate(written.tolist()) if wrote}
        return sorted(set(self.path.parent.glob(f"{self.path.name}_rank*.jsonl")) | by_name)

    def _file_of(self, rank: int) -> Path:
        return self.path.with_name(f"{self.path.name}_rank{rank}.jsonl")

    def _records_of(self, file: Path) -> list[dict]:
        if not appears(file):
            raise ConfigError(f"{file}, written by another rank, is not seen here: {self.option} must be on a "
                              "directory every node shares")
        records = read_records(file)
        for record in records:
            if {**self.defaults, **record["request"]} != self.request:
                raise ConfigError(f"{file} holds the results of another request ({record['request']}): give "
                                  f"this one another {self.option}")
        return records

    def add(self, record: dict) -> None:
        append_record(self.own_file, {"request": self.request, **record})


def model_settings(model, window: int | None, dtype: str | None) -> tuple[dict, dict]:
    """(the window and dtype `model` (a CausalLM or HFCausalLM) runs with, as a request records them:
    resolved, so that --dtype naming the weights' own dtype asks what omitting it asks; those of them
    left to the model, --window or --dtype omitted: the ones results kept before requests recorded them
    were made with)."""
    settings = {"window": model.cfg.model.seq_length, "dtype": str(model.dtype)}
    options = {"window": window, "dtype": dtype}
    return settings, {key: value for key, value in settings.items() if options[key] is None}
