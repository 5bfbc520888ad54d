"""Supervised fine-tuning data (data.response_key): prepare-data writes each record's prompt and
response as one document with a loss mask beside it, and training samples keep the loss only
where the label is a response's token (or the EOD that ends it)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from rich.console import Console

from megadiff.config import ConfigError, build_config
from megadiff.data.datasets import build_datasets
from megadiff.data.errors import DataError
from megadiff.data.indexed import loss_mask_prefix
from megadiff.data.prepare import prepare
from megadiff.data.tokenizers import load_tokenizer
from megadiff.inference.evaluate import evaluate
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer
from megadiff.observability.metrics import read_metrics
from tests.pretrain_runs import losses, run_pretrain, tiny_overrides

# prompts and responses of distinct single tokens, so a label's token says which one it belongs to
PROMPT_WORD, RESPONSE_WORD = " question", " answer"


def write_records(path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def sft_overrides(sources, prefix, tokenizer="cl100k_base") -> list[str]:
    return [f"data.sources=[{sources}]", f"data.prefix={prefix}", "data.text_key=question",
            "data.response_key=answer", f"data.tokenizer={tokenizer}"]


def test_each_record_is_its_prompt_then_its_response_with_the_response_masked_in(tmp_path):
    verses = kjv_verses()[:12]
    records = [{"question": verses[i], "answer": verses[i + 1]} for i in range(0, 12, 2)]
    records[2]["answer"] = ""  # teaches nothing: skipped
    write_records(tmp_path / "src" / "a.jsonl", records[:3])  # two files: two parts, merged
    write_records(tmp_path / "src" / "b.jsonl", records[3:])
    # two tokenizer processes: the pairs travel to spawned workers
    data = build_config({}, sft_overrides(tmp_path / "src", tmp_path / "out" / "sft") + ["data.workers=2"]).data
    console = Console(width=400, record=True)
    stats = prepare(data, console)
    assert stats["documents"] == 5 and stats["skipped_empty"] == 1
    summary = console.export_text()
    assert "sft-loss-mask.idx" in summary  # the summary names both outputs
    tokenizer = load_tokenizer("cl100k_base")
    tokens = IndexedDataset(str(tmp_path / "out" / "sft"))
    mask = IndexedDataset(loss_mask_prefix(tmp_path / "out" / "sft"))
    kept = [record for record in records if record["answer"]]
    assert len(tokens) == len(mask) == len(kept)
    for i, record in enumerate(kept):
        assert_pair(tokenizer, tokens[i].tolist(), mask[i].tolist(), record["question"], record["answer"])
    assert stats["loss_tokens"] == sum(int(mask[i].sum()) for i in range(len(kept)))
    assert f"{stats['loss_tokens']:,} (" in summary
    assert prepare(data) == stats  # up to date: nothing redone


def test_a_record_without_its_prompt_is_skipped_and_counted(tmp_path, capsys):
    """A null or missing prompt (a key misspelt in some records) was read as an empty one: its response was
    trained on as an answer to nothing, and the summary counted nothing skipped."""
    records = [{"question": " Who begat Enos?", "answer": " Seth."}, {"question": None, "answer": " Cainan."},
               {"answer": " Mahalaleel."}, {"Question": " misspelt", "answer": " Jared."},
               {"question": "", "answer": " Enoch."}]  # an empty prompt is given, not missing: kept
    write_records(tmp_path / "src" / "a.jsonl", records)
    stats = prepare(build_config({}, sft_overrides(tmp_path / "src", tmp_path / "out" / "sft")).data)
    kept = [record for record in records if record.get("question") is not None]
    assert (stats["documents"], stats["skipped_empty"], stats["skipped_missing"]) == (len(kept), 3, 3)
    tokenizer, tokens = load_tokenizer("cl100k_base"), IndexedDataset(str(tmp_path / "out" / "sft"))
    mask = IndexedDataset(loss_mask_prefix(tmp_path / "out" / "sft"))
    for i, record in enumerate(kept):
        if record["question"]:  # the empty one: test_a_documents_first_token_takes_no_loss
            assert_pair(tokenizer, tokens[i].tolist(), mask[i].tolist(), record["question"], record["answer"])
    summary = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "3 without the field 'question' (data.text_key) or 'answer' (data.response_key), 0 empty" in summary


def test_a_response_opening_with_a_character_split_across_tokens_takes_the_loss_from_its_first_byte():
    """cl100k spells rare characters (some Greek after a word, emoji after a space) in several byte tokens:
    tiktoken's offsets ended the token holding a response's first bytes where the next began, before the character,
    so it took no loss and the model was never taught to begin such a response. Reference: the tokens holding any
    of the response's bytes."""
    from megadiff.data.tokenize_workers import _encode_pair

    tokenizer = load_tokenizer("cl100k_base")
    for prompt, response in ((" Who begat", "Ω, the last"), ("Pray:  ", "🙏 Amen"), ("祝福", "𝕏 marks it")):
        ids, mask = _encode_pair(prompt, response, tokenizer)
        ends = np.cumsum([len(tokenizer.encoding.decode_single_token_bytes(i)) for i in ids])
        assert mask == (ends > len(prompt.encode())).astype(int).tolist(), (prompt, response)


def test_a_documents_first_token_takes_no_loss(tmp_path):
    """Packed, a document's first token is the label of the EOD before it. tiktoken writes no start token, so an
    empty prompt's response (or a response whose first characters merge with a one-space prompt) began with a
    loss: the model learnt it from the document before. Reference: each record taken alone, its response's
    tokens found by their bytes; a sequence's first token is never a target."""
    records = [{"question": " Who begat Enos?", "answer": " Seth."}, {"question": "", "answer": " Enoch walked."},
               {"question": " ", "answer": "Methuselah begat"}, {"question": "", "answer": "Lamech."}]
    write_records(tmp_path / "src" / "a.jsonl", records)
    prefix = tmp_path / "out" / "sft"
    prepare(build_config({}, sft_overrides(tmp_path / "src", prefix)).data)
    tokenizer = load_tokenizer("cl100k_base")
    tokens, mask = IndexedDataset(str(prefix)), IndexedDataset(loss_mask_prefix(prefix))
    assert len(tokens) == len(records)
    for i, record in enumerate(records):
        ids = tokenizer.encoding.encode_ordinary(record["question"] + record["answer"])
        assert tokens[i].tolist() == ids + [tokenizer.eod]
        ends = np.cumsum([len(tokenizer.encoding.decode_single_token_bytes(token)) for token in ids])
        response = (ends > len(record["question"].encode())).astype(int).tolist()
        assert mask[i].tolist() == [0] + response[1:] + [1], record


def test_pairs_an_earlier_megadiff_prepared_are_said_to_need_preparing_again(tmp_path):
    """Data prepared before records without a prompt were skipped, and before tiktoken's split characters took
    their loss, is prepared again by prepare-data; a run reading the prefix is told."""
    import warnings

    from megadiff.data.checks import check_training_data
    from megadiff.data.manifest import manifest_path

    sources, prefix = sft_corpus(tmp_path)
    cfg = build_config({}, sft_overrides(sources, prefix) + ["model.seq_length=16", "model.vocab_size=100288",
                                                             "data.split=100,0,0", f"data.cache_dir={tmp_path}"])
    tokenizer = load_tokenizer("cl100k_base")
    recorded = json.loads(manifest_path(prefix).read_text())
    for marker in ("without_prompt", "first_token", "split_characters"):
        del recorded["fingerprint"][marker]
    manifest_path(prefix).write_text(json.dumps(recorded))  # as an earlier megadiff wrote it
    with pytest.warns(UserWarning, match=r"prepared by an earlier megadiff: its records without a prompt were trained "
                                         r"on their response alone; a document's first token .* took the loss, "
                                         r"learnt from the document packed before it; with tiktoken, a token holding"):
        check_training_data(cfg, tokenizer)
    prepare(cfg.data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(cfg, tokenizer)


def assert_pair(tokenizer, ids: list[int], mask: list[int], prompt: str, response: str) -> None:
    """The pair's text exactly, then the EOD; the loss on the tokens from the first holding response
    characters (one at the edge may hold the prompt's last ones) through the EOD."""
    assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
    assert tokenizer.decode(ids[:-1]) == prompt + response
    first = mask.index(1)
    assert mask == [0] * first + [1] * (len(ids) - first)
    context = tokenizer.decode(ids[:first])
    assert prompt.startswith(context) and len(prompt) - len(context) < 4


def sft_corpus(tmp_path, records: int = 40):
    """Records of k prompt words and m response words (k, m varying), prepared."""
    rows = [{"question": PROMPT_WORD * (1 + i % 5), "answer": RESPONSE_WORD * (1 + i % 3)} for i in range(records)]
    write_records(tmp_path / "src" / "sft.jsonl", rows)
    prefix = tmp_path / "prepared" / "sft"
    prepare(build_config({}, sft_overrides(tmp_path / "src", prefix)).data)
    return tmp_path / "src", prefix


def test_training_samples_keep_the_loss_on_the_responses(tmp_path):
    sources, prefix = sft_corpus(tmp_path)
    cfg = build_config({}, sft_overrides(sources, prefix) + [
        "model.seq_length=16", "model.vocab_size=100288", "data.split=100,0,0", f"data.cache_dir={tmp_path / 'c'}"])
    tokenizer = load_tokenizer("cl100k_base")
    (prompt_id,), (response_id,) = tokenizer.encode(PROMPT_WORD), tokenizer.encode(RESPONSE_WORD)
    train, _, _ = build_datasets(cfg, tokenizer, (12, 0, 0), seed=1)
    for i in range(12):
        sample = train[i]
        labels = sample["labels"].numpy()
        assert set(labels.tolist()) <= {prompt_id, response_id, tokenizer.eod}
        expected = (labels == response_id) | (labels == tokenizer.eod)
        assert sample["loss_mask"].numpy().tolist() == expected.astype(np.float32).tolist(), i
    # the same samples without data.response_key: every label counts, and it is said
    plain = build_config(cfg.model_dump(mode="json"), ["data.response_key=null"])
    with pytest.warns(UserWarning, match=r"prepared with data.response_key=answer, not set here: the loss is taken "
                                         "on every token"):
        train, _, _ = build_datasets(plain, tokenizer, (12, 0, 0), seed=1)
    assert all(train[i]["loss_mask"].min() == 1 for i in range(12))


def tiny_cl100k_run(tmp_path, split: str) -> list[str]:
    """tiny_overrides for a 2-iteration run on cl100k_base data named by the test."""
    base = tiny_overrides(tmp_path / "unused", tmp_path / "cache") + ["model.vocab_size=100288", "train.iters=2"]
    return [o for o in base if not o.startswith("data.tokenizer=")] + ["data.bundled_corpus=null",
                                                                       f"data.split={split}"]


def test_pretraining_on_prompt_response_data(tmp_path):
    """End to end: a run on responses only (averaged per token, validated) starts from another loss
    than one on every token."""
    sources, prefix = sft_corpus(tmp_path, records=200)
    base = tiny_cl100k_run(tmp_path, "90,10,0")
    with_responses = sft_overrides(sources, prefix) + [f"output_dir={tmp_path / 'sft'}"]
    validated = ["train.per_token_loss=true", "train.eval_interval=2", "train.eval_iters=1"]
    run_pretrain(1, base + with_responses + validated)
    run_pretrain(1, base + with_responses[:-1] + ["data.response_key=null", f"output_dir={tmp_path / 'all'}"])
    masked, everything = losses(tmp_path / "sft"), losses(tmp_path / "all")
    assert len(masked) == 2 and all(np.isfinite(masked))
    assert masked[0] != pytest.approx(everything[0], rel=1e-3)
    (valid,) = [r["valid_loss"] for r in read_metrics(tmp_path / "sft") if "valid_loss" in r]
    assert np.isfinite(valid)


def test_validation_means_over_the_response_tokens_as_evaluate_does(tmp_path):
    """Micro-batches of one sample hold unequal numbers of response tokens: the run's valid_loss at iteration 2
    is the mean over every response token of its 2 x 8 validation samples, as `megadiff evaluate` scores the
    checkpoint of that iteration on them (a mean of micro-batch means weighed the tokens unequally)."""
    sources, prefix = sft_corpus(tmp_path, records=2000)  # a valid split of more than 16 distinct samples
    out = tmp_path / "sft"
    run_pretrain(1, tiny_cl100k_run(tmp_path, "50,50,0") + sft_overrides(sources, prefix) + [
        f"output_dir={out}", "train.micro_batch_size=1", "train.eval_interval=2", "train.eval_iters=2",
        "checkpoint.save_interval=2"])
    (valid,) = [r["valid_loss"] for r in read_metrics(out) if "valid_loss" in r]
    report = tmp_path / "eval.json"
    assert evaluate(str(out), sequences=16, batch_size=4, output=str(report)) == 0
    scored = json.loads(report.read_text())
    assert scored["sequences"] == 16
    assert valid == pytest.approx(scored["loss"], rel=1e-6)


def test_mistakes_are_named(tmp_path):
    with pytest.raises(ConfigError, match="data.response_key"):
        build_config({}, ["data.response_key=answer", "data.length_upsampling=true"])
    kjv = tmp_path / "kjv.txt"
    kjv.write_text(" ".join(kjv_verses()[:50]))
    with pytest.raises(DataError, match="data.response_key: .* is plain text"):
        prepare(build_config({}, sft_overrides(kjv, tmp_path / "txt")).data)
    write_records(tmp_path / "plain" / "p.jsonl", [{"question": v} for v in kjv_verses()[:300]])
    no_answers = sft_overrides(tmp_path / "plain", tmp_path / "plain-prepared")
    with pytest.raises(DataError, match="data.response_key: .* has no field 'answer'"):
        prepare(build_config({}, no_answers).data)
    prepare(build_config({}, no_answers + ["data.response_key=null"]).data)
    cfg = build_config({}, no_answers + ["model.seq_length=16", "model.vocab_size=100288", "data.split=100,0,0",
                                         f"data.cache_dir={tmp_path / 'c'}"])
    with pytest.raises(DataError, match="has no loss mask .* prepared without data.response_key"):
        build_datasets(cfg, load_tokenizer("cl100k_base"), (4, 0, 0), seed=1)


def test_a_lost_loss_mask_is_prepared_again(tmp_path, capsys):
    """The manifest records the loss mask's files too: a rerun restores them rather than calling
    the data up to date, which training would then refuse."""
    write_records(tmp_path / "src" / "a.jsonl", [{"question": f"q{i}?", "answer": f"answer {i}"} for i in range(20)])
    data = build_config({}, sft_overrides(tmp_path / "src", tmp_path / "sft")).data
    prepare(data)
    mask = loss_mask_prefix(tmp_path / "sft")
    written = {ext: Path(f"{mask}{ext}").read_bytes() for ext in (".bin", ".idx")}
    for ext in (".bin", ".idx"):
        Path(f"{mask}{ext}").unlink()
    capsys.readouterr()
    prepare(data)
    assert "up to date" not in capsys.readouterr().out
    assert {ext: Path(f"{mask}{ext}").read_bytes() for ext in (".bin", ".idx")} == written
    prepare(data)
    assert "up to date" in capsys.readouterr().out


def test_a_response_reads_as_it_continues_its_prompt_with_a_sentencepiece_tokenizer(tmp_path):
    """A Llama 2-like tokenizer begins every text it encodes with a space ("▁"): a response encoded alone gained
    one ("French:  chat")."""
    spec = str(build_tokenizer(tmp_path / "tokenizer", bos="<s>", adds_bos=True, sentencepiece_like=True))
    records = [{"question": "Translate: chat\nFrench: ", "answer": "chat"},
               {"question": "Q: 2+2?\nA:\n", "answer": "4"},
               {"question": "And God said,", "answer": " Let there be light"}]
    write_records(tmp_path / "src" / "a.jsonl", records)
    prepare(build_config({}, sft_overrides(tmp_path / "src", tmp_path / "sft", spec)).data)
    tokenizer = load_tokenizer(spec)
    tokens, mask = IndexedDataset(str(tmp_path / "sft")), IndexedDataset(loss_mask_prefix(tmp_path / "sft"))
    for i, record in enumerate(records):
        ids = tokens[i].tolist()
        assert ids[0] == 1 and mask[i][0] == 0  # the BOS, as a document's
        assert_pair(tokenizer, ids[1:], mask[i].tolist()[1:], record["question"], record["answer"])


def test_a_special_tokens_text_in_a_prompt_or_response_is_text(tmp_path, small_tokenizer_dir):
    records = [{"question": "What is <|endoftext|>?", "answer": "It reads <|endoftext|> as text."}]
    write_records(tmp_path / "src" / "a.jsonl", records)
    prepare(build_config({}, sft_overrides(tmp_path / "src", tmp_path / "sft", str(small_tokenizer_dir))).data)
    tokenizer = load_tokenizer(str(small_tokenizer_dir))
    tokens = IndexedDataset(str(tmp_path / "sft"))  # referenced: its items are views of its memory map
    ids = tokens[0].tolist()
    assert [i for i, token in enumerate(ids) if token == tokenizer.eod] == [len(ids) - 1]
    assert tokenizer.decode(ids[:-1]) == records[0]["question"] + records[0]["answer"]


@pytest.mark.parametrize("change", ["truncated", "appended"])
def test_a_loss_mask_of_another_size_is_prepared_again(tmp_path, capsys, change):
    """A loss mask cut short (a full disk, an interrupted copy) or grown would misalign with the tokens:
    the manifest records its size, so a rerun rewrites it rather than calling the data up to date."""
    write_records(tmp_path / "src" / "a.jsonl", [{"question": f"q{i}?", "answer": f"answer {i}"} for i in range(20)])
    data = build_config({}, sft_overrides(tmp_path / "src", tmp_path / "sft")).data
    prepare(data)
    mask_bin = Path(f"{loss_mask_prefix(tmp_path / 'sft')}.bin")
    written = mask_bin.read_bytes()
    mask_bin.write_bytes(written[:-3] if change == "truncated" else written + b"\x01" * 3)
    capsys.readouterr()
    prepare(data)
    assert "up to date" not in capsys.readouterr().out
    assert mask_bin.read_bytes() == written
