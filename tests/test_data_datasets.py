"""Training datasets (megatron's GPTDataset over prepared data): windows, seeds, splits, blends,
length up-sampling, and the bad-data checks pre-training runs first.

Indexed datasets are written directly from synthetic token ids, so every expectation is
computed naively in the test from the same ids.
"""
from __future__ import annotations

import collections
import io
import json
import shutil
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megadiff.config import ConfigError, build_config
from megadiff.data import indexed
from megadiff.data.checks import check_training_data
from megadiff.data.datasets import build_datasets, sources_read_again
from megadiff.data.errors import DataError
from megadiff.data.indexed import (
    INDEX_HEADER_BYTES, AtomicIndexedWriter, read_index, sequence_lengths, token_count, token_dtype,
)
from megadiff.data.manifest import write_manifest
from megadiff.data.upsampling import length_repeats
from tests.distributed import run_ranks
from tests.hostile_files import OpensAFile

SEQ = 16
EOD = 1000
TOKENIZER = SimpleNamespace(name="synthetic", vocab_size=EOD + 1, eod=EOD, text_start=())


def write_documents(prefix: Path, documents: list[np.ndarray]) -> None:
    with AtomicIndexedWriter(prefix, token_dtype(TOKENIZER.vocab_size)) as writer:
        for doc in documents:
            writer.add_documents(doc, np.array([len(doc)]))
        writer.commit()


def synthetic_documents(count: int, seed: int, low: int = 0, high: int = EOD, max_len: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(low, high, rng.integers(1, max_len)), EOD) for _ in range(count)]


class EntriesRead(np.ndarray):
    """An index array that counts the entries read of it: by indexing, or whole by a numpy function or reduction."""

    @classmethod
    def of(cls, array: np.ndarray, read: list[int]) -> "EntriesRead":
        view = array.view(cls)
        view.read = read
        return view

    def __getitem__(self, key):
        item = np.asarray(self)[key]
        self.read.append(np.size(item))
        return item

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        self.read.append(self.size)
        return getattr(ufunc, method)(*self._plain(inputs), **kwargs)

    def __array_function__(self, func, types, args, kwargs):  # numpy.bincount, numpy.unique, ... read it whole
        self.read.append(self.size)
        return func(*self._plain(args), **kwargs)

    @staticmethod
    def _plain(arrays: tuple) -> list:
        return [np.asarray(x) if isinstance(x, EntriesRead) else x for x in arrays]


def config(tmp_path: Path, *overrides: str):
    return build_config({}, [f"model.seq_length={SEQ}", "model.vocab_size=1024", f"data.cache_dir={tmp_path / 'cache'}",
                             *overrides])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    documents = synthetic_documents(200, seed=0)
    write_documents(root / "docs", documents)
    return root / "docs", documents


def split_range(count: int, split: list[float], index: int) -> range:
    """The documents of split `index`, computed from the split weights like megatron's builder cuts them."""
    bounds = np.concatenate([[0], np.cumsum(split)]) / sum(split)
    return range(int(round(bounds[index] * count)), int(round(bounds[index + 1] * count)))


def test_a_valid_split_asked_for_more_samples_than_it_holds_is_named(corpus, tmp_path):
    """sources_read_again names a split asked for more samples than one pass over its documents gives (as many as
    its tokens fill, counted here from the documents): those read some documents twice, the others none."""
    prefix, documents = corpus
    cfg = config(tmp_path, f"data.prefix={prefix}", "data.split=80,10,10")
    tokens = sum(len(documents[d]) for d in split_range(len(documents), [80, 10, 10], 1))
    distinct = (tokens - 1) // SEQ  # a sample reads SEQ + 1 tokens
    for asked, named in ((distinct, []), (distinct + 1, [(str(prefix), distinct + 1, distinct)])):
        _, valid, _ = build_datasets(cfg, TOKENIZER, (0, asked, 0), seed=3)
        assert sources_read_again(valid) == named
        passes = len(valid.document_index) / len(split_range(len(documents), [80, 10, 10], 1))
        assert passes == (1 if asked <= distinct else 2)  # the documents of a second pass shuffled in


def test_a_blended_source_is_named_only_where_the_blend_reads_a_token_of_it_twice(tmp_path):
    """megatron builds each source of a blend 0.5% larger than its share: sources_read_again took that size for the
    samples read, and named a source whose share was exactly one pass, none of whose documents is read twice."""
    distinct = 40
    for name in "ab":
        # every token id once (documents of SEQ tokens, the last one longer): one pass gives `distinct` samples
        ids = iter(range(distinct * SEQ))
        write_documents(tmp_path / name, [np.append([next(ids) for _ in range(SEQ - 1 + (i == distinct - 1))], EOD)
                                          for i in range(distinct)])
    cfg = config(tmp_path, f"data.blend=[1,{tmp_path / 'a'},1,{tmp_path / 'b'}]", "data.split=1,0,0")
    for asked in (2 * distinct, 2 * distinct + 2):
        train = build_datasets(cfg, TOKENIZER, (asked, 0, 0), seed=0)[0]
        read = {str(tmp_path / name): [] for name in "ab"}
        for i in range(asked):  # the tokens a run reads of each source, from the samples themselves
            tokens = train[i]["tokens"]
            read[train.datasets[train.dataset_index[i]].dataset_path] += tokens[tokens != EOD].tolist()
        twice = [prefix for prefix, tokens in read.items() if len(set(tokens)) < len(tokens)]
        assert twice == ([] if asked == 2 * distinct else [str(tmp_path / n) for n in "ab"])
        assert [prefix for prefix, _, _ in sources_read_again(train)] == twice


def test_a_blends_samples_per_source_are_counted_from_the_end_of_its_index(corpus, tmp_path, monkeypatch):
    """The start report counted a blend's samples of each source over its whole index at every start (2 bytes a
    sample, 0.5 GB at 1T tokens in 4K windows): read back from its end, the index gives each source's count at
    its last place there. The counts are checked against counting every place."""
    from megadiff.data import datasets

    other = tmp_path / "other"
    write_documents(other, synthetic_documents(150, seed=5))
    cfg = config(tmp_path, f"data.blend=[3,{corpus[0]},1,{other}]", "data.split=1,0,0")
    train = build_datasets(cfg, TOKENIZER, (3000, 0, 0), seed=2)[0]
    index = np.asarray(train.dataset_index)
    counts = np.bincount(index, minlength=2)
    chunk = 64
    monkeypatch.setattr(datasets, "BLEND_INDEX_CHUNK", chunk, raising=False)
    read = []
    train.dataset_index = EntriesRead.of(index, read)
    asked = {str(corpus[0]): int(counts[0]), str(other): int(counts[1])}
    assert {prefix: reads for prefix, reads, _ in sources_read_again(train)} == asked
    # the chunks back to the earliest of the sources' last places
    last_places = [np.flatnonzero(index == source)[-1] for source in range(2)]
    assert sum(read) <= -(-(len(index) - min(last_places)) // chunk) * chunk < len(index) // 10


def test_samples_are_consecutive_windows_of_the_shuffled_document_stream(corpus, tmp_path):
    prefix, documents = corpus
    cfg = config(tmp_path, f"data.prefix={prefix}", "data.split=80,10,10")
    train, valid, test = build_datasets(cfg, TOKENIZER, (300, 20, 10), seed=3)
    for dataset, index in ((train, 0), (valid, 1), (test, 2)):
        docs = split_range(len(documents), [80, 10, 10], index)
        epochs = len(dataset.document_index) // len(docs)
        assert sorted(dataset.document_index) == sorted(list(docs) * epochs)
        stream = np.concatenate([documents[d] for d in dataset.document_index])
        assert len(dataset) >= (300, 20, 10)[index]
        for j in range(min(len(dataset), 60)):
            sample, k = dataset[j], int(dataset.shuffle_index[j])
            assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
            assert sample["tokens"].tolist() == stream[k * SEQ:(k + 1) * SEQ].tolist()
            assert sample["labels"].tolist() == stream[k * SEQ + 1:(k + 1) * SEQ + 1].tolist()
            assert sample["loss_mask"].tolist() == [1.0] * SEQ
            assert sample["position_ids"].tolist() == list(range(SEQ))


@pytest.mark.parametrize("upsampled", [False, True])
def test_eod_mask_loss_drops_the_loss_after_each_eod(corpus, tmp_path, upsampled):
    overrides = [f"data.prefix={corpus[0]}", "data.split=80,10,10", "data.eod_mask_loss=true",
                 f"data.length_upsampling={upsampled}"]
    train, _, _ = build_datasets(config(tmp_path, *overrides), TOKENIZER, (100, 10, 10), seed=3)
    samples = [train[j] for j in range(100)]
    assert any(EOD in sample["tokens"] for sample in samples)
    for sample in samples:
        assert sample["loss_mask"].tolist() == [float(token != EOD) for token in sample["tokens"]]


def test_a_job_sharing_the_index_cache_builds_after_the_one_writing_it(corpus, tmp_path, capsys):
    """Another job's rank 0 building the same data.cache_dir's indices holds their lock: this one waits, then
    reads whole files (it read them torn, or wrote them again in place under the other)."""
    import threading

    from megadiff.data.locations import index_cache_dir
    from megadiff.files import exclusive_lock

    cfg = config(tmp_path, f"data.prefix={corpus[0]}", "data.split=9,1,0")
    built = []
    builder = threading.Thread(target=lambda: built.append(build_datasets(cfg, TOKENIZER, (10, 10, 0), seed=0)))
    with exclusive_lock(index_cache_dir(cfg.data) / ".build.lock"):  # the other job's
        builder.start()
        builder.join(timeout=3)
        assert builder.is_alive() and not built and not list(index_cache_dir(cfg.data).glob("*.npy"))
    builder.join(timeout=120)
    assert len(built) == 1 and len(built[0][0]) >= 10 and list(index_cache_dir(cfg.data).glob("*.npy"))
    lock = index_cache_dir(cfg.data) / ".build.lock"
    said = capsys.readouterr().err
    assert f"megadiff: waiting for another job building the data's index cache (holding {lock})" in said


class Killed(BaseException):
    """A process killed where it stood (no `except Exception` stops it)."""


def test_an_index_build_killed_while_writing_leaves_no_index_a_later_run_reads(corpus, tmp_path, monkeypatch):
    """megatron wrote each index array in place: a rank 0 killed in the middle (a node lost, a time limit's SIGKILL)
    left a cut index under its own name, which every later run on the cache took for whole and failed on; and
    another job's rank 0 on another node, where the cache's lock is no lock (a shared filesystem without
    cluster-wide flock), read it torn while it was written."""
    cfg = config(tmp_path, f"data.prefix={corpus[0]}", "data.split=9,1,0")
    write_array, written = np.lib.format.write_array, []

    def killed_writing_the_third(stream, array, *args, **kwargs):
        """megatron's third array (the shuffle index) cut half way, header and all, as a kill leaves it."""
        if len(written) < 2:
            written.append(array)
            return write_array(stream, array, *args, **kwargs)
        whole = io.BytesIO()
        write_array(whole, array, *args, **kwargs)
        stream.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(np.lib.format, "write_array", killed_writing_the_third)
        with pytest.raises(Killed):
            build_datasets(cfg, TOKENIZER, (10, 0, 0), seed=0)
    rebuilt, _, _ = build_datasets(cfg, TOKENIZER, (10, 0, 0), seed=0)
    whole, _, _ = build_datasets(config(tmp_path / "uninterrupted", f"data.prefix={corpus[0]}", "data.split=9,1,0"),
                                 TOKENIZER, (10, 0, 0), seed=0)
    assert len(rebuilt) == len(whole)
    for i in range(len(whole)):
        assert rebuilt[i]["tokens"].tolist() == whole[i]["tokens"].tolist()


def test_an_index_cache_file_that_is_a_pickle_is_refused_unrun(corpus, tmp_path):
    """megatron reads the cache with numpy.load(allow_pickle=True): a pickle put in a shared data.cache_dir ran."""
    import pickle

    from megadiff.data.locations import index_cache_dir

    cfg = config(tmp_path, f"data.prefix={corpus[0]}", "data.split=9,1,0")
    numpy_load = np.load
    build_datasets(cfg, TOKENIZER, (10, 10, 0), seed=0)
    created = tmp_path / "created-by-the-cache"
    for cached in index_cache_dir(cfg.data).glob("*.npy"):
        cached.write_bytes(pickle.dumps(OpensAFile(created)))
    with pytest.raises(DataError, match=r"-document_index\.npy is no \.npy array \(a pickle"):
        build_datasets(cfg, TOKENIZER, (10, 10, 0), seed=0)
    assert not created.exists()
    assert np.load is numpy_load  # numpy's own again, for whoever loads next


def test_a_split_with_zero_weight_is_none(corpus, tmp_path):
    cfg = config(tmp_path, f"data.prefix={corpus[0]}", "data.split=9,1,0")
    train, valid, test = build_datasets(cfg, TOKENIZER, (10, 10, 0), seed=0)
    assert test is None
    assert set(valid.document_index) == set(split_range(len(corpus[1]), [9, 1, 0], 1))


def test_same_seed_same_samples_other_seed_other_order(corpus, tmp_path):
    def samples(seed, cache):
        train = build_datasets(config(tmp_path, f"data.prefix={corpus[0]}", f"data.cache_dir={tmp_path / cache}",
                                      "data.split=80,10,10"),
                               TOKENIZER, (200, 10, 10), seed)[0]
        return [tuple(train[i]["tokens"].tolist()) for i in range(len(train))]

    first, again, other = samples(5, "a"), samples(5, "b"), samples(6, "c")
    assert first == again
    assert first != other
    assert collections.Counter(first[:100]) != collections.Counter(other[:100])  # not a mere re-labelling


def test_blend_weights_are_respected(tmp_path):
    # two sources told apart by their ids: A uses ids < 500, B ids >= 500
    write_documents(tmp_path / "a", synthetic_documents(100, seed=1, high=500))
    write_documents(tmp_path / "b", synthetic_documents(100, seed=2, low=500))
    cfg = config(tmp_path, f"data.blend=[1,{tmp_path / 'a'},3,{tmp_path / 'b'}]", "data.split=1,0,0")
    train = build_datasets(cfg, TOKENIZER, (800, 0, 0), seed=0)[0]
    from_a = [bool((train[i]["tokens"][train[i]["tokens"] != EOD] < 500).all()) for i in range(len(train))]
    assert len(train) >= 800
    assert abs(np.mean(from_a) - 0.25) < 0.02


def test_length_upsampling_repeats_documents_in_proportion_to_length(tmp_path):
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 20 * SEQ, 120)
    documents = [np.append(rng.integers(0, EOD, n - 1), EOD) for n in lengths]
    write_documents(tmp_path / "docs", documents)

    def counts(*overrides):
        cfg = config(tmp_path, f"data.prefix={tmp_path / 'docs'}", "data.split=1,0,0", *overrides)
        train = build_datasets(cfg, TOKENIZER, (500, 0, 0), seed=0)[0]
        return np.bincount(train.document_index, minlength=len(documents)), train

    plain, _ = counts()
    assert (plain == plain[0]).all()  # without up-sampling every document appears once per epoch

    for unit in (SEQ, 3 * SEQ):
        overrides = ["data.length_upsampling=true"] + ([f"data.length_upsampling_unit={unit}"] if unit != SEQ else [])
        seen, train = counts(*overrides)
        naive = np.array([max(1, int(n / unit + 0.5)) for n in lengths])  # round half up, never below once
        epochs = seen.sum() // naive.sum()
        assert (seen == epochs * naive).all()
        long = lengths >= unit
        per_token = seen[long] / (epochs * lengths[long])
        assert np.allclose(per_token, 1 / unit, rtol=0.5)  # frequency proportional to length
        # samples are still windows of the (now up-sampled) document stream
        stream = np.concatenate([documents[d] for d in train.document_index])
        k = int(train.shuffle_index[7])
        assert train[7]["tokens"].tolist() == stream[k * SEQ:(k + 1) * SEQ].tolist()
    assert (length_repeats(lengths, SEQ) == np.maximum(1, np.floor(lengths / SEQ + 0.5))).all()
    # from the cache (as on every rank but the one that built it): the same order; the repeated documents
    # are held by no rank once the indices are built
    cached = counts(*overrides)[1]
    assert np.array_equal(cached.document_index, train.document_index)
    assert np.array_equal(cached.indices, np.arange(len(documents)))
    assert np.array_equal(train.indices, np.arange(len(documents)))


def _build_on_rank(rank: int, world_size: int, prefix: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        cfg = config(Path(cache), f"data.prefix={prefix}", "data.split=80,10,10")
        train = build_datasets(cfg, TOKENIZER, (100, 10, 10), seed=9)[0]
        Path(out, f"{rank}.json").write_text(json.dumps([train[i]["tokens"].tolist() for i in range(len(train))]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_share_one_index_cache_and_see_the_same_samples(corpus, tmp_path):
    run_ranks(2, _build_on_rank, str(corpus[0]), str(tmp_path), str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    alone = build_datasets(config(tmp_path / "alone", f"data.prefix={corpus[0]}", "data.split=80,10,10"), TOKENIZER,
                           (100, 10, 10), 9)[0]
    assert ranks[0] == ranks[1] == [alone[i]["tokens"].tolist() for i in range(len(alone))]
    assert len(list((tmp_path / "cache" / "indices").glob("*-PreparedGPTDataset-train-shuffle_index.npy"))) == 1


def _count_index_reads_on_rank(rank: int, world_size: int, prefixes: list[str], cache: str, out: str) -> None:
    """Builds a blend of `prefixes`, counting the indexes this rank reads whole; then a run refused for a too long
    sample: every rank's refusal."""
    import torch.distributed as dist

    from megadiff.data import checks

    reads = collections.Counter()
    whole = checks.read_index  # what reads an .idx's length per document
    checks.read_index = lambda prefix, *args: (reads.update([Path(prefix).name]), whole(prefix, *args))[1]
    dist.init_process_group("gloo")
    try:
        blend = f"data.blend=[{','.join(prefixes)}]"
        train = build_datasets(config(Path(cache), blend, "data.split=80,10,10"), TOKENIZER, (100, 10, 0), seed=9)[0]
        built_with = dict(reads)
        refusal = None
        try:
            build_datasets(config(Path(cache), blend, "data.split=80,10,10", "model.seq_length=100000"), TOKENIZER,
                           (100, 10, 0), seed=9)
        except DataError as error:
            refusal = str(error)
        report = {"reads": built_with, "samples": len(train), "refusal": refusal}
        Path(out, f"{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_rank_reads_the_indexes_for_the_checks_and_every_rank_hears_its_refusal(corpus, tmp_path):
    """An index holds 4 bytes a document (8 GB for a 1T-token corpus): every rank of a 1,000-rank job read every
    prefix's whole at each start, for checks whose verdict is the same on all ranks."""
    other = tmp_path / "other"
    write_documents(other, synthetic_documents(120, seed=1))
    prefixes = [str(corpus[0]), str(other)]
    run_ranks(2, _count_index_reads_on_rank, prefixes, str(tmp_path), str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["reads"] == {Path(prefix).name: 1 for prefix in prefixes}  # each index once, on one rank
    assert ranks[1]["reads"] == {}
    assert ranks[0]["samples"] == ranks[1]["samples"] >= 100
    assert "model.seq_length" in ranks[0]["refusal"]
    assert ranks[1]["refusal"] == f"rank 0 refused the run: {ranks[0]['refusal']}"


def test_a_rank_checking_its_own_files_finds_a_bin_of_other_data(corpus, tmp_path):
    """What the ranks that leave the checks to rank 0 read of their files (a node's copy): a few bytes, which tell
    a .bin cut short or longer than its .idx says, as read_index does."""
    prefix = _copy_corpus(corpus, tmp_path)
    indexed.open_index(prefix)
    whole = (tmp_path / "docs.bin").read_bytes()
    for damaged in (whole[:-2], whole + b"\0\0"):
        (tmp_path / "docs.bin").write_bytes(damaged)
        expected = f"docs.idx describes {len(whole)} bytes of tokens but .*docs.bin holds {len(damaged)}"
        for check in (read_index, indexed.open_index):
            with pytest.raises(DataError, match=expected):
                check(prefix)
    write_documents(tmp_path / "empty", [])
    indexed.open_index(tmp_path / "empty")


# ---- bad data, caught before any compute -------------------------------------------------------

def test_build_datasets_refuses_a_split_without_tokens_instead_of_hanging(corpus, tmp_path):
    """200 documents, split 949,50,1: the test split gets round(0.999 * 200) .. 200, no document. Refused where
    it is read; pre-training reads none, and leaves it unbuilt (a converted model's split on a small corpus)."""
    cfg = config(tmp_path, f"data.prefix={corpus[0]}")
    with pytest.raises(DataError, match="the test split .* holds 0 tokens"):
        build_datasets(cfg, TOKENIZER, (10, 10, 1), seed=0)
    train, valid, test = build_datasets(cfg, TOKENIZER, (10, 10, 0), seed=0)
    assert len(train) >= 10 and len(valid) >= 10 and test is None


def test_a_missing_prefix_suggests_prepare_data(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"data.prefix: .*nothing.bin and .*nothing.idx not found; prepare the data "
                                        r"first: megadiff prepare-data"):
        check_training_data(config(tmp_path, f"data.prefix={tmp_path / 'nothing'}"), TOKENIZER)
    # a run's relative prefix, read elsewhere (evaluating from another directory): where it was looked for
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=rf"not found \(a relative prefix is read from the current directory, "
                                        rf"{tmp_path}: run where"):
        check_training_data(config(tmp_path, "data.prefix=data/nothing"), TOKENIZER)
    with pytest.raises(DataError, match="data.prefix: not set"):
        check_training_data(config(tmp_path), TOKENIZER)


def test_an_idx_that_does_not_match_its_bin(corpus, tmp_path):
    for ext in (".bin", ".idx"):
        shutil.copy(f"{corpus[0]}{ext}", tmp_path / f"docs{ext}")
    with open(tmp_path / "docs.bin", "ab") as extra:
        extra.write(b"\0\0")
    with pytest.raises(DataError, match=r"data.prefix: .*docs.idx describes \d+ bytes of tokens but .*docs.bin holds"):
        check_training_data(config(tmp_path, f"data.prefix={tmp_path / 'docs'}"), TOKENIZER)
    (tmp_path / "docs.bin").write_bytes((tmp_path / "docs.bin").read_bytes()[:-2])
    read_index(tmp_path / "docs")
    lengths = sequence_lengths(tmp_path / "docs", 2)
    with open(tmp_path / "docs.idx", "r+b") as index:  # the first two lengths, their sum kept
        index.seek(INDEX_HEADER_BYTES)
        index.write(np.array([-1000, lengths[0] + lengths[1] + 1000], dtype=np.int32).tobytes())
    with pytest.raises(DataError, match=r"docs.idx is not a readable megatron index \(a negative document length"):
        read_index(tmp_path / "docs")
    (tmp_path / "docs.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match="docs.idx is not a readable megatron index"):
        check_training_data(config(tmp_path, f"data.prefix={tmp_path / 'docs'}"), TOKENIZER)


def test_a_tokenizer_larger_than_the_model_vocabulary(corpus, tmp_path):
    with pytest.raises(DataError, match=r"model.vocab_size: 512 is smaller than the vocabulary of data.tokenizer "
                                        r"'cl100k_base' \(1001 ids\)"):
        check_training_data(config(tmp_path, f"data.prefix={corpus[0]}", "model.vocab_size=512"), TOKENIZER)
    check_training_data(config(tmp_path, f"data.prefix={corpus[0]}", "data.split=80,10,10"), TOKENIZER)  # 1024 rows


def test_data_prepared_with_another_tokenizer(corpus, tmp_path):
    for ext in (".bin", ".idx"):
        shutil.copy(f"{corpus[0]}{ext}", tmp_path / f"docs{ext}")
    prepared_with = {"spec": "o200k_base", "vocab_size": 200019, "eod": 199999}
    write_manifest(tmp_path / "docs", {"tokenizer": prepared_with}, {}, [tmp_path / "docs"])
    with pytest.raises(DataError, match="data.tokenizer: .*docs was prepared with tokenizer 'o200k_base'"):
        check_training_data(config(tmp_path, f"data.prefix={tmp_path / 'docs'}"), TOKENIZER)
    (tmp_path / "docs.manifest.json").unlink()
    # uint16 files cannot hold its ids
    wide = SimpleNamespace(name="wide", vocab_size=100277, eod=100257, text_start=())
    with pytest.raises(DataError, match="data.tokenizer: .*docs.bin stores uint16 ids, too narrow"):
        check_training_data(config(tmp_path, f"data.prefix={tmp_path / 'docs'}", "model.vocab_size=100352"), wide)


def test_a_sequence_longer_than_a_split_can_supply(corpus, tmp_path):
    prefix, documents = corpus
    tokens = {name: sum(len(documents[d]) for d in split_range(len(documents), [80, 10, 10], i))
              for i, name in enumerate(("train", "valid", "test"))}
    smallest = min(tokens, key=tokens.get)

    def check(seq_length, split="80,10,10"):
        check_training_data(config(tmp_path, f"data.prefix={prefix}", f"model.seq_length={seq_length}",
                                   f"data.split={split}"), TOKENIZER)

    with pytest.raises(DataError, match=rf"model.seq_length: the {smallest} split of .*docs .* holds "
                                        rf"{tokens[smallest]} tokens, fewer than one sample of "
                                        rf"model.seq_length \+ 1 = {tokens[smallest] + 1}"):
        check(tokens[smallest])
    check(tokens[smallest] - 1)
    with pytest.raises(DataError, match="the train split"):
        check(sum(map(len, documents)), split="1,0,0")


def test_an_empty_prefix(tmp_path):
    write_documents(tmp_path / "empty", [])
    with pytest.raises(DataError, match=r"data.blend: .*empty holds no tokens \(0 documents\)"):
        check_training_data(config(tmp_path, f"data.blend=[{tmp_path / 'empty'}]"), TOKENIZER)


@pytest.mark.parametrize("blend,message", [
    ("[1,a,2]", "pairs or only prefixes"),
    ("[a,1]", "item 0 should be a weight and item 1 a prefix"),
    ("[0,a,1,b]", "weight 0.0 of a must be a positive number"),
    ("[-1,a,1,b]", "weight -1.0 of a must be a positive number"),
])
def test_malformed_blends_are_config_errors(blend, message):
    with pytest.raises(ConfigError, match=f"data.blend: .*{message}"):
        build_config({}, [f"data.blend={blend}"])


@pytest.mark.parametrize("overrides,key", [
    (["data.split=0,1,1"], "data.split"),
    (["data.split=90,5,5,1"], "data.split"),
    (["data.split=a,b"], "data.split"),
    (["data.bundled_corpus=kjv", "data.sources=[x.jsonl]"], "data.bundled_corpus"),
    (["data.length_upsampling_unit=64"], "data.length_upsampling_unit"),
])
def test_data_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        build_config({}, overrides)


# ---- blends without weights, index caches of data prepared again ---------------------------------

def test_a_blend_without_weights_is_weighted_by_tokens_and_has_the_samples_asked_for(tmp_path):
    # A (ids < 500) holds about three times B's tokens; megatron alone would stop the blend after one epoch of each
    write_documents(tmp_path / "a", synthetic_documents(150, seed=1, high=500))
    write_documents(tmp_path / "b", synthetic_documents(50, seed=2, low=500))
    tokens = {name: Path(f"{tmp_path / name}.bin").stat().st_size for name in ("a", "b")}
    cfg = config(tmp_path, f"data.blend=[{tmp_path / 'a'},{tmp_path / 'b'}]", "data.split=1,0,0")
    train = build_datasets(cfg, TOKENIZER, (2000, 0, 0), seed=0)[0]
    assert len(train) >= 2000
    from_a = [bool((train[i]["tokens"][train[i]["tokens"] != EOD] < 500).all()) for i in range(2000)]
    assert abs(np.mean(from_a) - tokens["a"] / sum(tokens.values())) < 0.03


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_the_token_count_from_the_header_is_the_index_s(tmp_path, dtype):
    """Blend weights count a prefix's tokens from its .bin size and the .idx header's token width:
    what reading the whole index (a length per document) would give."""
    with AtomicIndexedWriter(tmp_path / "docs", np.dtype(dtype)) as writer:
        for doc in synthetic_documents(40, seed=3):
            writer.add_documents(doc, np.array([len(doc)]))
        writer.commit()
    assert token_count(tmp_path / "docs") == read_index(tmp_path / "docs").tokens


@pytest.mark.parametrize("built", [5, 9])  # 9: one sample short
def test_a_split_built_shorter_than_asked_is_refused_before_training(corpus, tmp_path, monkeypatch, built):
    class ShortBuilder:
        def __init__(self, *args):
            pass

        def build(self):
            return [list(range(built)), None, None]

    monkeypatch.setattr("megadiff.data.datasets.BlendedMegatronDatasetBuilder", ShortBuilder)
    with pytest.raises(DataError, match=f"data.prefix: the train split was built with {built} samples, fewer than "
                                        "the 10 asked for"):
        build_datasets(config(tmp_path, f"data.prefix={corpus[0]}", "data.split=1,0,0"), TOKENIZER, (10, 0, 0), 0)


def test_data_prepared_again_gets_new_index_caches(tmp_path):
    cfg = config(tmp_path, f"data.prefix={tmp_path / 'docs'}", "data.split=1,0,0")
    write_documents(tmp_path / "docs", synthetic_documents(60, seed=1))
    build_datasets(cfg, TOKENIZER, (100, 0, 0), seed=0)
    documents = synthetic_documents(200, seed=7, max_len=200)  # the prefix prepared again from other sources
    write_documents(tmp_path / "docs", documents)
    train = build_datasets(cfg, TOKENIZER, (100, 0, 0), seed=0)[0]
    assert train.document_index.max() == len(documents) - 1
    stream = np.concatenate([documents[d] for d in train.document_index])
    for i in range(0, len(train), 37):
        k = int(train.shuffle_index[i])
        assert train[i]["tokens"].tolist() == stream[k * SEQ:(k + 1) * SEQ].tolist()


def test_preparing_one_prefix_of_a_blend_again_keeps_the_others_index_caches(tmp_path):
    """Each prefix's indices are named by its own files alone: another prefix prepared again leaves
    them (a 1T-token prefix's take minutes to build), and their descriptions name no other prefix."""
    prefixes = [tmp_path / name for name in ("big", "small")]
    write_documents(prefixes[0], synthetic_documents(80, seed=1))
    cfg = config(tmp_path, f"data.blend=[3,{prefixes[0]},1,{prefixes[1]}]", "data.split=1,0,0")

    def hashes(seed: int) -> list[str]:
        write_documents(prefixes[1], synthetic_documents(40, seed=seed))
        train = build_datasets(cfg, TOKENIZER, (300, 0, 0), seed=0)[0]
        assert str(prefixes[1]) not in train.datasets[0].unique_description
        return [dataset.unique_description_hash for dataset in train.datasets]

    (big, small), (big_again, small_again) = hashes(seed=2), hashes(seed=3)
    assert big_again == big
    assert small_again != small


def test_a_split_of_which_no_sample_is_asked_is_not_built(corpus, tmp_path):
    """eval_each_source asks for the validation samples of each prefix alone: megatron would also index
    a whole epoch of its training split (some 10 GB for a 1T-token prefix)."""
    cfg = config(tmp_path, f"data.prefix={corpus[0]}", "data.split=80,10,10")
    train, valid, test = build_datasets(cfg, TOKENIZER, (0, 10, 0), seed=0)
    assert train is None and test is None and len(valid) >= 10

    def built() -> list[str]:
        return sorted(path.name.split("-")[2] for path in (tmp_path / "cache" / "indices").glob("*shuffle_index.npy"))

    assert built() == ["valid"]
    # pre-training asks for both: the same validation indices serve it
    build_datasets(cfg, TOKENIZER, (20, 10, 0), seed=0)
    assert built() == ["train", "valid"]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_the_writer_writes_the_bytes_of_megatrons_builder(tmp_path, monkeypatch, dtype):
    """Batches with empty documents, then parts merged: what megatron's IndexedDatasetBuilder writes,
    byte for byte (the .idx arrays written in slices of 5 entries here)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr(indexed, "WRITE_CHUNK", 5)
    rng = np.random.default_rng(0)
    reference = IndexedDatasetBuilder(str(tmp_path / "reference.bin"), dtype=dtype)
    with AtomicIndexedWriter(tmp_path / "batches", np.dtype(dtype)) as writer:
        for _ in range(4):
            lengths = rng.integers(0, 9, 13)
            ids = rng.integers(0, 200, int(lengths.sum())).astype(dtype)
            writer.add_documents(ids, lengths)
            for document in np.split(ids, np.cumsum(lengths)[:-1]):
                if len(document):
                    reference.add_document(document, [len(document)])
        writer.commit()
    reference.finalize(str(tmp_path / "reference.idx"))
    merged_reference = IndexedDatasetBuilder(str(tmp_path / "merged_reference.bin"), dtype=dtype)
    with AtomicIndexedWriter(tmp_path / "merged", np.dtype(dtype)) as writer:
        for part in ("batches", "reference", "batches"):
            writer.add_prepared(tmp_path / part)
            merged_reference.add_index(str(tmp_path / part))
        writer.commit()
    merged_reference.finalize(str(tmp_path / "merged_reference.idx"))
    for ours, theirs in (("batches", "reference"), ("merged", "merged_reference")):
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"{ours}{ext}").read_bytes() == (tmp_path / f"{theirs}{ext}").read_bytes()
    assert read_index(tmp_path / "merged").tokens == token_count(tmp_path / "merged") > 0


def test_the_writer_offsets_pass_two_gigabytes(tmp_path):
    """A document of 600M int32 tokens ends 2.4 GB into the .bin: the next one's offset (int32 lengths
    times 4 would wrap). Only the index is read back, so the .bin need not hold them."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    with AtomicIndexedWriter(tmp_path / "long", np.dtype(np.int32)) as writer:
        writer.add_documents(np.zeros(4, dtype=np.int32), np.array([600_000_000, 10]))
        writer.commit()
    assert _IndexReader(str(tmp_path / "long.idx"), False).sequence_pointers.tolist() == [0, 2_400_000_000]


def test_the_writer_refuses_a_document_longer_than_the_index_holds(tmp_path):
    """2^31 tokens in one document (a .txt source of some 8 GB): refused by name, not wrapped into a
    negative length and offsets that read_index later blames on mismatched files."""
    with AtomicIndexedWriter(tmp_path / "huge", np.dtype(np.int32)) as writer:
        with pytest.raises(DataError, match=r"a document of 2,147,483,648 tokens; megatron's index holds at most "
                                            r"2,147,483,647"):
            writer.add_documents(np.zeros(4, dtype=np.int32), np.array([10, 2 ** 31]))


def many_short_documents(prefix: Path, count: int) -> None:
    """`count` documents of one to three tokens, written as one batch."""
    lengths = np.arange(count) % 3 + 1
    with AtomicIndexedWriter(prefix, np.dtype(np.uint16)) as writer:
        writer.add_documents(np.ones(int(lengths.sum()), np.uint16), lengths)
        writer.commit()


def test_merging_parts_holds_the_documents_lengths_only(tmp_path):
    """Merging the parts of a 1T-token corpus (~1.5 billion documents): 4 bytes per document (the
    lengths), not megatron's builder's Python lists (~125 bytes per document, ~190 GB there)."""
    count = 200_000
    many_short_documents(tmp_path / "part", count)
    tracemalloc.start()
    try:
        with AtomicIndexedWriter(tmp_path / "merged", np.dtype(np.uint16)) as writer:
            for _ in range(2):
                writer.add_prepared(tmp_path / "part")
            writer.commit()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # beside the lengths: the commit's temporaries, a few int64 arrays of WRITE_CHUNK entries, and a
    # copy buffer (megatron's builder: ~50 MB here)
    assert peak < 4 * 2 * count + 8 * 8 * indexed.WRITE_CHUNK + 2**20
    assert len(read_index(tmp_path / "merged").sequence_lengths) == 2 * count


def test_reading_an_index_copies_none_of_it(tmp_path):
    """Every rank checks the data before training: its index stays on disk (mapped), where a copy of
    its lengths would take 12 GB per rank for a 1T-token corpus."""
    count = 1_000_000
    many_short_documents(tmp_path / "docs", count)
    tracemalloc.start()
    try:
        summary = read_index(tmp_path / "docs")
        tokens, shortest = summary.tokens, int(summary.sequence_lengths.min())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (tokens, shortest) == (token_count(tmp_path / "docs"), 1)
    assert peak < count


def test_a_split_s_tokens_are_counted_without_a_copy_of_its_lengths(tmp_path):
    """What a run says at each start of the sources it reads again counts each split's tokens: megatron's count
    copies the split's lengths (8 GB for a 1T-token corpus) on rank 0 at every start."""
    count = 300_000
    many_short_documents(tmp_path / "docs", count)
    cfg = config(tmp_path, f"data.prefix={tmp_path / 'docs'}", "data.split=80,20,0")
    train = build_datasets(cfg, TOKENIZER, (100, 0, 0), seed=0)[0]
    lengths = np.arange(count) % 3 + 1  # many_short_documents' lengths
    tracemalloc.start()
    try:
        read_again = sources_read_again(train)
        tokens = train._get_num_tokens_per_epoch()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tokens == int(lengths[:round(0.8 * count)].sum())
    assert read_again == [] and len(train) == (tokens - 1) // SEQ  # one pass: samples of SEQ + 1 tokens
    assert peak < count


def test_a_built_dataset_holds_no_array_of_its_documents(tmp_path):
    """megatron's builder hands each split its documents as an array, 4 bytes a document, which every rank held for
    the whole run (8 GB for a 1T-token corpus) though megatron reads it only to build the cached indices."""
    count = 300_000
    many_short_documents(tmp_path / "docs", count)
    cfg = config(tmp_path, f"data.prefix={tmp_path / 'docs'}", "data.split=80,20,0")
    first = build_datasets(cfg, TOKENIZER, (100, 10, 0), seed=0)  # builds the index cache, as rank 0 does
    tracemalloc.start()
    try:
        train, valid, _ = build_datasets(cfg, TOKENIZER, (100, 10, 0), seed=0)  # a later start, or another rank
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < count
    for built, again, (begin, end) in zip(first, (train, valid), ((0, 240_000), (240_000, count))):
        assert list(again.indices) == list(built.indices) == list(range(begin, end))
        assert [again[i]["tokens"].tolist() for i in range(10)] == [built[i]["tokens"].tolist() for i in range(10)]


# ---- boundaries of the checks (each found unchecked by mutation testing) -------------------------

def _copy_corpus(corpus, directory: Path) -> Path:
    for ext in (".bin", ".idx"):
        shutil.copy(f"{corpus[0]}{ext}", directory / f"docs{ext}")
    return directory / "docs"


@pytest.mark.parametrize("manifest", [b"[]", b'"x"', b"\xff\xfe{}", b'{"fingerprint": [], "stats": {}}'],
                         ids=["a list", "a string", "not UTF-8", "a fingerprint that is a list"])
def test_a_manifest_prepare_data_never_wrote_reads_as_none(corpus, tmp_path, manifest):
    """Training data whose manifest is overwritten: the run trained on the samples it gets without one (as with
    a manifest cut short); it died with a TypeError, AttributeError or UnicodeDecodeError."""
    from megadiff.data.manifest import manifest_path

    def train_samples(prefix: Path, cache: str) -> list[list[int]]:
        cfg = config(tmp_path, f"data.prefix={prefix}", "data.split=9,1,0", f"data.cache_dir={tmp_path / cache}")
        train = build_datasets(cfg, TOKENIZER, (20, 10, 0), seed=0)[0]
        return [train[i]["tokens"].tolist() for i in range(20)]

    (tmp_path / "overwritten").mkdir()
    overwritten = _copy_corpus(corpus, tmp_path / "overwritten")
    manifest_path(overwritten).write_bytes(manifest)
    assert train_samples(overwritten, "a") == train_samples(corpus[0], "b")


def test_a_model_vocabulary_one_id_short_of_the_tokenizers_is_refused(corpus, tmp_path):
    """The tokenizer's highest id would index past the embedding."""
    with pytest.raises(DataError, match=r"model.vocab_size: 1000 is smaller .* \(1001 ids\)"):
        check_training_data(config(tmp_path, f"data.prefix={corpus[0]}", "model.vocab_size=1000",
                                   "data.split=80,10,10"), TOKENIZER)
    check_training_data(config(tmp_path, f"data.prefix={corpus[0]}", "model.vocab_size=1001", "data.split=80,10,10"),
                        TOKENIZER)


def test_data_prepared_with_a_tokenizer_of_the_same_size_and_another_eod_is_refused(corpus, tmp_path):
    """The same vocabulary size, another end-of-document id: documents would not end where the data says."""
    prefix = _copy_corpus(corpus, tmp_path)
    prepared_with = {"spec": "other", "vocab_size": TOKENIZER.vocab_size, "eod": EOD - 1}
    write_manifest(prefix, {"tokenizer": prepared_with}, {}, [prefix])
    with pytest.raises(DataError, match="data.tokenizer: .*docs was prepared with tokenizer 'other'"):
        check_training_data(config(tmp_path, f"data.prefix={prefix}", "data.split=80,10,10"), TOKENIZER)


def _prompt_response_data(corpus, directory: Path, mask_lengths: list[int], inner_eods: int) -> Path:
    """The corpus as prompt/response data: a loss mask of `mask_lengths` and a manifest counting `inner_eods`."""
    prefix = _copy_corpus(corpus, directory)
    write_documents(Path(f"{prefix}-loss-mask"), [np.ones(n, dtype=np.int64) for n in mask_lengths])
    tokenizer = {"spec": "synthetic", "vocab_size": TOKENIZER.vocab_size, "eod": EOD}
    fingerprint = {"tokenizer": tokenizer, "response_key": "response", "pair_encoding": "one text",
                   "without_prompt": "skipped", "first_token": "context"}  # as prepared now
    write_manifest(prefix, fingerprint, {"inner_eods": inner_eods}, [prefix])
    return prefix


def test_a_loss_mask_of_as_many_documents_of_other_lengths_is_refused(corpus, tmp_path):
    """A mask from another preparation, of as many documents: the loss would fall on other tokens."""
    lengths = [len(doc) for doc in corpus[1]]
    shifted = [lengths[-1], *lengths[:-1]]
    assert len(shifted) == len(lengths) and shifted != lengths
    prefix = _prompt_response_data(corpus, tmp_path, lengths, inner_eods=0)
    check_training_data(config(tmp_path, f"data.prefix={prefix}", "data.response_key=response", "data.split=80,10,10"),
                        TOKENIZER)
    _prompt_response_data(corpus, tmp_path, shifted, inner_eods=0)
    with pytest.raises(DataError, match="docs-loss-mask does not describe the documents"):
        check_training_data(config(tmp_path, f"data.prefix={prefix}", "data.response_key=response",
                                   "data.split=80,10,10"), TOKENIZER)


def test_the_data_check_reads_each_index_once(corpus, tmp_path, monkeypatch):
    """An index holds 4 bytes a document (GBs for a large corpus, on a shared filesystem, on every rank): the
    pre-flight check reads each prefix's and loss mask's .idx once for all it checks."""
    prefix = _prompt_response_data(corpus, tmp_path, [len(doc) for doc in corpus[1]], inner_eods=0)
    read = collections.Counter()
    for name in ("read_header", "sequence_lengths"):  # what read_index reads of an .idx
        original = getattr(indexed, name)
        monkeypatch.setattr(indexed, name, lambda path, *args, _name=name, _read=original: (
            read.update([(Path(path).name, _name)]), _read(path, *args))[1])
    check_training_data(config(tmp_path, f"data.prefix={prefix}", "data.response_key=response", "data.split=80,10,10"),
                        TOKENIZER)
    assert read == {(name, part): 1 for name in ("docs", "docs-loss-mask")
                    for part in ("read_header", "sequence_lengths")}


def test_a_later_start_reads_no_index_whole_and_data_changed_since_is_read_again(corpus, tmp_path, monkeypatch):
    """Every start read each prefix's and loss mask's whole .idx (8 GB each for a 1T-token corpus), where megatron's
    cached indices need none of it: once per prepared data, as long as its files stay as they were."""
    from megadiff.data import checks

    prefix = _prompt_response_data(corpus, tmp_path, [len(doc) for doc in corpus[1]], inner_eods=0)
    reads = collections.Counter()
    monkeypatch.setattr(checks, "read_index", lambda path, *args, _read=checks.read_index: (
        reads.update([Path(path).name]), _read(path, *args))[1])
    cfg = config(tmp_path, f"data.prefix={prefix}", "data.response_key=response", "data.split=80,10,10")
    starts = 3
    for _ in range(starts):
        check_training_data(cfg, TOKENIZER)
    assert reads == {"docs": 1, "docs-loss-mask": 1}
    train_tokens = sum(map(len, corpus[1][:160]))  # documents 0..160 of 200 (80%)
    with pytest.raises(DataError, match=rf"model.seq_length: the train split .* holds {train_tokens} tokens"):
        check_training_data(config(tmp_path, f"data.prefix={prefix}", "data.response_key=response",
                                   "data.split=80,10,10", f"model.seq_length={sum(map(len, corpus[1]))}"), TOKENIZER)
    lengths = sequence_lengths(prefix, 2)
    with open(f"{prefix}.idx", "r+b") as index:  # changed in place, its size kept: read again
        index.seek(INDEX_HEADER_BYTES)
        index.write(np.array([-1000, lengths[0] + lengths[1] + 1000], dtype=np.int32).tobytes())
    with pytest.raises(DataError, match=r"docs.idx is not a readable megatron index \(a negative document length"):
        check_training_data(cfg, TOKENIZER)
    assert reads["docs"] == 2


def test_document_masking_refuses_data_with_one_eod_inside_a_document(corpus, tmp_path):
    """Document masking cuts at every EOD: one inside a conversation already cuts it in two."""
    lengths = [len(doc) for doc in corpus[1]]
    overrides = ["data.response_key=response", "data.split=80,10,10", "data.document_masking=true"]
    prefix = _prompt_response_data(corpus, tmp_path, lengths, inner_eods=0)
    check_training_data(config(tmp_path, f"data.prefix={prefix}", *overrides), TOKENIZER)
    _prompt_response_data(corpus, tmp_path, lengths, inner_eods=1)
    with pytest.raises(DataError, match=rf"data.document_masking: .*docs holds the tokenizer's EOD \(id {EOD}\) 1 "
                                        "times inside its documents"):
        check_training_data(config(tmp_path, f"data.prefix={prefix}", *overrides), TOKENIZER)
    check_training_data(config(tmp_path, f"data.prefix={prefix}", *overrides[:2]), TOKENIZER)  # without masking


@pytest.mark.parametrize("count, split", [(7, "60,20,20"), (13, "80,10,10"), (11, "70,20,10")])
def test_the_checks_split_the_documents_as_megatrons_builder_does(tmp_path, count, split):
    """The checks (and evaluation's split_tokens) must look at the documents training reads: megatron rounds
    each split's bounds."""
    from megadiff.data.checks import split_documents

    documents = [np.append(np.full(40, i), EOD) for i in range(count)]
    write_documents(tmp_path / "docs", documents)
    built = build_datasets(config(tmp_path, f"data.prefix={tmp_path / 'docs'}", f"data.split={split}"), TOKENIZER,
                           (5, 5, 5), seed=0)
    ranges = split_documents(read_index(tmp_path / "docs"), split)
    for name, dataset in zip(("train", "valid", "test"), built):
        begin, end, tokens = ranges[name]
        assert (begin, end) == (int(dataset.indices[0]), int(dataset.indices[-1]) + 1), name
        assert tokens == 41 * (end - begin)


def test_split_tokens_reads_a_few_index_entries_not_every_documents_length(tmp_path, monkeypatch):
    """needles and recall read a split's tokens in place: the index was read whole to find the split's stretch of
    the .bin (4 bytes a document, 6 GB for a 1T-token corpus), where its first and last entries give it."""
    from megadiff.data.checks import split_tokens

    documents = synthetic_documents(3000, seed=4)
    write_documents(tmp_path / "docs", documents)
    read = []
    for name in ("sequence_lengths", "sequence_pointers"):
        monkeypatch.setattr(indexed, name, lambda prefix, count, _read=getattr(indexed, name): EntriesRead.of(
            _read(prefix, count), read))
    valid = split_range(len(documents), [80, 10, 10], 1)
    tokens = split_tokens(str(tmp_path / "docs"), "80,10,10", "valid")
    assert tokens.tolist() == np.concatenate(documents[valid.start:valid.stop]).tolist()
    # stretches of documents measured, each by a first and last offset and a length: the whole (open_index's check
    # of the .bin), each of the three splits, and the documents before the valid split
    assert sum(read) <= (1 + 3 + 1) * 3


def test_blend_prefixes_sharing_a_file_name_get_a_metric_name_each():
    from megadiff.data.datasets import source_names

    assert source_names(["a/x", "b/x", "c/x", "d/y"]) == ["x-0", "x-1", "x-2", "y"]
    assert source_names(["a/x", "b/x"]) == ["x-0", "x-1"]
    assert source_names(["a/x", "b/y"]) == ["x", "y"]


def test_an_index_cut_short_or_of_another_version_is_refused_by_name(corpus, tmp_path):
    """Megatron would fail later, deep in its reader, or read another format as its own."""
    prefix = _copy_corpus(corpus, tmp_path)
    whole = (tmp_path / "docs.idx").read_bytes()
    (tmp_path / "docs.idx").write_bytes(whole[:-8])
    with pytest.raises(DataError, match=r"docs.idx is not a readable megatron index \(\d+ bytes, fewer than"):
        read_index(prefix)
    header = bytearray(whole)
    header[indexed.INDEX_HEADER_BYTES - 25] = 2  # the version field, after the 9-byte magic
    (tmp_path / "docs.idx").write_bytes(bytes(header))
    with pytest.raises(DataError, match=r"docs.idx is not a readable megatron index \(bad header or version 2\)"):
        read_index(prefix)


def test_index_caches_follow_what_the_manifest_says_the_data_was_made_from(tmp_path):
    """Data prepared again from other sources into files of the very same sizes must not reuse the index caches
    built over the old data."""
    from megadiff.data.prepared_dataset import prepared_files_digest

    write_documents(tmp_path / "docs", synthetic_documents(20, seed=1))
    write_manifest(tmp_path / "docs", {"sources": ["a.jsonl"]}, {}, [tmp_path / "docs"])
    before = prepared_files_digest(str(tmp_path / "docs"))
    assert prepared_files_digest(str(tmp_path / "docs")) == before
    write_manifest(tmp_path / "docs", {"sources": ["b.jsonl"]}, {}, [tmp_path / "docs"])
    assert prepared_files_digest(str(tmp_path / "docs")) != before
