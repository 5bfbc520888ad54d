"""`megadiff evaluate`: held-out losses equal a naive cross entropy of the model's logits on the
same samples; the by-position summary equals a naive per-position computation; bad requests are
config errors."""
from __future__ import annotations

import json
import re
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megadiff.cli import main
from megadiff.config import ConfigError, ParallelConfig, build_config
from megadiff.data.datasets import build_datasets, source_config
from megadiff.data.errors import DataError
from megadiff.data.indexed import read_index
from megadiff.data.prepare import prepare
from megadiff.inference import load_checkpoint
from megadiff.inference import evaluate as evaluate_module
from megadiff.inference import recall
from megadiff.inference.evaluate import distinct_samples, evaluate, summarize
from megadiff.inference.recall import recall_hits, sample_windows, training_bigram_rates
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer
from tests.held_out_runs import held_out_run, write_documents


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A DIFF checkpoint whose config names prepared KJV data, and a second prepared source for blends."""
    root = tmp_path_factory.mktemp("evaluate")
    output_dir, cfg = held_out_run(root, "diff", iteration=3)
    write_documents(root / "later.jsonl", first_verse=5000)
    prepare(build_config(cfg.model_dump(mode="json"), [f"data.sources=[{root / 'later.jsonl'}]",
                                                       f"data.prefix={root / 'prepared' / 'later'}"]).data)
    return output_dir, cfg


def naive_hits(tokens: list[int], labels: list[int], eod: int | None = None, bos: int | None = None) -> list[bool]:
    """Position i is an AR hit when an earlier position j of its document had the same (token,
    next token) pair, the next token not a document's `bos`; a document ends after an `eod` token."""
    def same_document(j: int, i: int) -> bool:
        return eod is None or eod not in tokens[j:i]
    return [labels[i] != bos and any((tokens[j], labels[j]) == (tokens[i], labels[i]) and same_document(j, i)
                                     for j in range(i)) for i in range(len(tokens))]


def _naive_losses(run_dir: Path, cfg, seq_length: int, sequences: int, prefix: Path | None = None,
                  samples: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of the logits, per token, on the first samples of the valid split (of `prefix`),
    and which positions are AR hits; with `samples`, each sample is appended to it."""
    model = load_checkpoint(run_dir)
    cfg = build_config(cfg.model_dump(mode="json"), [f"model.seq_length={seq_length}"] +
                       ([f"data.prefix={prefix}"] if prefix else []))
    valid = build_datasets(cfg, model.tokenizer, (0, sequences, 0), seed=cfg.train.seed)[1]
    rows, hits = [], []
    with torch.no_grad():
        for i in range(sequences):
            tokens, labels = (torch.from_numpy(np.asarray(valid[i][key])).long()[None] for key in ("tokens", "labels"))
            logits = model(tokens).float()
            rows.append(F.cross_entropy(logits[0], labels[0], reduction="none"))
            hits.append(naive_hits(tokens[0].tolist(), labels[0].tolist()))
            if samples is not None:
                samples.append(valid[i])
    return torch.stack(rows), torch.tensor(hits)


def _assert_scores_only(report: dict, naive: torch.Tensor, hits: torch.Tensor, scored: torch.Tensor) -> None:
    """The report's losses are the naive ones at the `scored` positions only, by position too."""
    assert 0 < scored.sum() < scored.numel()
    assert report["tokens"] == int(scored.sum())
    assert report["loss"] == pytest.approx(naive[scored].mean().item(), rel=1e-5)
    for name, mask in (("ar_hit", hits & scored), ("others", ~hits & scored)):
        assert report["recall"][name]["tokens"] == int(mask.sum())
    for row in report["by_position"]:
        lo, hi = row["positions"]
        in_bucket, so_far = scored[:, lo:hi], scored[:, :hi]
        if in_bucket.any():
            assert row["mean_loss"] == pytest.approx(naive[:, lo:hi][in_bucket].mean().item(), rel=1e-5)
        else:  # a bucket of prompts only
            assert math.isnan(row["mean_loss"])
        if so_far.any():
            assert row["cumulative_loss"] == pytest.approx(naive[:, :hi][so_far].mean().item(), rel=1e-5)


def test_eod_mask_loss_leaves_the_eod_inputs_unscored(run, tmp_path):
    run_dir, cfg = run
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "5", "--buckets", "4", "--output", str(out),
                 "data.eod_mask_loss=true"]) == 0
    samples: list[dict] = []
    naive, hits = _naive_losses(run_dir, cfg, cfg.model.seq_length, 5, samples=samples)
    eod = load_checkpoint(run_dir).tokenizer.eod
    scored = torch.tensor(np.stack([np.asarray(sample["tokens"]) != eod for sample in samples]))
    _assert_scores_only(json.loads(out.read_text()), naive, hits, scored)


def test_prompt_response_data_score_the_responses_only(run, tmp_path):
    """On supervised fine-tuning data the loss is the responses' (as the run's own validation loss),
    not the prompts' too."""
    run_dir, cfg = run
    verses = kjv_verses()[:400]
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"question": " ".join(verses[i:i + 3]), "answer": verses[i + 3]}) + "\n"
                               for i in range(0, 400, 4)))
    data = [f"data.sources=[{records}]", f"data.prefix={tmp_path / 'sft'}", "data.text_key=question",
            "data.response_key=answer"]
    prepare(build_config(cfg.model_dump(mode="json"), data).data)
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "4", "--buckets", "4", "--output", str(out),
                 *data]) == 0
    samples: list[dict] = []
    sft_cfg = build_config(cfg.model_dump(mode="json"), data)
    naive, hits = _naive_losses(run_dir, sft_cfg, cfg.model.seq_length, 4, samples=samples)
    # which labels are a response's is test_sft_data's to check; here: only those are scored
    scored = torch.tensor(np.stack([np.asarray(sample["loss_mask"]) == 1 for sample in samples]))
    _assert_scores_only(json.loads(out.read_text()), naive, hits, scored)


def test_samples_without_a_scored_token_are_refused():
    losses = torch.rand(2, 8)
    with pytest.raises(DataError, match="no token the loss is taken on"):
        summarize(losses, buckets=2, scored=torch.zeros(2, 8, dtype=torch.bool))


@pytest.mark.parametrize("seq_length", [None, 96])  # the run's 32, and three times longer (RoPE extrapolation)
def test_cli_report_equals_naive_cross_entropy(run, tmp_path, seq_length):
    run_dir, cfg = run
    out = tmp_path / "report.json"
    length = ["--seq-length", str(seq_length)] if seq_length else []
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "5", "--batch-size", "2", "--buckets", "4",
                 "--output", str(out), *length]) == 0
    report = json.loads(out.read_text())
    naive, hits = _naive_losses(run_dir, cfg, seq_length or cfg.model.seq_length, 5)
    # the DIFF paper's table 6 split: tokens completing a bigram seen before, and the others
    assert 0 < hits.sum() < hits.numel()
    for name, mask in (("ar_hit", hits), ("others", ~hits)):
        assert report["recall"][name]["tokens"] == int(mask.sum())
        assert report["recall"][name]["loss"] == pytest.approx(naive[mask].mean().item(), rel=1e-5)
    assert (report["sequences"], report["seq_length"], report["tokens"]) == (5, naive.shape[1], naive.numel())
    assert report["loss"] == pytest.approx(naive.mean().item(), rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(naive.mean().item()), rel=1e-5)
    for row in report["by_position"]:
        lo, hi = row["positions"]
        assert row["mean_loss"] == pytest.approx(naive[:, lo:hi].mean().item(), rel=1e-5)


def test_a_length_upsampled_runs_held_out_documents_are_each_evaluated_once(tmp_path):
    """The 64K extension's data.length_upsampling repeats long documents in every split: evaluate reads the
    held-out split as a run without it cuts it, every sample its own text (the upsampled split's first samples
    held some documents twice, others never)."""
    run_dir, cfg = held_out_run(tmp_path, "diff", overrides=("data.length_upsampling=true",))
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "1000", "--output", str(out)]) == 0
    once = cfg.model_copy(update={"data": cfg.data.model_copy(update={"length_upsampling": False})})
    sequences = min(1000, distinct_samples(source_config(once, once.data.prefix), "valid"))
    naive, _ = _naive_losses(run_dir, once, cfg.model.seq_length, sequences)
    report = json.loads(out.read_text())
    assert report["tokens"] == naive.numel() == sequences * cfg.model.seq_length
    assert report["loss"] == pytest.approx(naive.mean().item(), rel=1e-5)


def test_a_context_parallel_runs_checkpoint_is_evaluated_at_any_length(tmp_path):
    """A 64K run's checkpoint (parallel.context: 8 in its config) is evaluated in one process: a --seq-length
    its context-parallel chunks could not split is no reason to refuse it."""
    run_dir, cfg = held_out_run(tmp_path, "diff", overrides=("parallel.context=2",))
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "2", "--seq-length", "34",
                 "--output", str(out)]) == 0
    naive, _ = _naive_losses(run_dir, cfg.model_copy(update={"parallel": ParallelConfig()}), 34, 2)
    report = json.loads(out.read_text())
    assert report["tokens"] == naive.numel() == 2 * 34
    assert report["loss"] == pytest.approx(naive.mean().item(), rel=1e-5)


@pytest.mark.parametrize("weights", [[0.25, 0.75], None])
def test_a_blend_reports_each_source_and_their_weighted_mean(run, tmp_path, weights):
    """Each source as if evaluated alone; overall, position by position, the weighted mean (without
    weights, by the sources' tokens, as training blends them then)."""
    run_dir, cfg = run
    prefixes = [Path(cfg.data.prefix), Path(cfg.data.prefix).with_name("later")]
    blend = [str(p) for p in prefixes] if weights is None else \
        [str(item) for pair in zip(weights, prefixes) for item in pair]
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "3", "--buckets", "2", "--output", str(out),
                 f"data.blend=[{','.join(blend)}]"]) == 0
    report = json.loads(out.read_text())
    naive_and_hits = [_naive_losses(run_dir, cfg, cfg.model.seq_length, 3, prefix) for prefix in prefixes]
    naive = [losses for losses, _ in naive_and_hits]
    tokens = [read_index(str(prefix)).tokens for prefix in prefixes]
    shares = [0.25, 0.75] if weights else [count / sum(tokens) for count in tokens]
    assert len(set(shares)) == 2  # the sources differ in size: a mean by sequences would not pass
    assert report["recall"]["ar_hit"]["loss"] == pytest.approx(
        sum(s * losses[hits].mean().item() for s, (losses, hits) in zip(shares, naive_and_hits)), rel=1e-5)
    for source, prefix, losses, share in zip(report["sources"], prefixes, naive, shares):
        assert source["prefix"] == str(prefix) and source["sequences"] == 3
        assert source["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert report["loss"] == pytest.approx(sum(s * losses.mean().item() for s, losses in zip(shares, naive)), rel=1e-5)
    lo, hi = report["by_position"][1]["positions"]
    assert report["by_position"][1]["mean_loss"] == pytest.approx(
        sum(s * losses[:, lo:hi].mean().item() for s, losses in zip(shares, naive)), rel=1e-5)
    assert report["sequences"] == 6


def test_a_blend_source_of_another_tokenizer_is_refused_before_any_source_is_evaluated(run, tmp_path, monkeypatch):
    """A blend's later source prepared with another tokenizer is refused as training refuses it, and before the
    earlier source is evaluated (hours at 64K), not when its own turn comes."""
    run_dir, cfg = run
    other = build_tokenizer(tmp_path / "other-tokenizer", sentencepiece_like=True)
    other_prefix = tmp_path / "prepared" / "other"
    prepare(build_config(cfg.model_dump(mode="json"), [f"data.sources=[{run_dir.parent / 'later.jsonl'}]",
                                                       f"data.prefix={other_prefix}", f"data.tokenizer={other}"]).data)
    blend = f"data.blend=[{cfg.data.prefix},{other_prefix}]"
    with pytest.raises(DataError, match="prepared with tokenizer") as training_refusal:
        build_datasets(build_config(cfg.model_dump(mode="json"), [blend]), load_checkpoint(run_dir).tokenizer,
                       (1, 1, 0), seed=cfg.train.seed)

    def evaluated(*args, **kwargs):
        raise AssertionError("a source was evaluated before the blend's data was checked")

    monkeypatch.setattr(evaluate_module, "position_losses", evaluated)
    with pytest.raises(DataError) as refusal:
        evaluate(str(run_dir), sequences=2, overrides=[blend])
    assert str(refusal.value) == str(training_refusal.value)


def test_a_blend_weighs_the_sources_that_have_tokens_in_a_slice():
    """A source without AR hits (short windows, few repeats) leaves the blend's AR-hit loss to the others."""
    with_hits = {"ar_hit": {"loss": 2.0, "tokens": 8}, "others": {"loss": 5.0, "tokens": 40}}
    without = {"ar_hit": {"loss": float("nan"), "tokens": 0}, "others": {"loss": 3.0, "tokens": 48}}
    blended = recall.blend_recall([without, with_hits], [1.0, 3.0])
    assert blended["ar_hit"] == {"loss": 2.0, "tokens": 8}
    assert blended["others"] == {"loss": pytest.approx((3.0 + 3 * 5.0) / 4), "tokens": 88}
    nothing = recall.blend_recall([without, without], [1.0, 1.0])["ar_hit"]
    assert math.isnan(nothing["loss"]) and nothing["tokens"] == 0


def test_recall_hits_stay_within_documents():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4, (3, 41), generator=generator)  # few ids: many repeated bigrams; 0 = EOD
    dataset = [{"tokens": row[:-1].numpy(), "labels": row[1:].numpy()} for row in tokens]
    for eod in (None, 0):
        for bos in (None, 1):  # with a tokenizer that begins each document with id 1
            hits = recall_hits(dataset, 3, eod, text_start=() if bos is None else (bos,))
            for row, sample in zip(hits, dataset):
                assert row.tolist() == naive_hits(sample["tokens"].tolist(), sample["labels"].tolist(), eod, bos)
    assert not torch.equal(recall_hits(dataset, 3, 0), recall_hits(dataset, 3, None))
    assert not torch.equal(recall_hits(dataset, 3, None, text_start=(1,)), recall_hits(dataset, 3, None))


def test_summary_by_position_against_loops():
    losses = torch.rand(3, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    report = summarize(losses, buckets=3)
    rows = report["by_position"]
    assert rows[0]["positions"][0] == 0 and rows[-1]["positions"][1] == 10 and len(rows) == 3
    assert all(a["positions"][1] == b["positions"][0] for a, b in zip(rows, rows[1:]))
    for row in rows:
        lo, hi = row["positions"]
        in_bucket = [losses[s, p].item() for s in range(3) for p in range(lo, hi)]
        so_far = [losses[s, p].item() for s in range(3) for p in range(hi)]
        assert row["mean_loss"] == pytest.approx(sum(in_bucket) / len(in_bucket))
        assert row["cumulative_loss"] == pytest.approx(sum(so_far) / len(so_far))
    assert report["loss"] == pytest.approx(losses.mean().item())
    assert len(summarize(losses, buckets=50)["by_position"]) == 10  # never more buckets than positions


def test_bad_requests_are_config_errors(run, capsys):
    run_dir, _ = run
    assert main(["evaluate", "--load", str(run_dir), "model.hidden_size=128"]) == 2
    assert "data.* overrides only" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="gives the test split no documents"):
        evaluate(str(run_dir), split="test", sequences=2)
    with pytest.raises(ConfigError, match="--frequent-bigrams must be > 0"):
        evaluate(str(run_dir), frequent_bigrams=0.0)
    with pytest.raises(ConfigError, match="--bigram-sample-tokens must be >= 1"):
        evaluate(str(run_dir), frequent_bigrams=1.0, bigram_sample_tokens=0)


def test_more_sequences_than_the_split_holds_evaluates_each_once(run):
    from megadiff.inference.evaluate import evaluation_config, held_out_dataset
    from rich.console import Console

    run_dir, cfg = run
    model = load_checkpoint(run_dir)
    long_cfg = evaluation_config(model.cfg, 256, [])
    asked = 10_000
    dataset = held_out_dataset(long_cfg, model.tokenizer, "valid", asked, Console(quiet=True))
    split_tokens = int(dataset.dataset.sequence_lengths[dataset.indices].sum())
    assert len(dataset) == (split_tokens - 1) // 256 < asked
    rows = {tuple(np.asarray(dataset[i]["tokens"]).tolist()) for i in range(len(dataset))}
    assert len(rows) == len(dataset)  # no sample twice
    repeated = build_datasets(long_cfg, model.tokenizer, (0, asked, 0), seed=long_cfg.train.seed)[1]
    first = [tuple(np.asarray(repeated[i]["tokens"]).tolist()) for i in range(len(dataset))]
    assert len(set(first)) < len(first)  # what megatron gives when asked for more: repeats among them


def test_a_split_of_whole_samples_counts_the_samples_it_can_label(monkeypatch):
    """A sample reads seq_length + 1 tokens (its last label is the next sample's first token): a split of exactly
    k x seq_length tokens gives k - 1 distinct samples, one token more gives k. Counting one too many, evaluate
    asked megatron for a sample the split lacks, which it fills from a second, shuffled epoch: a repeat."""
    from megadiff.data.indexed import IndexSummary
    from megadiff.inference import evaluate as module

    seq, k = 32, 3
    cfg = build_config({}, ["data.prefix=/nowhere/docs", "data.split=50,50,0", f"model.seq_length={seq}"])
    for valid_lengths, samples in (([40, k * seq - 40], k - 1), ([40, k * seq - 39], k)):
        lengths = np.array([25, 35] + valid_lengths)  # 4 documents: the last two are the valid split's
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 4  # int32 tokens, one document after another
        monkeypatch.setattr(module, "open_index", lambda prefix, lengths=lengths, offsets=offsets: IndexSummary(
            np.dtype(np.int32), lengths, offsets))
        assert module.distinct_samples(cfg, "valid") == samples
    assert module.distinct_samples(cfg, "test") is None


def test_a_blend_weighs_its_sources_by_their_weights_not_their_token_counts():
    """Weights 0.9 and 0.1 over sources of 2 and 6 samples at different loss levels: the blended loss, position
    by position too, is 0.9 x the first source's mean + 0.1 x the second's, whatever their sizes."""
    from megadiff.inference.evaluate import blend_summary

    generator = torch.Generator().manual_seed(0)
    first = torch.rand(2, 8, generator=generator, dtype=torch.float64) + 1.0
    second = torch.rand(6, 8, generator=generator, dtype=torch.float64) + 4.0
    report = blend_summary([(first, None, 0.9), (second, None, 0.1)], buckets=2)
    assert report["loss"] == pytest.approx(0.9 * first.mean().item() + 0.1 * second.mean().item())
    for row in report["by_position"]:
        lo, hi = row["positions"]
        assert row["mean_loss"] == pytest.approx(0.9 * first[:, lo:hi].mean().item() +
                                                 0.1 * second[:, lo:hi].mean().item())
    assert (report["sequences"], report["tokens"]) == (8, first.numel() + second.numel())


def test_the_test_split_is_evaluated_on_its_own_samples(run):
    """--split test scores the test split's documents, as megatron cuts them for the run, not the valid split's."""
    from rich.console import Console

    from megadiff.inference.evaluate import evaluation_config, held_out_dataset

    run_dir, _ = run
    model = load_checkpoint(run_dir)
    cfg = evaluation_config(model.cfg, None, ["data.split=60,20,20"])
    dataset = held_out_dataset(cfg, model.tokenizer, "test", 3, Console(quiet=True))
    splits = build_datasets(cfg, model.tokenizer, (0, 3, 3), seed=cfg.train.seed)
    rows = [[np.asarray(split[i]["tokens"]).tolist() for i in range(3)] for split in (dataset, splits[2], splits[1])]
    assert rows[0] == rows[1] != rows[2]


def training_tokens(cfg) -> np.ndarray:
    """The training split's tokens, read document by document through megatron's IndexedDataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megadiff.data.checks import split_documents
    from megadiff.data.indexed import read_index

    documents = IndexedDataset(cfg.data.prefix)
    first, last, _ = split_documents(read_index(cfg.data.prefix), cfg.data.split)["train"]
    return np.concatenate([documents[i] for i in range(first, last)]).astype(np.int64)


def naive_rates(tokens: np.ndarray, bigrams: list[tuple[int, int]]) -> np.ndarray:
    counts = Counter(zip(tokens[:-1].tolist(), tokens[1:].tolist()))
    return np.array([counts[bigram] * 1e6 / (len(tokens) - 1) for bigram in bigrams])


@pytest.mark.parametrize("chunk", [1 << 24, 1000])  # one piece, and pieces whose edges split bigrams
def test_training_bigram_rates_count_the_training_split(run, monkeypatch, chunk):
    _, cfg = run
    monkeypatch.setattr(recall, "COUNT_CHUNK_TOKENS", chunk)
    tokens = training_tokens(cfg)
    common = Counter(zip(tokens[:-1].tolist(), tokens[1:].tolist())).most_common(20)
    bigrams = [bigram for bigram, _ in common[::4]] + [(int(tokens.max()) + 1, 0)]  # the last never occurs
    keys = recall.bigram_keys(*(np.array(side) for side in zip(*bigrams)))
    rates = training_bigram_rates(cfg.data.prefix, cfg.data.split, keys, sample_tokens=10 ** 9)
    np.testing.assert_allclose(rates, naive_rates(tokens, bigrams), rtol=1e-12)
    assert rates[-1] == 0 and rates[0] > rates[1] > 0


def test_sampled_windows_spread_over_the_split():
    assert sample_windows(10, 50, 40) == sample_windows(10, 50, 100) == [(10, 50)]
    for begin, end, sample, windows in ((0, 10_000, 1_000, 64), (7, 1_007, 999, 8), (0, 100, 3, 64)):
        ranges = sample_windows(begin, end, sample, windows)
        assert sum(stop - start for start, stop in ranges) == sample
        assert ranges[0][0] == begin and 0 <= end - ranges[-1][1] < len(ranges)
        assert all(start < stop <= following for (start, stop), (following, _) in zip(ranges, ranges[1:]))


def test_frequent_training_bigrams_are_not_ar_hits(run, tmp_path):
    """Zoology's filter: the CLI's AR hits are the naive hits whose bigram is rarer in the training
    split than the threshold; the others take the rest."""
    run_dir, cfg = run
    naive, hits = _naive_losses(run_dir, cfg, cfg.model.seq_length, 5)
    model = load_checkpoint(run_dir)
    valid = build_datasets(cfg, model.tokenizer, (0, 5, 0), seed=cfg.train.seed)[1]
    bigrams = [(int(t), int(n)) for i in range(5) for t, n in zip(valid[i]["tokens"], valid[i]["labels"])]
    rates = naive_rates(training_tokens(cfg), bigrams).reshape(hits.shape)
    threshold = float(np.median(rates[hits.numpy() & (rates > 0)]))
    rare = hits & torch.from_numpy(rates < threshold)
    assert 0 < rare.sum() < hits.sum()

    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "5", "--output", str(out),
                 "--frequent-bigrams", str(threshold)]) == 0
    report = json.loads(out.read_text())
    assert report["frequent_bigrams"] == {"per_million": threshold, "sample_tokens": recall.DEFAULT_SAMPLE_TOKENS}
    for name, mask in (("ar_hit", rare), ("others", ~rare)):
        assert report["recall"][name]["tokens"] == int(mask.sum())
        assert report["recall"][name]["loss"] == pytest.approx(naive[mask].mean().item(), rel=1e-5)


def test_an_exported_model_reports_the_checkpoints_losses(run, tmp_path, capsys):
    """--hf on the run's DiffLlama export (transformers' own forward and cross entropy), its held-out text
    the run's with no data.* override (the export carries the run's data settings), at three times the
    run's length: the checkpoint's report."""
    run_dir, cfg = run
    assert main(["convert", "to-hf", "--load", str(run_dir), "--save", str(tmp_path / "hf")]) == 0
    options = ["--sequences", "5", "--batch-size", "2", "--buckets", "4", "--seq-length", "96"]
    assert main(["evaluate", "--load", str(run_dir), *options, "--output", str(tmp_path / "run.json")]) == 0
    data = [f"data.{key}={getattr(cfg.data, key)}" for key in ("prefix", "split", "cache_dir")]
    assert main(["evaluate", "--hf", str(tmp_path / "hf"), "--dtype", "fp32", *options,
                 "--output", str(tmp_path / "hf.json")]) == 0
    ours, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("run", "hf"))
    assert theirs["checkpoint"] == str(tmp_path / "hf") and theirs["tokens"] == ours["tokens"]
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5)
    for name in ("ar_hit", "others"):
        assert theirs["recall"][name] == pytest.approx(ours["recall"][name], rel=1e-5)
    for mine, exported in zip(ours["by_position"], theirs["by_position"], strict=True):
        assert exported["mean_loss"] == pytest.approx(mine["mean_loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["evaluate", "--hf", str(tmp_path / "hf"), *options, *data, "data.document_masking=true"]) == 2
    assert "attends across documents" in capsys.readouterr().err


def test_hf_losses_and_logits_are_the_models_own_after_its_head(tmp_path, monkeypatch):
    """Granite divides its logits by logits_scaling after the head: --hf's chunked losses (three chunks
    of 4 positions here) and chosen logits are those of the model's forward."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from megadiff.inference import hf_model
    from megadiff.inference.hf_model import HFCausalLM
    from tests.convert_worker import build_tokenizer

    monkeypatch.setattr(hf_model, "LOSS_CHUNK_TOKENS", 8)  # 4 positions of the 2 rows

    torch.manual_seed(0)
    hf = GraniteForCausalLM(GraniteConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                          logits_scaling=8.0)).eval()
    model = HFCausalLM(hf, build_tokenizer(tmp_path), 32)
    assert_measures_as_its_own_forward(model, hf)


def assert_measures_as_its_own_forward(model, hf) -> None:
    """HFCausalLM `model`'s losses and logits of random ids are those of transformers' `hf` forward."""
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    with torch.no_grad():
        logits = hf(ids).logits
    torch.testing.assert_close(model(ids, labels), F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))
    torch.testing.assert_close(model.logits_at(ids, [0, 5, 11]), logits[:, [0, 5, 11]])


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen3Moe"])
def test_hf_measures_a_mixture_of_experts_as_its_own_forward_does(tmp_path, arch):
    """Mixtral's and Qwen-MoE's forward reads its decoder's router logits: --hf refused every mixture of experts
    as "not a Llama-like decoder", though its losses and logits are those of its decoder's states and head."""
    import transformers

    from megadiff.inference.hf_model import load_hf_model

    config_cls, model_cls = getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForCausalLM")
    torch.manual_seed(0)
    hf = model_cls(config_cls(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              max_position_embeddings=32, num_local_experts=4, num_experts=4,
                              num_experts_per_tok=2)).eval()
    hf.save_pretrained(build_tokenizer(tmp_path))
    model = load_hf_model(tmp_path)
    assert_measures_as_its_own_forward(model, hf)


def test_hf_refuses_a_model_saved_without_its_head(tmp_path):
    """A LlamaModel's directory (the decoder saved without lm_head) loads in transformers as a causal LM whose head
    it draws at random, with a note in its load report: --hf measured that head and reported its numbers as the
    model's. The causal LM's own directory loads, its logits those of transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megadiff.inference.hf_model import load_hf_model
    from tests.convert_worker import build_tokenizer

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    llama.model.save_pretrained(build_tokenizer(tmp_path / "bare"))
    with pytest.raises(ConfigError, match=f"--hf {tmp_path / 'bare'} lacks lm_head.weight, which transformers"):
        load_hf_model(tmp_path / "bare", "fp32")
    llama.save_pretrained(build_tokenizer(tmp_path / "whole"))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(tmp_path / "whole", "fp32").logits_at(ids, [0, 11]),
                                   llama(ids).logits[:, [0, 11]])


def test_a_report_cut_short_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """--output written in place: a kill (here a full disk at the sync) left a truncated JSON, and the
    last good report lost with it."""
    from megadiff.console import plain_console
    from megadiff.inference.reporting import write_report

    report = tmp_path / "reports" / "eval.json"
    write_report(plain_console(), {"loss": 1.5}, str(report))

    def full_disk(_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("os.fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_report(plain_console(), {"loss": 2.5, "by_position": list(range(1000))}, str(report))
    assert json.loads(report.read_text()) == {"loss": 1.5}
    assert [path.name for path in report.parent.iterdir()] == [report.name]  # no temporary file left


def test_hf_losses_keep_fp32_precision_over_a_large_vocabulary(tmp_path):
    """cl100k's 100K ids: each loss within 5e-6 of the float64 one (summed over a [B, V, n] layout, torch's
    fp32 was 2e-5 off)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megadiff.inference.hf_model import HFCausalLM
    from tests.convert_worker import build_tokenizer

    torch.manual_seed(0)
    vocab = 100352
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=64)).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 1.0)  # logits of std 4 (unit-RMS states of width 16), as a trained model's
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    with torch.no_grad():
        exact = F.cross_entropy(hf(ids).logits.double().flatten(0, 1), labels.flatten(), reduction="none")
    losses = HFCausalLM(hf, build_tokenizer(tmp_path), 64)(ids, labels)
    torch.testing.assert_close(losses.double().flatten(), exact, rtol=5e-6, atol=0)


def test_hf_directories_transformers_cannot_load_are_named(tmp_path, capsys):
    """An architecture transformers does not know, custom code or weights a directory lacks, a window below
    1: a config error naming it, not transformers' traceback pointing at the hub."""
    from megadiff.cli import main
    from tests.convert_worker import build_tokenizer

    directories = {"unknown": {"model_type": "nonesuch"},
                   "codeless": {"model_type": "x", "auto_map": {"AutoConfig": "configuration_x.XConfig"}},
                   "weightless": {"model_type": "llama", "vocab_size": 300, "hidden_size": 8,
                                  "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}}
    for name, config in directories.items():
        build_tokenizer(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert main(["outliers", "--hf", str(tmp_path / name), "--sequences", "1", "data.bundled_corpus=kjv"]) == 2
        assert f"--hf {tmp_path / name} cannot be loaded: " in capsys.readouterr().err
    assert main(["outliers", "--hf", str(tmp_path / "weightless"), "--window", "0"]) == 2
    assert "--window must be at least 1, got 0" in capsys.readouterr().err


def test_an_hf_model_without_held_out_data_is_refused_before_its_weights_load(tmp_path, capsys, monkeypatch):
    """A Hugging Face model (no megadiff sidecar naming its data) and no data.* overrides: said before the
    weights are read, not after."""
    from megadiff.cli import main
    from megadiff.inference import hf_model
    from tests.test_convert_llama import stock_llama

    stock_llama(tmp_path / "llama", tied=False)
    monkeypatch.setattr(hf_model, "load_hf_model", lambda *args, **kwargs: pytest.fail("the weights were read"))
    assert main(["evaluate", "--hf", str(tmp_path / "llama"), "--sequences", "1", "data.bundled_corpus=null"]) == 2
    assert "data.prefix: not set" in capsys.readouterr().err


def test_hf_models_cut_short_or_of_another_layout_are_refused(tmp_path, capsys):
    """Weights cut short by a download, and a causal LM that is not a Llama-like decoder (GPT-2's forward reads
    its decoder's cross-attentions): a config error naming the directory, not a traceback from inside
    safetensors or the model's forward."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megadiff.cli import main
    from tests.convert_worker import build_tokenizer
    from tests.test_convert_llama import stock_llama

    stock_llama(tmp_path / "cut", tied=False)
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    build_tokenizer(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    for name, said in (("cut", "cannot be loaded: .* \\(a weights file cut short by a download or copy\\?\\)"),
                       ("gpt2", "a GPT2LMHeadModel, whose forward does not run as a Llama-like decoder's")):
        assert main(["outliers", "--hf", str(tmp_path / name), "--sequences", "1", "data.bundled_corpus=kjv"]) == 2
        assert re.search(f"--hf {tmp_path / name}:? {said}", capsys.readouterr().err), name


def test_hf_reads_the_tokenizer_of_a_directory_with_custom_code_without_asking(tmp_path, monkeypatch):
    """A Dex/DAA export's config names its own code, which `--hf` runs: reading its tokenizer without saying
    so, transformers asked on the terminal whether to run it (and waited 15 s for an answer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megadiff.inference.hf_model import HFCausalLM
    from tests.convert_worker import build_tokenizer

    build_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "custom_llama", "auto_map": {
        "AutoConfig": "modeling_megadiff_adapted.AdaptedLlamaConfig",
        "AutoModelForCausalLM": "modeling_megadiff_adapted.AdaptedLlamaForCausalLM"}}))
    monkeypatch.setattr("builtins.input", lambda *args: pytest.fail("transformers asked to run the custom code"))
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32))
    assert HFCausalLM(hf, tmp_path, 32).tokenizer.vocab_size == 300


def test_hf_code_megadiff_did_not_ship_runs_only_when_trusted(tmp_path, capsys):
    """A downloaded model whose config names code of its own: --hf ran it as it loaded (transformers asks
    first); it is refused unread, naming it, and runs with --trust-remote-code."""
    from megadiff.cli import main
    from tests.test_convert_llama import stock_llama

    stock_llama(tmp_path / "llama", tied=False)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig"}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "ran"
    (tmp_path / "llama" / "planted.py").write_text(
        f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
        "from transformers import LlamaConfig\n\nclass PlantedConfig(LlamaConfig):\n    pass\n")
    options = ["outliers", "--hf", str(tmp_path / "llama"), "--sequences", "1", "--window", "16"]
    assert main(options) == 2
    assert (f"--hf {tmp_path / 'llama'} holds code that megadiff did not ship (planted.py)"
            in capsys.readouterr().err) and not ran.exists()
    main([*options, "--trust-remote-code"])
    assert ran.exists()


def test_the_code_megadiff_ships_is_trusted_and_only_that(tmp_path):
    from megadiff.inference.remote_code import SHIPPED_CODE, foreign_code

    for path in SHIPPED_CODE:
        shutil.copyfile(path, tmp_path / path.name)
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "configuration_megadiff.X"}}))
    assert foreign_code(tmp_path) == []
    with open(tmp_path / "modeling_megadiff.py", "a") as edited:
        edited.write("\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["a/b--tok.T", None]}}))
    assert foreign_code(tmp_path) == ["modeling_megadiff.py", "a/b--tok.T"]


def test_an_export_carries_its_runs_held_out_samples(tmp_path):
    """--hf on a megadiff export draws the run's held-out samples: its data settings and seed (the
    sample order's), with the export's own tokenizer, attending across documents as transformers does."""
    from megadiff.config import build_config, dump_config
    from megadiff.convert.hf_io import SIDECAR_CONFIG
    from megadiff.inference.hf_model import _export_data

    run = build_config({}, ["train.seed=7", "data.prefix=/data/web", "data.split=98,2,0", "data.document_masking=true"])
    dump_config(run, tmp_path / SIDECAR_CONFIG)
    with pytest.warns(UserWarning, match="trained with data.document_masking.*--hf's losses are not the run's"):
        defaults = build_config({"model": {"seq_length": 64}, **_export_data(tmp_path)})
    assert defaults.train.seed == 7 and (defaults.data.prefix, defaults.data.split) == ("/data/web", "98,2,0")
    assert defaults.data.tokenizer == str(tmp_path) and not defaults.data.document_masking
    assert build_config(_export_data(tmp_path / "not-an-export")).data.tokenizer == str(tmp_path / "not-an-export")


def test_data_named_for_a_run_on_the_bundled_corpus_is_read_not_replaced_by_it(tmp_path, capsys):
    """A data.prefix override names the held-out text: a mistyped one is refused (the run's bundled corpus
    is not prepared there and scored under its name), an existing one is evaluated."""
    run_dir, cfg = held_out_run(tmp_path, "diff", overrides=("data.sources=[]", "data.prefix=null",
                                                             "data.bundled_corpus=kjv"))
    mistyped = tmp_path / "prepared" / "dcos"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "1", f"data.prefix={mistyped}"]) == 2
    assert "dcos" in capsys.readouterr().err
    assert not list(mistyped.parent.glob("dcos*"))
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(run_dir), "--sequences", "2", "--output", str(out),
                 f"data.prefix={tmp_path / 'prepared' / 'docs'}"]) == 0
    naive, _ = _naive_losses(run_dir, cfg, cfg.model.seq_length, 2, tmp_path / "prepared" / "docs")
    assert json.loads(out.read_text())["loss"] == pytest.approx(naive.mean().item(), rel=1e-5)


def test_a_prefix_named_for_a_run_on_a_blend_is_evaluated_in_its_place(tmp_path):
    """data.prefix names the held-out text of a run that trained on a data.blend too: the run's blend, which takes
    the place of a prefix in training, was evaluated instead."""
    write_documents(tmp_path / "later.jsonl", first_verse=5000)
    run_dir, cfg = held_out_run(tmp_path, "diff")
    docs, later = cfg.data.prefix, str(tmp_path / "prepared" / "later")
    prepare(build_config(cfg.model_dump(mode="json"), [f"data.sources=[{tmp_path / 'later.jsonl'}]",
                                                       f"data.prefix={later}"]).data)
    blend_run, _ = held_out_run(tmp_path / "blend", "diff", overrides=(f"data.blend=[{docs},{later}]",))
    out = tmp_path / "report.json"
    assert main(["evaluate", "--load", str(blend_run), "--sequences", "2", "--output", str(out),
                 f"data.prefix={later}"]) == 0
    naive, _ = _naive_losses(blend_run, cfg, cfg.model.seq_length, 2, Path(later))
    report = json.loads(out.read_text())
    assert "sources" not in report
    assert report["loss"] == pytest.approx(naive.mean().item(), rel=1e-5)


@pytest.mark.parametrize("command", ["evaluate", "outliers"])
@pytest.mark.parametrize("override,refusal", [("data.prefx=docs", "data.prefx: unknown key"),
                                              ("data.split=abc", "data.split: 'abc'"),
                                              ("data.prefix={missing}", "data.prefix: .*missing.bin")])
def test_bad_data_overrides_are_refused_before_the_weights_are_read(run, tmp_path, monkeypatch, capsys, command,
                                                                    override, refusal):
    """Refused only once the checkpoint had loaded: minutes for a large model, on every rank of a torchrun."""
    from megadiff.inference import evaluate as evaluate_module, outliers as outliers_module

    def weights_read(*args, **kwargs):
        raise AssertionError("the weights were read before the overrides were checked")
    for module in (evaluate_module, outliers_module):
        monkeypatch.setattr(module, "load_model", weights_read)
    run_dir, _ = run
    assert main([command, "--load", str(run_dir), override.format(missing=tmp_path / "missing")]) == 2
    assert re.search(refusal, capsys.readouterr().err)
