"""prepare-data: the bundled corpus, text -> megatron indexed dataset, idempotence, atomicity, the CLI.

Every check compares with an independent reading: the KJV jsonl read naively, the tokenizer
called document by document, megatron's own IndexedDataset reading the files back.
"""
from __future__ import annotations

import fcntl
import json
import os
import runpy
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megadiff.cli import main as cli_main
from megadiff.config import build_config
from megadiff.data import prepare as prepare_module
from megadiff.data import sources as sources_module
from megadiff.data import tokenize_workers
from megadiff.data.corpus import kjv_source, write_bundled_corpus
from megadiff.data.errors import DataError
from megadiff.data.indexed import token_dtype
from megadiff.data.prepare import ensure_prepared, prepare
from megadiff.data.tokenizers import load_tokenizer
from tests.conftest import kjv_verses, save_small_tokenizer

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = 24  # a KJV subset keeps each preparation well under a second


def naive_kjv_chapters() -> dict[tuple[str, int], dict[int, str]]:
    chapters: dict = {}
    for line in kjv_source().read_text(encoding="utf-8").splitlines():
        verse = json.loads(line)
        chapters.setdefault((verse["book"], verse["chapter"]), {})[verse["verse"]] = verse["text"]
    return chapters


def read_documents(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def read_back(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def data_config(tmp_path, *overrides):
    return build_config({}, [f"data.cache_dir={tmp_path / 'cache'}", *overrides]).data


def outputs_only(directory: Path, prefix_name: str) -> None:
    """No temporary file or work directory is left beside the outputs."""
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(f"{prefix_name}{ext}" for ext in (".bin", ".idx", ".lock", ".manifest.json")), names


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A jsonl of KJV chapters plus an empty document and a record without the text field."""
    root = tmp_path_factory.mktemp("corpus")
    documents = read_documents(write_bundled_corpus("kjv", root))[:CHAPTERS]
    records = [{"text": d, "id": i} for i, d in enumerate(documents)]
    records.insert(3, {"text": "", "id": -1})
    records.insert(7, {"body": "a record of another format", "id": -2})
    path = root / "subset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, documents


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    prefix = root / "out" / "subset"
    stats = prepare(build_config({}, [f"data.sources=[{corpus[0]}]", f"data.prefix={prefix}"]).data)
    return prefix, stats


def test_kjv_corpus_is_one_document_per_chapter_of_the_naive_read(tmp_path):
    path = write_bundled_corpus("kjv", tmp_path)
    documents = read_documents(path)
    chapters = naive_kjv_chapters()
    assert len(documents) == len(chapters) == 1189
    order = list(chapters)
    genesis = documents[order.index(("Genesis", 1))].split("\n")
    assert genesis[0] == "In the beginning God created the heaven and the earth."
    john = documents[order.index(("John", 11))].split("\n")
    assert john[34] == chapters[("John", 11)][35] == "Jesus wept."
    assert all(doc.split("\n") == [v[k] for k in sorted(v)] for doc, v in zip(documents, chapters.values()))

    # re-running leaves an identical file untouched, and replaces a damaged one
    stamp = path.stat().st_mtime_ns
    assert write_bundled_corpus("kjv", tmp_path) == path and path.stat().st_mtime_ns == stamp
    path.write_text("damaged")
    assert read_documents(write_bundled_corpus("kjv", tmp_path)) == documents
    assert [p.name for p in tmp_path.iterdir()] == ["kjv.jsonl"]
    with pytest.raises(DataError, match="data.bundled_corpus: unknown corpus 'nope'"):
        write_bundled_corpus("nope", tmp_path)


def test_tokens_are_each_document_encoded_plus_eod(corpus, prepared):
    prefix, stats = prepared
    tokenizer = load_tokenizer("cl100k_base")
    expected = [tokenizer.encode(doc) + [tokenizer.eod] for doc in corpus[1]]  # the textless records are skipped
    assert read_back(prefix) == expected
    assert (stats["documents"], stats["skipped_empty"], stats["skipped_missing"], stats["tokens"]) == \
        (CHAPTERS, 2, 1, sum(map(len, expected)))
    assert np.fromfile(f"{prefix}.bin", dtype=np.int32).size == stats["tokens"]  # cl100k needs int32
    outputs_only(prefix.parent, prefix.name)


def test_records_without_the_text_field_are_counted_apart_from_empty_ones(tmp_path, capsys):
    """A key misspelt in some records (or records of another format) read as empty documents: the summary
    said "2 empty skipped", which hid a data problem."""
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in
                              [{"text": "In the beginning"}, {"Text": "misspelt"}, {"text": ""}, {"content": "other"}]))
    stats = prepare(data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={tmp_path / 'out'}"))
    assert (stats["documents"], stats["skipped_empty"], stats["skipped_missing"]) == (1, 3, 2)
    summary = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the table's lines unwrapped
    assert "documents 1 (3 skipped: 2 without the field 'text' (data.text_key), 1 empty)" in summary


def test_token_dtype_is_megatrons_choice():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (1000, 65535, 65536, 65537, 100277, 200019):
        tokenizer = type("T", (), {"vocab_size": vocab, "eod": 0})()
        megatron = GPTDatasetConfig(random_seed=0, sequence_length=8, blend=(["x"], None), split="1,0,0",
                                    tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                                    eod_mask_loss=False)
        assert token_dtype(vocab) == np.dtype(DType.dtype_from_code(megatron.token_dtype_code))


def test_several_workers_write_the_same_bytes_and_a_rerun_is_skipped(corpus, prepared, tmp_path, capsys):
    prefix, stats = prepared
    other = tmp_path / "two-workers"
    prepare(build_config({}, [f"data.sources=[{corpus[0]}]", f"data.prefix={other}", "data.workers=2"]).data)
    for ext in (".bin", ".idx"):
        assert Path(f"{other}{ext}").read_bytes() == Path(f"{prefix}{ext}").read_bytes()
    outputs_only(tmp_path, other.name)

    stamp = Path(f"{other}.bin").stat().st_mtime_ns
    capsys.readouterr()
    again = prepare(build_config({}, [f"data.sources=[{corpus[0]}]", f"data.prefix={other}"]).data)
    assert "up to date" in capsys.readouterr().out
    assert again == stats | {"seconds": again["seconds"], "tokens_per_second": again["tokens_per_second"]}
    assert Path(f"{other}.bin").stat().st_mtime_ns == stamp

    # a changed source is prepared again
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps({"text": "Jesus wept."}) + "\n")
    prepare(build_config({}, [f"data.sources=[{changed}]", f"data.prefix={other}"]).data)
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(other) == [tokenizer.encode("Jesus wept.") + [tokenizer.eod]]


def _split_corpus(corpus, directory: Path, files: int = 3) -> Path:
    """The corpus's records spread over `files` jsonl files of one directory (sorted = source order)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = corpus[0].read_text(encoding="utf-8").splitlines(keepends=True)
    size = -(-len(lines) // files)
    for i in range(files):
        (directory / f"{i}.jsonl").write_text("".join(lines[i * size:(i + 1) * size]), encoding="utf-8")
    return directory


def _count_encodings(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Calls of the (single-worker) encoder, one per part with the default batch size; the
    `fail_at`-th call (1-based) raises once, as a dying worker would."""
    calls, failed = [], []
    real = tokenize_workers.encode_documents

    def counted(texts, spec, dtype):
        calls.append(len(texts))
        if len(calls) == fail_at and not failed:
            failed.append(len(calls))
            raise RuntimeError("worker died")
        return real(texts, spec, dtype)

    monkeypatch.setattr(tokenize_workers, "encode_documents", counted)
    return calls


def test_a_failure_keeps_finished_parts_and_a_rerun_tokenizes_only_the_rest(corpus, prepared, tmp_path,
                                                                           monkeypatch):
    """Three source files; the second one's tokenizer dies: no output, no half-written part, the
    first part kept; the rerun tokenizes the other two and writes the bytes a one-file run writes."""
    sources = [f"data.sources=[{_split_corpus(corpus, tmp_path / 'src')}]", f"data.prefix={tmp_path / 'out' / 'x'}"]
    calls = _count_encodings(monkeypatch, fail_at=2)
    with pytest.raises(RuntimeError, match="worker died"):
        prepare(build_config({}, sources).data)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.lock", "x.parts"]
    assert sorted(p.name for p in (tmp_path / "out" / "x.parts").iterdir()) == [
        "00000.bin", "00000.idx", "00000.lock", "00000.manifest.json", "00001.lock"]

    calls.clear()
    prepare(build_config({}, sources).data)
    assert len(calls) == 2
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'out' / 'x'}{ext}").read_bytes() == Path(f"{prepared[0]}{ext}").read_bytes()
    outputs_only(tmp_path / "out", "x")


def test_a_single_source_failure_leaves_no_output_and_no_temporary_files(corpus, tmp_path, monkeypatch):
    _count_encodings(monkeypatch, fail_at=2)
    monkeypatch.setattr(prepare_module, "DOCUMENTS_PER_BATCH", 4)
    with pytest.raises(RuntimeError, match="worker died"):
        prepare(build_config({}, [f"data.sources=[{corpus[0]}]", f"data.prefix={tmp_path / 'x'}"]).data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.lock", "x.parts"]
    assert [p.name for p in (tmp_path / "x.parts").iterdir()] == ["00000.lock"]


def test_a_failed_preparation_of_changed_sources_leaves_none_of_the_old_data(corpus, tmp_path, monkeypatch):
    """The old tokens, their manifest gone, trained as if they were the new sources' (or read with the new
    tokenizer's ids): the prefix holds no data until the new data is whole."""
    source = tmp_path / "source.jsonl"
    source.write_text(corpus[0].read_text())
    config = data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={tmp_path / 'x'}")
    prepare(config)
    with source.open("a") as appended:
        appended.write(json.dumps({"text": "a changed source"}) + "\n")
    _count_encodings(monkeypatch, fail_at=1)
    with pytest.raises(RuntimeError, match="worker died"):
        prepare(config)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("x")) == ["x.lock", "x.parts"]


def test_shares_of_the_parts_then_a_plain_run_that_only_merges(corpus, prepared, tmp_path, monkeypatch, capsys):
    """`--part 0/2` and `--part 1/2` (as two nodes would run them) tokenize the three files between
    them; the plain run then tokenizes nothing and writes the one-file run's bytes."""
    source_dir = _split_corpus(corpus, tmp_path / "src")
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{source_dir}]\n  prefix: {tmp_path / 'out' / 'x'}\n")
    calls = _count_encodings(monkeypatch)
    assert cli_main(["prepare-data", str(config), "--part", "1/2"]) == 0
    assert len(calls) == 1 and not Path(f"{tmp_path / 'out' / 'x'}.bin").exists()
    assert "--part 1/2 of" in (out := capsys.readouterr().out) and "(1 of its 3 parts)" in out
    assert cli_main(["prepare-data", str(config), "--part", "0/2"]) == 0
    assert len(calls) == 3
    # what a merge killed before its renames leaves: a corpus-sized temporary file each time, never read
    leftovers = [Path(f"{tmp_path / 'out' / 'x'}{ext}.tmp-4242-00c0ffee") for ext in (".bin", ".idx")]
    for leftover in leftovers:
        leftover.write_bytes(b"\0" * 64)
    assert cli_main(["prepare-data", str(config)]) == 0
    assert len(calls) == 3 and not any(leftover.exists() for leftover in leftovers)
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'out' / 'x'}{ext}").read_bytes() == Path(f"{prepared[0]}{ext}").read_bytes()
    outputs_only(tmp_path / "out", "x")
    # once merged, a share has nothing left to do
    assert cli_main(["prepare-data", str(config), "--part", "0/2"]) == 0
    assert "up to date" in capsys.readouterr().out and len(calls) == 3


def _run_together(calls: list, count: int) -> list:
    """What `count` threads each calling calls[i] return, all started before any is waited for."""
    ended = [None] * count
    runs = [threading.Thread(target=lambda i=i: ended.__setitem__(i, calls[i]())) for i in range(count)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    return ended


def _taken_elsewhere(lock: Path) -> bool:
    """Whether another holder keeps `lock` from being taken exclusively (as a plain run, which merges, takes it)."""
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_shares_plan_side_by_side_and_a_merge_waits_for_them(corpus, prepared, tmp_path, monkeypatch):
    """Each share loads the tokenizer and checks every source file holding <prefix>.lock: held exclusively, hundreds
    of shares started one after another (minutes on a shared filesystem). Every share now plans at once (they meet
    in the tokenizer's loading), and none while a plain run could take the lock to merge and remove the parts."""
    source_dir = _split_corpus(corpus, tmp_path / "src")
    prefix = tmp_path / "out" / "x"
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{source_dir}]\n  prefix: {prefix}\n")
    shares, planning, merge_locked_out = 2, threading.Barrier(2, timeout=10), []
    load = prepare_module.load_tokenizer

    def load_together(spec):
        if len(merge_locked_out) < shares:  # the shares' loads, not the merging run's
            planning.wait()
            merge_locked_out.append(_taken_elsewhere(Path(f"{prefix}.lock")))
        return load(spec)

    monkeypatch.setattr(prepare_module, "load_tokenizer", load_together)
    calls = _count_encodings(monkeypatch)
    ended = _run_together([lambda share=share: prepare_module.prepare_from_config(str(config), (), f"{share}/{shares}")
                           for share in range(shares)], shares)
    assert ended == [0] * shares and merge_locked_out == [True] * shares
    assert len(calls) == 3  # the three files, each tokenized by one share
    assert cli_main(["prepare-data", str(config)]) == 0
    assert len(calls) == 3
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{prepared[0]}{ext}").read_bytes()


def test_processes_finding_the_data_prepared_check_it_side_by_side(corpus, prepared, tmp_path, monkeypatch):
    """Every rank of a checkpoint command calls ensure_prepared: each loaded the tokenizer and checked the sources
    holding <prefix>.lock exclusively, one rank after another (seconds each). Data found prepared is now checked by
    all at once (they meet in the tokenizer's loading); data not yet prepared is tokenized by one of them only."""
    source_dir = _split_corpus(corpus, tmp_path / "src")
    data = build_config({}, [f"data.sources=[{source_dir}]", f"data.prefix={tmp_path / 'out' / 'x'}"]).data
    ranks = 3
    calls = _count_encodings(monkeypatch)
    stats = _run_together([lambda: prepare(data)] * ranks, ranks)
    assert len(calls) == 3 and all(s is not None and s["tokens"] == prepared[1]["tokens"] for s in stats)
    checking, load = threading.Barrier(ranks, timeout=10), prepare_module.load_tokenizer

    def load_together(spec):
        checking.wait()
        return load(spec)

    monkeypatch.setattr(prepare_module, "load_tokenizer", load_together)
    assert [s["tokens"] for s in _run_together([lambda: prepare(data)] * ranks, ranks)] == [stats[0]["tokens"]] * ranks
    assert len(calls) == 3


def test_more_documents_than_megatron_numbers_are_refused(corpus, prepared, tmp_path, monkeypatch, capsys):
    """megatron-core numbers a prefix's documents in int32: past 2**31 - 1 the ids wrap negative and the
    valid split read training documents. With the limit at 10: of three parts (7, 9 and 8 documents), the
    second passes it and the third is not tokenized; shares each under it are refused when merged, with
    the parts kept; data prepared elsewhere is refused before training."""
    from megadiff.data import indexed
    from megadiff.data.checks import check_training_data

    monkeypatch.setattr(indexed, "MAX_DOCUMENTS", 10)
    source_dir = _split_corpus(corpus, tmp_path / "src")
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{source_dir}]\n  prefix: {tmp_path / 'out' / 'x'}\n")
    calls = _count_encodings(monkeypatch)
    assert cli_main(["prepare-data", str(config)]) == 2
    assert "16 documents; megatron-core's datasets number at most 10 in one prefix" in capsys.readouterr().err
    assert len(calls) == 2
    shutil.rmtree(tmp_path / "out")
    for share in ("0/3", "1/3", "2/3"):
        assert cli_main(["prepare-data", str(config), "--part", share]) == 0
    assert cli_main(["prepare-data", str(config)]) == 2  # the merging run counts them
    assert "16 documents; megatron-core's datasets number at most 10" in capsys.readouterr().err
    assert not Path(f"{tmp_path / 'out' / 'x'}.bin").exists()
    assert len(list((tmp_path / "out" / "x.parts").glob("*.idx"))) == 3
    cfg = build_config({}, [f"data.prefix={prepared[0]}", "data.bundled_corpus=null", "model.seq_length=32"])
    with pytest.raises(DataError, match="24 documents; megatron-core's datasets number at most 10"):
        check_training_data(cfg, load_tokenizer(cfg.data.tokenizer))


@pytest.mark.parametrize("share", ["2/2", "-1/2", "1", "a/b", "0/0"])
def test_a_bad_share_is_refused(corpus, tmp_path, capsys, share):
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{corpus[0]}]\n  prefix: {tmp_path / 'x'}\n")
    assert cli_main(["prepare-data", str(config), f"--part={share}"]) == 2
    assert "--part: expected I/N with 0 <= I < N" in capsys.readouterr().err


def test_ensure_prepared_writes_and_prepares_the_bundled_corpus_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_module, "write_bundled_corpus",
                        lambda name, directory: _kjv_subset(Path(directory), CHAPTERS))
    cfg = build_config({}, ["data.bundled_corpus=kjv", f"data.cache_dir={tmp_path}"])
    ensure_prepared(cfg)
    prefix = tmp_path / "prepared" / "kjv-cl100k_base"
    tokenizer = load_tokenizer("cl100k_base")
    documents = read_documents(tmp_path / "corpus" / "kjv.jsonl")
    assert read_back(prefix) == [tokenizer.encode(d) + [tokenizer.eod] for d in documents]
    capsys.readouterr()
    ensure_prepared(cfg)
    assert "up to date" in capsys.readouterr().out
    ensure_prepared(build_config({}, [f"data.cache_dir={tmp_path / 'unused'}"]))  # no bundled corpus: nothing
    assert not (tmp_path / "unused").exists()


def test_ensure_prepared_speaks_on_the_first_rank_only(tmp_path, monkeypatch, capsys):
    """The checkpoint commands call it on every rank of torchrun, needles before the ranks' group forms."""
    monkeypatch.setattr(prepare_module, "write_bundled_corpus",
                        lambda name, directory: _kjv_subset(Path(directory), CHAPTERS))
    cfg = build_config({}, ["data.bundled_corpus=kjv", f"data.cache_dir={tmp_path}"])
    # before the ranks' group forms (a group of one an earlier test in this process formed would say rank 0)
    monkeypatch.setattr(prepare_module.dist, "is_initialized", lambda: False)
    said = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        ensure_prepared(cfg)
        said[rank] = capsys.readouterr().out
    assert said["1"] == "" and "up to date" in said["0"]


def test_a_bundled_corpus_never_replaces_data_prepared_from_other_sources(corpus, tmp_path, monkeypatch):
    """A demo config (data.bundled_corpus: kjv) given data.prefix=... of one's own data: refused, the data
    kept; the corpus prepared there before is prepared again as usual (here with another tokenizer)."""
    monkeypatch.setattr(prepare_module, "write_bundled_corpus",
                        lambda name, directory: _kjv_subset(Path(directory), CHAPTERS))
    own = tmp_path / "own" / "corpus"
    prepare(build_config({}, [f"data.sources=[{corpus[0]}]", f"data.prefix={own}"]).data)
    before = Path(f"{own}.bin").read_bytes()
    demo = ["data.bundled_corpus=kjv", f"data.cache_dir={tmp_path / 'cache'}"]
    for prefix in (own, tmp_path / "unmanifested" / "corpus"):
        if prefix != own:  # data whose manifest is gone: its sources are unknown
            prefix.parent.mkdir()
            for ext in (".bin", ".idx"):
                Path(f"{prefix}{ext}").write_bytes(Path(f"{own}{ext}").read_bytes())
        with pytest.raises(DataError, match=r"data.prefix: .* holds data prepared from .* set "
                                            r"data.bundled_corpus=null to use that data"):
            ensure_prepared(build_config({}, [*demo, f"data.prefix={prefix}"]))
    assert Path(f"{own}.bin").read_bytes() == before
    kjv = tmp_path / "kjv" / "corpus"
    prepare(build_config({}, [*demo, f"data.prefix={kjv}"]).data)
    prepare(build_config({}, [*demo, f"data.prefix={kjv}", "data.tokenizer=o200k_base"]).data)
    prepare(build_config({}, [*demo, f"data.prefix={kjv}", f"data.cache_dir={tmp_path / 'other-cache'}"]).data)


def _kjv_subset(directory: Path, chapters: int) -> Path:
    """The first chapters of the bundled corpus, written once like write_bundled_corpus does."""
    path = directory / "kjv.jsonl"
    if not path.exists():
        full = write_bundled_corpus("kjv", directory / "full")
        lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
        path.write_text("".join(lines[:chapters]), encoding="utf-8")
    return path


def test_cli_and_tools_script_prepare_from_a_config(corpus, tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{corpus[0]}]\n  prefix: {tmp_path / 'cli'}\n")
    assert cli_main(["prepare-data", str(config), "data.workers=1"]) == 0
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "cli") == [tokenizer.encode(d) + [tokenizer.eod] for d in corpus[1]]

    monkeypatch.setattr(sys, "argv", ["preprocess_data.py", str(config), f"data.prefix={tmp_path / 'tool'}"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / "tools" / "preprocess_data.py"), run_name="__main__")
    assert done.value.code == 0
    assert Path(f"{tmp_path / 'tool'}.bin").read_bytes() == Path(f"{tmp_path / 'cli'}.bin").read_bytes()


def test_cli_reports_bad_data_without_a_traceback(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  sources: [{tmp_path / 'missing.jsonl'}]\n  prefix: {tmp_path / 'x'}\n")
    assert cli_main(["prepare-data", str(config)]) == 2
    assert f"data.sources[0]: file not found: {tmp_path / 'missing.jsonl'}" in capsys.readouterr().err


@pytest.mark.parametrize("case,message", [
    ("missing file", r"data.sources\[1\]: file not found"),
    ("no sources", r"data.sources: empty"),
    ("no prefix", r"data.prefix: not set"),
    ("no documents", r"data.sources: no documents in .*empty.jsonl"),
    ("no tokens", r"data.sources: 2 documents but no tokens"),
    ("wrong key", r"data.text_key: data.sources\[0\] \(.*good.jsonl\) has no field 'body'"),
    ("not text", r"data.text_key: field 'n' of data.sources\[0\] .* not text"),
    ("unreadable", r"data.sources\[0\]: .*bad.jsonl could not be read"),
    ("empty directory", r"data.sources\[0\]: directory .* holds no json/jsonl/txt/parquet files"),
    ("unsupported", r"data.sources\[0\]: .*notes.md: unsupported file type"),
    ("not utf-8", r"data.text_key: field 'text' of record 1 \(counted from 0\) of data.sources\[0\] "
                  r"\(.*latin1.jsonl\) is not UTF-8 text"),
    ("not utf-8 text file", r"data.sources\[0\]: .*latin1.txt could not be read: .*\(UnicodeDecodeError: "),
    ("compressed otherwise", r"data.sources\[0\]: .*dump.*part-1.jsonl.zst and 1 more files: compressed as .zst"),
])
def test_bad_sources_are_refused_naming_the_key(tmp_path, case, message):
    good, empty, blank, bad = (tmp_path / n for n in ("good.jsonl", "empty.jsonl", "blank.jsonl", "bad.jsonl"))
    good.write_text(json.dumps({"text": "In the beginning", "n": 1}) + "\n")
    empty.write_text("")
    blank.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    bad.write_text("{not json\n")
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "dump").mkdir()
    for name in ("part-0.jsonl", "part-1.jsonl.zst", "part-2.jsonl.zst"):
        (tmp_path / "dump" / name).write_text(json.dumps({"text": "a document"}) + "\n")
    prefix = f"data.prefix={tmp_path / 'out'}"
    overrides = {
        "missing file": [f"data.sources=[{good},{tmp_path / 'missing.jsonl'}]", prefix],
        "no sources": [prefix],
        "no prefix": [f"data.sources=[{good}]"],
        "no documents": [f"data.sources=[{empty}]", prefix],
        "no tokens": [f"data.sources=[{blank}]", prefix],
        "wrong key": [f"data.sources=[{good}]", "data.text_key=body", prefix],
        "not text": [f"data.sources=[{good}]", "data.text_key=n", prefix],
        "unreadable": [f"data.sources=[{bad}]", prefix],
        "empty directory": [f"data.sources=[{tmp_path / 'nothing'}]", prefix],
        "unsupported": [f"data.sources=[{tmp_path / 'notes.md'}]", prefix],
        "not utf-8": [f"data.sources=[{tmp_path / 'latin1.jsonl'}]", prefix],
        "not utf-8 text file": [f"data.sources=[{tmp_path / 'latin1.txt'}]", prefix],
        "compressed otherwise": [f"data.sources=[{tmp_path / 'dump'}]", prefix],
    }[case]
    with pytest.raises(DataError, match=message):
        prepare(data_config(tmp_path, *overrides))
    assert not Path(f"{tmp_path / 'out'}.bin").exists()


def test_text_files_directories_and_globs_keep_source_order(tmp_path):
    """A .txt file is one document (its line ends read as "\\n", as Python reads text); a directory or glob
    expands to its data files (suffixes in any case) in sorted order, other files left out."""
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("First book.\n")
    (folder / "b.txt").write_bytes(b"Second book.\r\nIt has two lines.\r\n")
    (folder / "c.JSONL").write_text(json.dumps({"text": "Third, from json."}) + "\n")
    (folder / "d.ndjson").write_text(json.dumps({"text": "Fourth, from ndjson."}) + "\n")
    (folder / "README.md").write_text("# not data")
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"text": "Zeroth."}) + "\n")
    prefix = tmp_path / "out"
    prepare(data_config(tmp_path, f"data.sources=[{first},{folder}]", f"data.prefix={prefix}"))
    tokenizer = load_tokenizer("cl100k_base")
    order = ["Zeroth.", "First book.\n", "Second book.\nIt has two lines.\n", "Third, from json.",
             "Fourth, from ndjson."]
    assert read_back(prefix) == [tokenizer.encode(t) + [tokenizer.eod] for t in order]

    globbed = tmp_path / "globbed"
    prepare(data_config(tmp_path, f"data.sources=['{folder}/*.txt']", f"data.prefix={globbed}"))
    assert read_back(globbed) == read_back(prefix)[1:3]


def test_many_small_text_files_are_read_together_into_the_same_tokens(tmp_path, monkeypatch):
    """`datasets` spends tens of ms on each load whatever its size: a corpus of small txt files, read one load a
    file, spent most of its preparation there. They are read in one load now, into the tokens each file gives
    alone, in order (an empty one skipped); an unreadable one among them is still named alone."""
    import datasets

    folder = tmp_path / "chapters"
    folder.mkdir()
    texts = [f"Chapter {i}.\nAnd it came to pass, {'verily ' * (i % 7)}that the end came.\n" for i in range(40)]
    for i, text in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(text)
    (folder / "020a.txt").write_text("")
    loads = []
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: loads.append(args) or load_dataset(
        *args, **kwargs))
    prefix = tmp_path / "out"
    prepare(data_config(tmp_path, f"data.sources=[{folder}]", f"data.prefix={prefix}"))
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(prefix) == [tokenizer.encode(text) + [tokenizer.eod] for text in texts]
    assert len(loads) == 1

    (folder / "030a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match=r"data.sources\[0\]: \S*030a.txt could not be read: .*UnicodeDecodeError"):
        prepare(data_config(tmp_path, f"data.sources=[{folder}]", f"data.prefix={prefix}"))


def test_a_small_hugging_face_tokenizer_gets_uint16_tokens(corpus, small_tokenizer_dir, tmp_path):
    prefix = tmp_path / "small"
    stats = prepare(data_config(tmp_path, f"data.sources=[{corpus[0]}]", f"data.prefix={prefix}",
                                f"data.tokenizer={small_tokenizer_dir}"))
    tokenizer = load_tokenizer(str(small_tokenizer_dir))
    assert read_back(prefix) == [tokenizer.encode(d) + [tokenizer.eod] for d in corpus[1]]
    assert stats["dtype"] == "uint16" and Path(f"{prefix}.bin").stat().st_size == 2 * stats["tokens"]


def test_a_missing_local_directory_or_unknown_hub_name_is_refused_before_tokenizing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("corpus/web").mkdir(parents=True)
    Path("corpus/web/0.jsonl").write_text(json.dumps({"text": "In the beginning"}) + "\n")
    calls = _count_encodings(monkeypatch)
    for missing, message in (("corpus/books", r"data.sources\[1\]: file or directory not found: corpus/books "
                                              r"\(the local path does not exist\)"),
                             ("nobody-megadiff/no-such-dataset",
                              r"data.sources\[1\]: nobody-megadiff/no-such-dataset is not a local file or directory, "
                              r"and loading it as a Hugging Face dataset failed")):
        with pytest.raises(DataError, match=message):
            prepare(data_config(tmp_path, f"data.sources=[corpus/web/*.jsonl,{missing}]", "data.prefix=out/x"))
        assert not calls and not Path("out/x.parts").exists()


def test_a_file_named_twice_is_refused(tmp_path):
    """A directory and one of its files: that file's documents would be trained on twice."""
    (tmp_path / "corpus").mkdir()
    for name in ("a", "b"):
        (tmp_path / "corpus" / f"{name}.jsonl").write_text(json.dumps({"text": name}) + "\n")
    with pytest.raises(DataError, match=r"data.sources\[1\]: .*a.jsonl is also one of data.sources\[0\]'s files"):
        prepare(data_config(tmp_path, f"data.sources=[{tmp_path / 'corpus'},{tmp_path / 'corpus' / 'a.jsonl'}]",
                            f"data.prefix={tmp_path / 'out'}"))


def test_a_directory_reads_the_files_its_linked_directories_hold(tmp_path):
    """A corpus directory linking shards kept elsewhere: their documents were left out without a word (pathlib's
    rglob does not enter links), while a glob of the same directory read them. A link to an enclosing
    directory (a loop) adds nothing."""
    elsewhere, corpus = tmp_path / "elsewhere", tmp_path / "corpus"
    for directory, name in ((corpus, "a"), (elsewhere, "b")):
        directory.mkdir()
        (directory / f"{name}.jsonl").write_text(json.dumps({"text": f"Shard {name}."}) + "\n")
    (corpus / "linked").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(corpus, target_is_directory=True)
    prepare(data_config(tmp_path, f"data.sources=[{corpus}]", f"data.prefix={tmp_path / 'out'}"))
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "out") == [tokenizer.encode(f"Shard {name}.") + [tokenizer.eod] for name in "ab"]


def test_a_directory_leaves_out_its_hidden_files_and_directories(tmp_path):
    """Jupyter's .ipynb_checkpoints/ copy of a shard doubled its documents; a hidden file is an editor's or a
    tool's, not the corpus. A glob naming them still reads them."""
    corpus = tmp_path / "corpus"
    (corpus / ".ipynb_checkpoints").mkdir(parents=True)
    for path, text in ((corpus / "a.jsonl", "The corpus."), (corpus / ".ipynb_checkpoints" / "a-checkpoint.jsonl",
                                                            "A notebook's copy."), (corpus / ".draft.jsonl", "Hidden.")):
        path.write_text(json.dumps({"text": text}) + "\n")
    prepare(data_config(tmp_path, f"data.sources=[{corpus}]", f"data.prefix={tmp_path / 'out'}"))
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "out") == [tokenizer.encode("The corpus.") + [tokenizer.eod]]
    prepare(data_config(tmp_path, f"data.sources=[{corpus}/.*.jsonl]", f"data.prefix={tmp_path / 'glob'}"))
    assert read_back(tmp_path / "glob") == [tokenizer.encode("Hidden.") + [tokenizer.eod]]


def test_a_directory_or_glob_with_a_file_it_cannot_reach_is_refused(tmp_path, monkeypatch):
    """A shard linked from a file system not mounted here, or a subdirectory that cannot be listed (its
    permissions): both were passed by without a word, their documents left out."""
    corpus = tmp_path / "corpus"
    (corpus / "locked").mkdir(parents=True)
    (corpus / "a.jsonl").write_text(json.dumps({"text": "Reached."}) + "\n")
    (corpus / "locked" / "b.jsonl").write_text(json.dumps({"text": "Behind permissions."}) + "\n")
    (corpus / "shard.jsonl").symlink_to(tmp_path / "unmounted" / "shard.jsonl")
    for entry in (corpus, f"'{corpus}/*.jsonl'"):
        with pytest.raises(DataError, match=r"data.sources\[0\]: .*shard.jsonl links to .*unmounted.*, which does "):
            prepare(data_config(tmp_path, f"data.sources=[{entry}]", f"data.prefix={tmp_path / 'out'}"))
    (corpus / "shard.jsonl").unlink()
    scandir = os.scandir

    def unlistable(path="."):
        if Path(path) == corpus / "locked":  # root reads any directory: its refusal is simulated
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", unlistable)
    with pytest.raises(DataError, match=r"data.sources\[0\]: .*locked cannot be listed \(Permission denied\)"):
        prepare(data_config(tmp_path, f"data.sources=[{corpus}]", f"data.prefix={tmp_path / 'out'}"))


def test_a_file_a_directory_holds_twice_through_a_link_is_refused(tmp_path):
    """latest.jsonl -> shard-1.jsonl beside it: the shard's documents were trained on twice."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "shard-1.jsonl").write_text(json.dumps({"text": "Once."}) + "\n")
    (tmp_path / "corpus" / "latest.jsonl").symlink_to(tmp_path / "corpus" / "shard-1.jsonl")
    with pytest.raises(DataError, match=r"data.sources\[0\]: .*shard-1.jsonl is the same file as .*latest.jsonl"):
        prepare(data_config(tmp_path, f"data.sources=[{tmp_path / 'corpus'}]", f"data.prefix={tmp_path / 'out'}"))


def test_a_prefix_inside_its_source_directory_does_not_read_its_own_files(tmp_path, capsys):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    data = data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={source / 'prepared' / 'corpus'}")
    first = prepare(data)
    (source / "prepared" / "corpus.parts").mkdir()  # a stopped run's parts, with their manifests
    (source / "prepared" / "corpus.parts" / "00000.manifest.json").write_text("{}")
    capsys.readouterr()
    assert prepare(data)["documents"] == first["documents"] == 5
    assert "up to date" in capsys.readouterr().out


def test_a_source_directory_holding_the_cache_directory_does_not_read_what_runs_wrote_there(tmp_path):
    """data.sources=[data] with the default data.cache_dir, data/cache: a demo run's bundled corpus (kjv.jsonl) and
    megatron's index descriptions (.txt) were prepared with the user's documents. Naming a directory of the cache
    itself still reads it."""
    data, cache = tmp_path / "data", tmp_path / "data" / "cache"
    (cache / "corpus").mkdir(parents=True)
    (cache / "indices").mkdir()
    (data / "mine.jsonl").write_text(json.dumps({"text": "My own document."}) + "\n")
    (cache / "corpus" / "kjv.jsonl").write_text(json.dumps({"text": "In the beginning."}) + "\n")
    (cache / "indices" / "0123-GPTDataset-train-description.txt").write_text('{"class": "GPTDataset"}')
    tokenizer = load_tokenizer("cl100k_base")
    for entry, text in ((data, "My own document."), (cache / "corpus", "In the beginning.")):
        prefix = tmp_path / "out" / entry.name
        prepare(build_config({}, [f"data.cache_dir={cache}", f"data.sources=[{entry}]", f"data.prefix={prefix}"]).data)
        assert read_back(prefix) == [tokenizer.encode(text) + [tokenizer.eod]]


def _prepared_page(tmp_path: Path, text: str, tokenizer_dir: Path):
    """`text` as one web page prepared with `tokenizer_dir`: the tokenizer and the page's ids."""
    source = tmp_path / "web.jsonl"
    source.write_text(json.dumps({"text": text}) + "\n")
    prefix = tmp_path / "web"
    prepare(data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={prefix}", f"data.tokenizer={tokenizer_dir}"))
    (ids,) = read_back(prefix)
    return load_tokenizer(str(tokenizer_dir)), ids


def test_a_special_tokens_text_in_a_document_is_text(small_tokenizer_dir, tmp_path):
    """A web page quoting "<|endoftext|>" keeps it as text: only the EOD appended ends the document."""
    text = "A model once wrote <|endoftext|> in the middle of this page."
    tokenizer, ids = _prepared_page(tmp_path, text, small_tokenizer_dir)
    assert [i for i, token in enumerate(ids) if token == tokenizer.eod] == [len(ids) - 1]
    assert tokenizer.decode(ids[:-1]) == text


def _save_unigram(directory: Path, texts: list[str]) -> None:
    """A SentencePiece-style Unigram (T5's: <pad> 0, EOS </s> 1, <unk> 2) trained on `texts`, saved as Hugging
    Face files: the special tokens are pieces of its model, as a converted SentencePiece model's are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    backend.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(directory))


def test_a_unigram_tokenizer_reads_its_special_tokens_texts_in_a_document_as_text(tmp_path):
    """T5's "</s>" is also the HTML closing tag of struck-out text: in a web page it must not end the document
    (nor "<unk>" become the unknown token)."""
    _save_unigram(tmp_path / "tok", kjv_verses()[:2000] + ["<s>old</s> <unk>"])
    text = "The price was <s>twenty</s> fifteen, the <unk> field empty."
    tokenizer, ids = _prepared_page(tmp_path, text, tmp_path / "tok")
    assert not set(ids[:-1]) & {tokenizer.hf.convert_tokens_to_ids(token) for token in ("</s>", "<unk>")}
    assert tokenizer.decode(ids[:-1]).strip() == text
    assert tokenizer.encode("a</s>")[-1] == tokenizer.eod  # a template's EOS text is still the EOS


def _save_bpe(directory: Path, texts: list[str]) -> None:
    """A byte-level BPE (300 ids, EOS <|endoftext|>) trained on `texts`, saved as Hugging Face files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(directory))


def test_a_retrained_tokenizer_directory_prepares_again_and_old_data_is_refused(tmp_path, capsys):
    """Retrained in place: the same path, vocabulary size and EOS id, but other merges."""
    from megadiff.data.checks import check_training_data

    directory, verses = tmp_path / "tok", kjv_verses()
    _save_bpe(directory, verses[:2000])
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"text": "the quick brown fox jumps over the lazy dog, and sleeps"}) + "\n")
    overrides = [f"data.sources=[{source}]", f"data.prefix={tmp_path / 'out'}", f"data.tokenizer={directory}"]
    prepare(data_config(tmp_path, *overrides))
    _save_bpe(directory, verses[20000:22000])
    tokenizer = load_tokenizer(str(directory))
    training = build_config({}, overrides + ["model.seq_length=4", "model.vocab_size=512", "data.split=1,0,0"])
    with pytest.raises(DataError, match=r"data.tokenizer: .*out was prepared with tokenizer .*, which split text "
                                        r"otherwise"):
        check_training_data(training, tokenizer)

    capsys.readouterr()
    prepare(data_config(tmp_path, *overrides))
    assert "up to date" not in capsys.readouterr().out
    assert read_back(tmp_path / "out") == [tokenizer.encode(json.loads(source.read_text())["text"]) + [tokenizer.eod]]
    check_training_data(training, tokenizer)


def test_the_tokenizer_hash_reads_what_splits_text_not_how_the_file_is_written(tmp_path):
    """tokenizers before 0.20 wrote BPE merges as "a b" strings and no ignore_merges, later versions
    pairs and the field: an exported copy of a hub tokenizer, or one read by a newer library, must hash
    as the original does; a retrained one must not."""
    from megadiff.data.manifest import tokenizer_digest

    _save_bpe(tmp_path / "pairs", kjv_verses()[:2000])
    spec = json.loads((tmp_path / "pairs" / "tokenizer.json").read_text())
    assert spec["model"]["merges"] and isinstance(spec["model"]["merges"][0], list)
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    spec["model"].pop("ignore_merges", None)  # a field later versions added, at its default
    (tmp_path / "strings").mkdir()
    (tmp_path / "strings" / "tokenizer.json").write_text(json.dumps(spec))
    assert tokenizer_digest(tmp_path / "strings") == tokenizer_digest(tmp_path / "pairs")
    _save_bpe(tmp_path / "other", kjv_verses()[20000:22000])
    assert tokenizer_digest(tmp_path / "other") != tokenizer_digest(tmp_path / "pairs")


def test_data_prepared_before_tokenizers_were_hashed_stays_up_to_date(tmp_path, capsys):
    """A manifest without the tokenizer's hash, and with the tokens' sizes only (no loss mask's), as
    earlier versions wrote them: what it records still matches, so upgrading tokenizes nothing again."""
    _save_bpe(tmp_path / "tok", kjv_verses()[:2000])
    source = tmp_path / "qa.jsonl"
    source.write_text(json.dumps({"question": "Who begat Enos?", "answer": "Seth"}) + "\n")
    data = data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={tmp_path / 'sft'}",
                       "data.text_key=question", "data.response_key=answer", f"data.tokenizer={tmp_path / 'tok'}")
    prepare(data)
    manifest_file = tmp_path / "sft.manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["fingerprint"]["tokenizer"]["splits"]
    manifest["output_bytes"] = manifest["output_bytes"][:2]
    manifest_file.write_text(json.dumps(manifest))
    capsys.readouterr()
    prepare(data)
    assert "up to date" in capsys.readouterr().out


def test_a_directory_of_many_files_becomes_one_source_in_one_pass(tmp_path, monkeypatch):
    """A 1T-token corpus may be 100,000s of files: a Source grown by a file at a time copied its
    tuple of files for every file (~50 minutes for a million files)."""
    for i in range(300):
        (tmp_path / f"{i:03d}.jsonl").touch()
    files_given = []

    class CountedSource(sources_module.Source):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            files_given.append(len(self.files))

    monkeypatch.setattr(sources_module, "Source", CountedSource)
    (source,) = sources_module.resolve_sources([str(tmp_path)])
    assert source.files == tuple(sorted(tmp_path.iterdir()))
    assert sum(files_given) == 300


def test_preparing_reads_each_part_s_count_a_number_of_times_that_does_not_grow_with_the_parts(tmp_path,
                                                                                                monkeypatch):
    """A corpus of 10,000 files: the document count checked after each part was summed over every part done so
    far (50 million reads)."""
    reads = []

    class CountedStats(dict):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    prepare_part = prepare_module._prepare_part
    monkeypatch.setattr(prepare_module, "_prepare_part", lambda *args: CountedStats(prepare_part(*args)))

    def documents_read_per_part(files: int) -> float:
        source_dir = tmp_path / f"src{files}"
        source_dir.mkdir()
        for i in range(files):
            (source_dir / f"{i:03d}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
        reads.clear()
        prepare(data_config(tmp_path, f"data.sources=[{source_dir}]", f"data.prefix={tmp_path / str(files) / 'x'}"))
        return reads.count("documents") / files

    assert documents_read_per_part(12) == documents_read_per_part(3)


def test_a_prefix_with_brackets_is_printed_as_written(corpus, tmp_path, capsys):
    prefix = tmp_path / "web[v2]" / "subset"
    config = data_config(tmp_path, f"data.sources=[{corpus[0]}]", f"data.prefix='{prefix}'")
    prepare(config)
    prepare(config)
    assert f"prepare-data: {prefix} is up to date" in capsys.readouterr().out


def test_a_hub_dataset_updated_upstream_is_prepared_again(tmp_path, monkeypatch, capsys):
    """A hub dataset's fingerprint holds the commit its builder finds, and the data is read at that
    commit. The hub is a stand-in here (no network): it serves one text per commit."""
    import datasets

    name, commit, reads = "owner-megadiff/verses", {"sha": "1111"}, []
    real_load = datasets.load_dataset

    def load_dataset(path, *args, **options):
        if path != name:
            return real_load(path, *args, **options)
        reads.append(options["revision"])
        return datasets.Dataset.from_dict({"text": [f"Verse at commit {options['revision']}."]})

    monkeypatch.setattr(datasets, "load_dataset_builder", lambda path: SimpleNamespace(hash=commit["sha"]))
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    prefix, tokenizer = tmp_path / "hub", load_tokenizer("cl100k_base")
    config = data_config(tmp_path, f"data.sources=[{name}]", f"data.prefix={prefix}")
    prepare(config)
    assert reads == ["1111"] and read_back(prefix) == [tokenizer.encode("Verse at commit 1111.") + [tokenizer.eod]]
    capsys.readouterr()
    prepare(config)
    assert "up to date" in capsys.readouterr().out and reads == ["1111"]

    commit["sha"] = "2222"
    prepare(config)
    assert reads == ["1111", "2222"]
    assert read_back(prefix) == [tokenizer.encode("Verse at commit 2222.") + [tokenizer.eod]]

    # a manifest written before commits were recorded stands for what it records: no second tokenizing;
    # it then records the commit found, so that the next upstream change is seen
    manifest = Path(f"{prefix}.manifest.json")
    recorded = json.loads(manifest.read_text())
    assert recorded["fingerprint"]["sources"] == [[name, "2222"]]
    recorded["fingerprint"]["sources"] = [[name]]
    manifest.write_text(json.dumps(recorded))
    capsys.readouterr()
    prepare(config)
    assert "up to date" in capsys.readouterr().out and reads == ["1111", "2222"]
    assert json.loads(manifest.read_text()) == {**recorded, "fingerprint": {**recorded["fingerprint"],
                                                                           "sources": [[name, "2222"]]}}
    commit["sha"] = "3333"
    prepare(config)
    assert reads == ["1111", "2222", "3333"]


def test_a_tokenizer_with_other_merges_but_the_same_vocabulary_hashes_otherwise(small_tokenizer_dir, tmp_path,
                                                                                capsys):
    """A tokenizer whose merges were edited keeps every id of its vocabulary, yet splits text otherwise: its
    hash must change, and data prepared with it before must be prepared again, or the old ids mean other text."""
    from megadiff.data.manifest import tokenizer_digest

    directory = tmp_path / "tok"
    shutil.copytree(small_tokenizer_dir, directory)
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"text": "the quick brown fox jumps over the lazy dog, and sleeps"}) + "\n")
    overrides = [f"data.sources=[{source}]", f"data.prefix={tmp_path / 'out'}", f"data.tokenizer={directory}"]
    prepare(data_config(tmp_path, *overrides))
    before = tokenizer_digest(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges[:len(merges) // 4]  # fewer merges: the same vocabulary, longer encodings
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.hf.get_vocab() == load_tokenizer(str(small_tokenizer_dir)).hf.get_vocab()
    assert tokenizer_digest(directory) != before

    capsys.readouterr()
    prepare(data_config(tmp_path, *overrides))
    assert "up to date" not in capsys.readouterr().out
    assert read_back(tmp_path / "out") == [tokenizer.encode(json.loads(source.read_text())["text"]) + [tokenizer.eod]]


def test_another_text_key_prepares_the_other_field(tmp_path, capsys):
    """Records holding a title and a body: preparing the same sources with data.text_key=body after
    data.text_key=title must tokenize the bodies, not call the titles' data up to date."""
    source = tmp_path / "records.jsonl"
    records = [{"title": "Genesis", "body": "In the beginning God created the heaven and the earth."},
               {"title": "John", "body": "Jesus wept."}]
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    prefix = tmp_path / "out"
    tokenizer = load_tokenizer("cl100k_base")
    for key in ("title", "body"):
        capsys.readouterr()
        prepare(data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={prefix}", f"data.text_key={key}"))
        assert "up to date" not in capsys.readouterr().out
        assert read_back(prefix) == [tokenizer.encode(record[key]) + [tokenizer.eod] for record in records]


def test_compressed_sources_read_as_their_uncompressed_texts(tmp_path):
    """.gz/.bz2/.xz sources (suffixes in any case) are documented as read: a compressed dump must give the
    tokens its uncompressed files give, not be refused as an unsupported file type."""
    import bz2
    import gzip
    import lzma

    records = "".join(json.dumps({"text": text}) + "\n" for text in ("In the beginning.", "Jesus wept."))
    book = "And God said, Let there be light: and there was light.\n"
    files = {"plain": {"a.jsonl": records, "b.txt": book, "c.jsonl": records},
             "packed": {"a.jsonl.gz": gzip.compress(records.encode()), "b.TXT.XZ": lzma.compress(book.encode()),
                        "c.jsonl.bz2": bz2.compress(records.encode())}}
    for folder, contents in files.items():
        (tmp_path / folder).mkdir()
        for name, content in contents.items():
            path = tmp_path / folder / name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        sources = ",".join(str(tmp_path / folder / name) for name in contents)
        prepare(data_config(tmp_path, f"data.sources=[{sources}]", f"data.prefix={tmp_path / folder / 'out'}"))
    tokenizer = load_tokenizer("cl100k_base")
    texts = ["In the beginning.", "Jesus wept.", book, "In the beginning.", "Jesus wept."]
    assert read_back(tmp_path / "plain" / "out") == [tokenizer.encode(t) + [tokenizer.eod] for t in texts]
    assert read_back(tmp_path / "packed" / "out") == read_back(tmp_path / "plain" / "out")


def test_a_txt_files_byte_order_mark_is_no_text(tmp_path, capsys):
    """A BOM (which Windows editors write) marks the encoding: it began each such txt document with tokens of its own,
    compressed or not, where a jsonl's is dropped. Data prepared with it is prepared again."""
    import gzip

    text, bom = "In the beginning God created the heaven and the earth.\n", b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + text.encode())
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(bom + text.encode()))
    (tmp_path / "c.jsonl").write_bytes(bom + json.dumps({"text": text}).encode() + b"\n")
    config = data_config(tmp_path, f"data.sources=[{tmp_path}]", f"data.prefix={tmp_path / 'out' / 'out'}")
    prepare(config)
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "out" / "out") == [tokenizer.encode(text) + [tokenizer.eod]] * 3

    manifest_file = tmp_path / "out" / "out.manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["fingerprint"]["txt_bom"]  # as an earlier version wrote it
    manifest_file.write_text(json.dumps(manifest))
    capsys.readouterr()
    prepare(config)
    assert "up to date" not in capsys.readouterr().out


@pytest.mark.parametrize("bad, problem", [('"a string"', "a JSON str, not an object"), ("[1, 2]", "a JSON list"),
                                          ('{"text": "x\\ud800"}', "no Unicode text: it escapes a lone surrogate"),
                                          ('{"text": "cut sh', "not JSON")])
def test_a_json_line_that_is_no_record_is_named_by_its_line(tmp_path, bad, problem):
    """Arrow's reader named a row counted from its block's start ("row 0" for a file's third line): the line is
    named by its number in the file, compressed or not."""
    import gzip

    lines = [json.dumps({"text": f"Verse {i}."}) for i in range(5)]
    lines[2] = bad
    content = ("\n".join(lines) + "\n").encode()
    for name, data in (("bad.jsonl", content), ("bad.jsonl.gz", gzip.compress(content))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=rf"data.sources\[0\]: .*{name} could not be read: line 3 is {problem}"):
            prepare(data_config(tmp_path, f"data.sources=[{tmp_path / name}]", f"data.prefix={tmp_path / 'out'}"))


def test_a_truncated_compressed_jsonl_is_refused_naming_it(tmp_path):
    """Looking for the bad line must not replace the reader's refusal with a traceback of its own."""
    import gzip

    packed = gzip.compress("".join(json.dumps({"text": f"Verse {i}."}) + "\n" for i in range(5000)).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[:-2000])
    with pytest.raises(DataError, match=r"data.sources\[0\]: .*cut.jsonl.gz could not be read: Compressed file ended"):
        prepare(data_config(tmp_path, f"data.sources=[{tmp_path / 'cut.jsonl.gz'}]", f"data.prefix={tmp_path / 'out'}"))


def test_a_source_rewritten_at_the_same_size_is_prepared_again(tmp_path, capsys):
    """An edited source whose size happens to stay the same (a corrected typo) is told apart by its
    modification time: it must be prepared again, not served as the old text's tokens."""
    source = tmp_path / "c.jsonl"
    first, second = "The quick brown fox.", "The quick brown cat."
    source.write_text(json.dumps({"text": first}) + "\n")
    size, stamp = source.stat().st_size, source.stat().st_mtime_ns
    config = data_config(tmp_path, f"data.sources=[{source}]", f"data.prefix={tmp_path / 'out'}")
    prepare(config)
    source.write_text(json.dumps({"text": second}) + "\n")
    os.utime(source, ns=(stamp + 10**9, stamp + 10**9))  # a second later, whatever the file system's resolution
    assert source.stat().st_size == size
    capsys.readouterr()
    prepare(config)
    assert "up to date" not in capsys.readouterr().out
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "out") == [tokenizer.encode(second) + [tokenizer.eod]]


def test_many_batches_on_several_workers_keep_the_documents_order(corpus, tmp_path, monkeypatch):
    """With more batches than the workers keep in flight, results must still come back in input order:
    two workers must write the bytes one writes, or documents (and a loss mask's alignment) are shuffled."""
    monkeypatch.setattr(prepare_module, "DOCUMENTS_PER_BATCH", 1)  # 26 records: 26 batches, 8 in flight
    for workers in (1, 2):
        prepare(data_config(tmp_path, f"data.sources=[{corpus[0]}]", f"data.prefix={tmp_path / f'w{workers}'}",
                            f"data.workers={workers}"))
    tokenizer = load_tokenizer("cl100k_base")
    assert read_back(tmp_path / "w1") == [tokenizer.encode(d) + [tokenizer.eod] for d in corpus[1]]
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'w2'}{ext}").read_bytes() == Path(f"{tmp_path / 'w1'}{ext}").read_bytes()


def test_tokenizer_directories_of_the_same_name_get_their_own_tag(tmp_path):
    """Two tokenizers both saved as ".../tokenizer" must not share a bundled corpus's prepared prefix: one
    would be trained on the other's ids; a copy of one elsewhere (a node's own) reads text into the same ids."""
    from megadiff.data.locations import data_prefix, tokenizer_tag

    first, second, copy = tmp_path / "a" / "tok", tmp_path / "b" / "tok", tmp_path / "c" / "tok"
    verses = kjv_verses()
    for directory, some in ((first, verses[:300]), (second, verses[300:600])):
        directory.mkdir(parents=True)
        save_small_tokenizer(directory, some)
    shutil.copytree(first, copy)
    assert tokenizer_tag(str(first)) != tokenizer_tag(str(second))
    assert tokenizer_tag(str(first)) == tokenizer_tag(str(copy))
    assert tokenizer_tag(str(first)) == tokenizer_tag(str(tmp_path / "b" / ".." / "a" / "tok"))
    assert tokenizer_tag(str(first)).startswith("tok-") and tokenizer_tag("cl100k_base") == "cl100k_base"
    prefixes = {data_prefix(data_config(tmp_path, "data.bundled_corpus=kjv", f"data.tokenizer={directory}"))
                for directory in (first, second)}
    assert len(prefixes) == 2


def test_local_files_are_prepared_without_asking_the_network(tmp_path, monkeypatch):
    """datasets pinged the hub (a download count, up to 3 s each behind a firewall that drops packets) once per
    local file it loaded: a directory of many small files waited on the network file by file."""
    import socket

    import datasets
    import huggingface_hub

    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
    # as on a machine without HF_HUB_OFFLINE (the suite sets it), where datasets counts downloads
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    connections = []

    def refuse(address, *args, **kwargs):
        connections.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    stats = prepare(data_config(tmp_path, f"data.sources=[{tmp_path / 'src'}]", f"data.prefix={tmp_path / 'out'}"))
    assert stats["documents"] == 3
    assert connections == []


def test_tokenizing_logs_its_progress_without_a_terminal(corpus, tmp_path, monkeypatch, capsys):
    """Under Slurm (standard error a file) prepare-data said nothing while it tokenized a corpus for hours: rich
    draws its bars on a terminal only. Each line's counts are those of the records and tokens read so far."""
    monkeypatch.setattr(prepare_module, "DOCUMENTS_PER_BATCH", 5)
    monkeypatch.setattr("megadiff.console.PROGRESS_LINE_SECONDS", 0.0)  # a line for every batch
    prepare(data_config(tmp_path, f"data.sources=[{corpus[0]}]", f"data.prefix={tmp_path / 'out'}"))
    tokenizer = load_tokenizer("cl100k_base")
    records = [json.loads(line).get("text") for line in corpus[0].read_text().splitlines()]
    tokens = [len(tokenizer.encode(text)) + 1 if text else 0 for text in records]
    ends = [*range(5, len(records), 5), len(records)]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing")]
    assert [" ".join(line.split()[:4]) for line in lines] == \
        [f"tokenizing {end}/{len(records)} {sum(tokens[:end]):,} tokens" for end in ends]
