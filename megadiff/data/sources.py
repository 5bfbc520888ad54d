"""data.sources -> one Hugging Face `datasets.Dataset` of document texts, in source order.

A source is a file (json/jsonl/ndjson with one document per record, parquet, or txt with one
document per file; optionally .gz/.bz2/.xz compressed; suffixes in any case), a directory or glob of such files
(sorted), or otherwise a dataset name loaded from the Hugging Face hub (split "train"). Every
source is checked when the plan is made, before any tokenizing: a hub name must load.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator, Optional

from megadiff.data.errors import DataError

BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz")
TEXT_TYPES = ("string", "large_string")
UTF8_BOM = "\ufeff"
# txt files (a document each) read as one part up to this size together: `datasets` spends ~80 ms on a load and
# its Arrow cache whatever the file's size, the most of preparing a corpus of small documents one file a part. Only
# txt: json and parquet files loaded together take the first one's fields and types, which another's may not have
TEXT_PART_BYTES = 64 << 20


@dataclass(frozen=True)
class Source:
    """Local files read by one `datasets` builder, or (builder "hub") a hub dataset name at the revision
    its builder found when the plan was made."""
    key: str                      # the config key, for messages: data.sources[i]
    builder: str
    files: tuple[Path, ...] = ()
    name: Optional[str] = None
    revision: Optional[str] = None  # the hub repository's commit (or its cached copy's)

    def describe(self) -> str:
        return self.name if self.builder == "hub" else ", ".join(str(f) for f in self.files)

    def parts(self) -> list["Source"]:
        """One source per file (a hub dataset stays one, consecutive txt files make one up to TEXT_PART_BYTES):
        the unit prepare-data resumes and shares out."""
        if self.builder == "hub":
            return [self]
        if self.builder == "text":
            return [replace(self, files=files) for files in _consecutive_up_to(self.files, TEXT_PART_BYTES)]
        return [replace(self, files=(f,)) for f in self.files]

    def fingerprint(self) -> list:
        """What decides whether prepared data is still up to date: file paths, sizes and times, or the
        hub dataset's name and commit (a dataset updated upstream is prepared again)."""
        if self.builder == "hub":
            return [self.name, self.revision]
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]


def _consecutive_up_to(files: tuple[Path, ...], size: int) -> Iterator[tuple[Path, ...]]:
    """`files` in order, in runs of at most `size` bytes (a larger file makes a run of its own)."""
    run: list[Path] = []
    run_bytes = 0
    for path in files:
        length = path.stat().st_size
        if run and run_bytes + length > size:
            yield tuple(run)
            run, run_bytes = [], 0
        run.append(path)
        run_bytes += length
    if run:
        yield tuple(run)


def _suffixes(path: Path) -> list[str]:
    """A file's suffixes in lower case: CORPUS.JSONL is read as corpus.jsonl."""
    return [suffix.lower() for suffix in path.suffixes]


def _data_suffix(path: Path) -> Optional[str]:
    """The suffix naming what a file holds, behind a compression's: corpus.JSONL.gz -> ".jsonl"."""
    suffixes = _suffixes(path)
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else None


def builder_for(path: Path) -> Optional[str]:
    return BUILDERS.get(_data_suffix(path))


def _unread_compression(path: Path) -> Optional[str]:
    """The suffix of a data file compressed in a way no builder reads (corpus.jsonl.zst: ".zst")."""
    suffixes = _suffixes(path)
    return suffixes[-1] if len(suffixes) > 1 and suffixes[-2] in BUILDERS and builder_for(path) is None else None


def _is_ignored(path: Path, ignored: tuple[Path, ...]) -> bool:
    """Whether `path` is one of the `ignored` (resolved) files or lies in one of the `ignored` directories."""
    path = path.resolve()
    return any(path == other or other in path.parents for other in ignored)


def _refuse_unread_compression(files: list[Path], key: str) -> None:
    """Data files compressed in a way no builder reads: left out of a directory, most of a dump shipped as
    .jsonl.zst would be lost without a word."""
    unread = sorted(path for path in files if _unread_compression(path))
    if unread:
        more = f" and {len(unread) - 1} more files" if len(unread) > 1 else ""
        raise DataError(f"{key}: {unread[0]}{more}: compressed as {_unread_compression(unread[0])}, which is not "
                        f"read; decompress, or compress as {'/'.join(COMPRESSIONS)}")


def _readable_files(paths: Iterable[Path], key: str, ignored: tuple[Path, ...]) -> list[Path]:
    """The files among `paths` a builder reads, but the `ignored` ones, sorted."""
    paths = [path for path in paths if not _is_ignored(path, ignored)]
    _refuse_dangling_links(paths, key)
    files = [path for path in paths if path.is_file()]
    _refuse_unread_compression(files, key)
    return sorted(path for path in files if builder_for(path))


def _refuse_dangling_links(paths: list[Path], key: str) -> None:
    """A data file's link whose target is missing (a shard on a file system not mounted here): passed by as no
    file, its documents were left out without a word."""
    dangling = sorted(path for path in paths if builder_for(path) and path.is_symlink() and not path.exists())
    if dangling:
        raise DataError(f"{key}: {dangling[0]} links to {os.readlink(dangling[0])}, which does not exist (a file "
                        "system not mounted here?); its documents would be left out")


def _refuse_unlisted(key: str, error: OSError) -> None:
    """os.walk's onerror: a directory that cannot be listed is refused, where os.walk (and rglob before it) passed
    by it and its files without a word."""
    raise DataError(f"{key}: {error.filename} cannot be listed ({error.strerror}): its files would be left out")


def _files_under(directory: Path, key: str) -> Iterator[Path]:
    """Every file under `directory`, through links to directories too: a corpus directory often links shards kept
    elsewhere, which pathlib's rglob passed by without a word. A link back to a directory it lies in (a loop) is
    not entered; the files of one reached twice otherwise are refused as named twice. Hidden files and directories
    (a dot first) are tools' copies, not the corpus: Jupyter's .ipynb_checkpoints/x-checkpoint.jsonl doubled x's
    documents, and a .git directory was walked whole."""
    enclosing = {str(directory): {os.path.realpath(directory)}}  # each directory walked: the real paths it lies in
    refuse_unlisted = functools.partial(_refuse_unlisted, key)
    for root, subdirectories, files in os.walk(directory, onerror=refuse_unlisted, followlinks=True):
        above = enclosing.pop(root)
        for name in list(subdirectories):
            real = os.path.realpath(os.path.join(root, name))
            if real in above or _is_hidden(name):
                subdirectories.remove(name)
            else:
                enclosing[os.path.join(root, name)] = above | {real}
        yield from (Path(root, name) for name in files if not _is_hidden(name))


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _looks_local(entry: str) -> bool:
    """A name that is no hub dataset's ("owner/name"): deeper, or under a local directory."""
    parts = Path(entry).parts
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def _starting_directory(entry: str) -> Path:
    """Where a path or glob entry starts: its components before the first wildcard."""
    parts = Path(entry).expanduser().parts
    return Path(*itertools.takewhile(lambda part: not glob.has_magic(part), parts))


def _files_of(entry: str, key: str, ignored: tuple[Path, ...]) -> Optional[list[Path]]:
    """The local files an entry names, or None when it names no local path (a hub dataset). The `ignored`
    places it starts in are not left out: an entry naming data.cache_dir/corpus reads it."""
    kinds = "json/jsonl/txt/parquet"
    ignored = tuple(place for place in ignored if not _is_ignored(_starting_directory(entry), (place,)))
    if glob.has_magic(entry):
        files = _readable_files((Path(p) for p in glob.glob(entry, recursive=True)), key, ignored)
        if not files:
            raise DataError(f"{key}: no {kinds} files match {entry!r}")
        return files
    path = Path(entry).expanduser()
    if path.is_dir():
        files = _readable_files(_files_under(path, key), key, ignored)
        if not files:
            raise DataError(f"{key}: directory {path} holds no {kinds} files")
        return files
    if path.is_file():
        _refuse_unread_compression([path], key)
        if builder_for(path) is None:
            raise DataError(f"{key}: {path}: unsupported file type; use {kinds}")
        return [path]
    if builder_for(path) or entry.startswith((".", "/", "~")):
        raise DataError(f"{key}: file not found: {path}")
    if _looks_local(entry):
        raise DataError(f"{key}: file or directory not found: {path} (the local path does not exist)")
    return None


def resolve_sources(entries: list[str], ignored: Iterable[Path] = ()) -> list[Source]:
    """Check every entry exists now, before any work; consecutive files of one kind load together.
    Directories and globs leave out the `ignored` files and directories (what megadiff writes)."""
    if not entries:
        raise DataError("data.sources: empty; list the files to prepare (json/jsonl/txt/parquet) "
                        "or set data.bundled_corpus")
    ignored = tuple(Path(p).resolve() for p in ignored)
    sources: list[Source] = []
    named_by: dict[Path, tuple[str, Path]] = {}  # each real file, by the entry and path that named it first
    for i, entry in enumerate(entries):
        key = f"data.sources[{i}]"
        files = _files_of(entry, key, ignored)
        if files is None:
            sources.append(_hub_source(key, entry))
            continue
        # lists, made Sources once: growing a Source's tuple file by file was quadratic in a directory's files
        groups: list[tuple[str, list[Path]]] = []
        for path in files:
            first = named_by.setdefault(path.resolve(), (key, path))
            if first != (key, path):  # its documents would be trained on twice
                raise _named_twice(key, path, *first)
            builder = builder_for(path)
            if groups and groups[-1][0] == builder:
                groups[-1][1].append(path)
            else:
                groups.append((builder, [path]))
        sources.extend(Source(key, builder, tuple(paths)) for builder, paths in groups)
    return sources


def _named_twice(key: str, path: Path, first_key: str, first_path: Path) -> DataError:
    """A file two entries name (a directory and one of its files), or one entry through a link (a directory
    holding latest.jsonl -> shard-42.jsonl)."""
    what = f"the same file as {first_path} (a link)" if first_key == key else f"also one of {first_key}'s files"
    return DataError(f"{key}: {path} is {what}; name each file once (to weigh a source more, prepare it as a "
                     "prefix of its own and give data.blend weights)")


def _hub_source(key: str, name: str) -> Source:
    """A hub dataset's source, once its builder loads: a name that does not fails before any tokenizing."""
    import datasets

    source = Source(key, "hub", name=name)
    try:
        with _quiet_datasets():
            builder = datasets.load_dataset_builder(name)
    except Exception as err:  # datasets raises many types; all mean the same thing here
        raise _unloadable(source, err) from err
    return replace(source, revision=builder.hash)  # a hub dataset's builder hash is its repository's commit


def _unloadable(source: Source, err: Exception) -> DataError:
    what = ("is not a local file or directory, and loading it as a Hugging Face dataset failed"
            if source.builder == "hub" else "could not be read")
    cause = err.__cause__ or err.__context__  # datasets wraps a builder's error in a generic one
    because = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return DataError(f"{source.key}: {source.describe()} {what}: {err}{because}")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """`datasets` prints progress bars and logs for every load; prepare-data shows its own progress."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _no_download_count() -> Iterator[None]:
    """datasets sends a HEAD request to the hub (a download count, timeout 3 s) for every load of a packaged
    builder, local json/txt/parquet files too: a directory of many files asked the network once per file, and a
    cluster whose firewall drops the packets waited up to 3 s per file before tokenizing it."""
    import datasets

    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts


def _load(source: Source, cache_dir: str):
    """The source's table (None for files without content); a txt source's one field is "text"."""
    import datasets

    try:
        if source.builder == "hub":
            return datasets.load_dataset(source.name, split="train", revision=source.revision)
        options = {"sample_by": "document"} if source.builder == "text" else {}
        # an empty file holds no documents, but datasets' builders refuse it
        files = [str(f) for f in source.files if f.stat().st_size]
        if not files:
            return None
        with _no_download_count():
            table = datasets.load_dataset(source.builder, data_files=files, split="train", cache_dir=cache_dir,
                                          **options)
        return _without_bom(table) if source.builder == "text" else table
    except Exception as err:  # datasets raises many types; all mean the same thing here
        raise _unreadable_line(source) or _unreadable_file(source, cache_dir) or _unloadable(source, err) from err


def _unreadable_file(source: Source, cache_dir: str) -> Optional[DataError]:
    """Of a part of several txt files, the first that cannot be read, named alone: not the part's thousands."""
    if source.builder != "text" or len(source.files) < 2:
        return None
    for path in source.files:
        try:
            _load(replace(source, files=(path,)), cache_dir)
        except DataError as err:
            return err
    return None


def _unreadable_line(source: Source) -> Optional[DataError]:
    """The first line of a json-lines source that is no record, named by its number in its file: Arrow's reader
    counts its rows from the start of the block it was reading (a bad line 70,124 was "row 25455")."""
    json_lines = [path for path in source.files if source.builder == "json" and _data_suffix(path) != ".json"]
    for path in json_lines:  # a .json file may hold one array of records over many lines
        try:
            found = _first_bad_line(path)
        except Exception:  # a file that cannot be read through (a truncated .gz): the reader's own error says why
            return None
        if found is not None:
            number, problem = found
            return DataError(f"{source.key}: {path} could not be read: line {number} is {problem}; one JSON "
                             "object a line is read (a jsonl file)")
    return None


def _first_bad_line(path: Path) -> Optional[tuple[int, str]]:
    """(number, problem) of the first line of a json-lines file that is no record."""
    import fsspec

    with fsspec.open(str(path), "rb", compression="infer") as lines:
        for number, line in enumerate(lines, 1):
            problem = _record_problem(line)
            if problem is not None:
                return number, problem
    return None


def _record_problem(line: bytes) -> Optional[str]:
    """What makes a json-lines line no record, or None for a record (or a blank line)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8"))
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except UnicodeEncodeError:
        return "no Unicode text: it escapes a lone surrogate (such as \\ud800)"
    except ValueError as err:
        return f"not JSON ({err})"
    return None if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"


def _without_bom(table):
    """A txt file's text without the UTF-8 BOM before it (Windows editors write one): it marks the encoding, it is
    no text; read as U+FEFF it began the document with tokens of its own, where the json reader drops it. The text
    builder's `encoding` is not given to a compressed file's reader, so it is dropped here. Only a table holding
    one is copied: a corpus of large txt files is not written to the cache again."""
    import pyarrow.compute as pc

    if not pc.any(pc.starts_with(table.data.column("text"), UTF8_BOM)).as_py():
        return table
    return table.map(lambda record: {"text": record["text"].removeprefix(UTF8_BOM)})


def _column(table, source: Source, setting: str, key: str, name: str):
    """The field `key` of a source's table, checked to hold what `name` needs (a list of messages
    for "messages", else text), as a one-column table named `name`."""
    feature = table.features.get(key)
    if feature is None:
        raise DataError(f"{setting}: {source.key} ({source.describe()}) has no field {key!r}; "
                        f"its fields are {list(table.features)}")
    if name == "messages":
        # a plain list in datasets 3, List (or LargeList) from 4 on; Sequence where it is given
        fits = isinstance(feature, list) or type(feature).__name__ in ("List", "LargeList", "Sequence")
        wanted = "a list of messages"
    else:
        fits = getattr(feature, "dtype", None) in TEXT_TYPES
        wanted = "text"
    if not fits:
        raise DataError(f"{setting}: field {key!r} of {source.key} ({source.describe()}) holds {feature}, not {wanted}")
    column = table.select_columns([key])
    if name != "messages":
        _check_utf8(column.data.column(key), source, setting, key)
    return column.rename_column(key, name) if key != name else column


def _check_utf8(texts, source: Source, setting: str, key: str) -> None:
    """Arrow's JSON reader takes bytes that are no UTF-8 into its strings; they failed as a batch was read, with a
    traceback, after everything before them had been tokenized."""
    import pyarrow as pa

    offset = 0
    for chunk in texts.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            record = next((offset + i for i, text in enumerate(chunk.cast(pa.large_binary()).to_pylist())
                           if text is not None and not _is_utf8(text)), None)
            where = "a record" if record is None else f"record {record} (counted from 0)"
            raise DataError(f"{setting}: field {key!r} of {where} of {source.key} ({source.describe()}) is not "
                            "UTF-8 text; convert the file to UTF-8") from None
        offset += len(chunk)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def record_fields(text_key: str, response_key: Optional[str] = None,
                  messages_key: Optional[str] = None) -> dict[str, tuple[str, str]]:
    """{column: (setting, field)} of what a record holds: its text; or a prompt ("text") and a
    response; or a conversation ("messages")."""
    if messages_key is not None:
        return {"messages": ("data.messages_key", messages_key)}
    return {"text": ("data.text_key", text_key)} | \
        ({"response": ("data.response_key", response_key)} if response_key is not None else {})


def load_texts(sources: list[Source], fields: dict[str, tuple[str, str]], cache_dir: str):
    """All records as one Dataset of the `fields` columns (record_fields(); None for a missing value)."""
    import datasets

    parts = []
    with _quiet_datasets():
        for source in sources:
            table = _load(source, cache_dir)
            if table is None:
                continue
            read = fields
            if source.builder == "text":
                if list(fields) != ["text"]:
                    setting = fields.get("messages", fields.get("response"))[0]
                    raise DataError(f"{setting}: {source.key} ({source.describe()}) is plain text, without fields; "
                                    "supervised fine-tuning reads json/jsonl/parquet records")
                read = {"text": ("data.text_key", "text")}
            parts.append(datasets.concatenate_datasets(
                [_column(table, source, setting, key, name) for name, (setting, key) in read.items()], axis=1))
        return datasets.concatenate_datasets(parts) if parts else datasets.Dataset.from_dict({name: [] for name in fields})
