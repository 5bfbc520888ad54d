"""`megadiff needles`: the cases hold what they claim where they claim it, and the accuracy grid
equals what a retrieval oracle of known reach achieves; on a real checkpoint the one-pass check
agrees with step-by-step greedy decoding."""
from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megadiff.cli import main
from megadiff.config import ConfigError, build_config
from megadiff.data.indexed import AtomicIndexedWriter
from megadiff.data.tokenizers import load_tokenizer
from megadiff.inference import load_checkpoint
from megadiff.inference.evaluate import evaluation_config
from megadiff.inference.needles import (
    attention_allocation, attention_rows, build_case, held_out_tokens, retrieval_grid, retrieved,
)
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer
from tests.held_out_runs import held_out_run, write_documents


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("cl100k_base")


@pytest.fixture(scope="module")
def haystack(tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.encode(" ".join(kjv_verses()[:2000])))


class CopyingOracle:
    """Predicts the token that followed the latest earlier occurrence of the last `context` tokens,
    found no more than `reach` tokens back: retrieval whose range is known exactly."""

    def __init__(self, vocab_size: int, reach: int | None = None, context: int = 4):
        self.vocab_size, self.reach, self.context = vocab_size, reach, context

    def logits_at(self, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(positions), self.vocab_size)
        for row, position in enumerate(positions):
            key = ids[position - self.context + 1:position + 1]
            earliest = 0 if self.reach is None else max(0, position - self.reach)
            for start in range(position - self.context, earliest - 1, -1):
                if ids[start:start + self.context] == key:
                    logits[0, row, ids[start + self.context]] = 1.0
                    break
        return logits


@pytest.mark.parametrize("needles", [1, 4])
def test_a_case_holds_its_needles_question_and_answer_where_it_says(tokenizer, haystack, needles):
    starts = []
    for depth in (0.0, 0.5, 1.0):
        case = build_case(tokenizer, haystack, 600, depth, needles, random.Random(3))
        assert len(case.tokens) == 600
        text = tokenizer.decode(case.tokens)
        assert text.count("The magic number of") == needles + 1  # the needles and the question
        city_and_number = tokenizer.decode(case.tokens[case.needle_spans[0][0]:]).split(".\n")[0]
        assert city_and_number.startswith("\nThe magic number of ")
        number = city_and_number.rsplit(" ", 1)[1]
        assert tokenizer.decode(case.answer) == f" {number}"
        city = city_and_number.split(" of ")[1].split(" is")[0]
        assert tokenizer.decode(case.tokens[:case.answer_start]).endswith(f"The magic number of {city} is")
        starts.append(case.needle_spans[0][0] / case.answer_start)
    assert starts[0] < 0.05 and 0.4 < starts[1] < 0.6 and starts[2] > 0.9


def test_a_case_asking_for_several_needles_holds_each_answer_after_its_city(tokenizer, haystack):
    """R = 2 of N = 4: the question names both cities, and each answer follows "The magic number of
    CITY is" and is that city's number in its needle; the first queried needle sits at the depth."""
    for depth in (0.0, 1.0):
        case = build_case(tokenizer, haystack, 600, depth, 4, random.Random(5), queries=2)
        assert len(case.tokens) == 600 and len(case.answer_spans) == 2
        text = tokenizer.decode(case.tokens)
        assert text.count("The magic number of") == 4 + 2
        needles = dict(line.removeprefix("The magic number of ").removesuffix(".").split(" is ")
                       for line in text.splitlines() if line.startswith("The magic number of ") and line.endswith("."))
        question = tokenizer.decode(case.tokens[case.question_start:case.answer_start])
        asked = question.split("What are the magic numbers of ")[1].split("?")[0].split(" and ")
        assert len(asked) == 2 and set(asked) <= set(needles)
        for city, (start, end) in zip(asked, case.answer_spans):
            assert tokenizer.decode(case.tokens[:start]).endswith(f"The magic number of {city} is")
            assert tokenizer.decode(case.tokens[start:end]) == f" {needles[city]}"
        first_needle = tokenizer.decode(case.tokens[slice(*case.needle_spans[0])])
        assert first_needle == f"\nThe magic number of {asked[0]} is {needles[asked[0]]}.\n"
        where = case.needle_spans[0][0] / case.question_start
        assert where < 0.05 if depth == 0 else where > 0.9


def test_the_grid_is_what_an_oracle_of_known_reach_retrieves(tokenizer, haystack):
    lengths, depths = [300, 900], [0.0, 0.5, 1.0]
    everything = retrieval_grid(CopyingOracle(tokenizer.vocab_size), tokenizer, haystack, lengths, depths,
                                needles=3, trials=2, seed=0)
    assert everything["accuracy"] == [[1.0] * 3] * 2 and everything["mean_accuracy"] == 1.0
    # reaching back 400 tokens: needles at the start of a 900-token context are out of reach
    near = retrieval_grid(CopyingOracle(tokenizer.vocab_size, reach=400), tokenizer, haystack, lengths, depths,
                          needles=3, trials=2, seed=0)
    assert near["accuracy"] == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    # two of two needles asked for: the second sits mid-context, out of reach in 900 tokens, so a case
    # whose first needle is in reach (depth 1) scores one half
    both = retrieval_grid(CopyingOracle(tokenizer.vocab_size, reach=400), tokenizer, haystack, lengths, depths,
                          needles=2, trials=2, seed=0, queries=2)
    assert both["queries"] == 2 and both["accuracy"] == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.5]]


def test_a_number_is_retrieved_only_where_greedy_decoding_ends_it(tokenizer, haystack):
    """An oracle copying the needle retrieves its number; copying a needle whose number goes on with a
    digit, it would generate a longer number than the one asked for."""
    case = build_case(tokenizer, haystack, 300, 0.5, 1, random.Random(2))
    oracle = CopyingOracle(tokenizer.vocab_size)
    assert retrieved(oracle, case, tokenizer) == 1.0
    longer = case.tokens.copy()
    longer[case.answer_span[1]] = tokenizer.encode("7")[0]  # where the needle's "." was
    assert retrieved(oracle, dataclasses.replace(case, tokens=longer), tokenizer) == 0.0


def test_the_haystack_leaves_the_documents_ends_out(tokenizer):
    """A document-masked model attends within documents: an EOD between a needle and its question would
    hide it. The haystack is the documents' text, read on past its end from its start if need be."""
    eod = tokenizer.eod
    documents = [tokenizer.encode(verse) + [eod] for verse in kjv_verses()[:60]]
    haystack = np.concatenate(documents)
    length = len(haystack) - len(documents) - 40  # the needle, question and answer take fewer than 40
    case = build_case(tokenizer, haystack, length, 0.5, 1, random.Random(0))
    assert eod not in case.tokens and len(case.tokens) == length
    with pytest.raises(ConfigError, match="fewer than .* tokens besides its documents' ends"):
        build_case(tokenizer, haystack, len(haystack), 0.5, 1, random.Random(0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{variant: run directory} of DIFF and softmax checkpoints (4 heads over 2 key/value heads)."""
    root = tmp_path_factory.mktemp("needles")
    return {variant: held_out_run(root, variant)[0] for variant in ("diff", "softmax")}


def test_cli_report_and_the_one_pass_check_agree_with_greedy_generation(runs, tmp_path):
    run_dir = runs["diff"]
    out = tmp_path / "needles.json"
    assert main(["needles", "--load", str(run_dir), "--lengths", "256", "320", "--depths", "0", "1",
                 "--trials", "2", "--needles", "2", "--queries", "2", "--attention", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["lengths"] == [256, 320] and report["depths"] == [0.0, 1.0] and report["queries"] == 2
    assert all(0.0 <= value <= 1.0 for row in report["accuracy"] for value in row)
    assert np.shape(report["attention_to_answer"]) == np.shape(report["attention_noise"]) == (2, 2)

    model = load_checkpoint(run_dir)
    tokens = held_out_tokens(evaluation_config(model.cfg, None, []), "valid")
    tokenizer = model.tokenizer

    def gives(prompt: list[int], answer: list[int]) -> bool:
        """Greedy decoding gives exactly `answer`: its tokens, then none going on with a digit."""
        greedy = _greedy(model, prompt, len(answer) + 1)
        return greedy[:-1] == answer and not tokenizer.decode(greedy[-1:])[:1].isdigit()

    for depth in (0.0, 1.0):
        case = build_case(tokenizer, tokens, 160, depth, 2, random.Random(1))
        assert tokenizer.eod not in case.tokens  # the documents' ends left out of the haystack
        assert retrieved(model, case, tokenizer) == gives(case.tokens[:case.answer_start], case.answer)
        # and a case made to be retrieved: its answer is what the model generates, when that ends as a number
        greedy = _greedy(model, case.tokens[:case.answer_start], len(case.answer))
        forced = dataclasses.replace(case, tokens=case.tokens[:case.answer_start] + greedy)
        assert retrieved(model, forced, tokenizer) == gives(forced.tokens[:case.answer_start], greedy)
    two = build_case(tokenizer, tokens, 256, 0.5, 2, random.Random(1), queries=2)
    expected = sum(gives(two.tokens[:start], two.tokens[start:end]) for start, end in two.answer_spans) / 2
    assert retrieved(model, two, tokenizer) == expected
    assert main(["needles", "--load", str(run_dir), "--lengths", "160", "--needles", "2", "--queries", "3"]) == 2


def test_lengths_the_cases_cannot_fit_are_refused_before_the_weights_are_read(runs, monkeypatch, capsys):
    """They were refused after the checkpoint had loaded, minutes at scale."""
    from megadiff.inference import needles

    monkeypatch.setattr(needles, "load_model", lambda *args: pytest.fail("the weights were read"))
    for lengths, refusal in ((["160", "100000000"], "100000000 tokens need .* haystack tokens; the held-out split has"),
                             (["5"], "5 tokens are fewer than the needles, question and answer take")):
        assert main(["needles", "--load", str(runs["diff"]), "--lengths", *lengths]) == 2
        assert re.search(refusal, capsys.readouterr().err)


def test_a_haystack_prepared_with_another_tokenizer_is_refused_as_evaluate_refuses_it(runs, tmp_path, monkeypatch,
                                                                                      capsys):
    """Its ids, read with the checkpoint's tokenizer, are other text: needles built its haystack of them, where
    evaluate refuses the same data. Refused before the weights are read."""
    from megadiff.data.prepare import prepare
    from megadiff.inference import needles

    write_documents(tmp_path / "docs.jsonl")
    other = build_tokenizer(tmp_path / "other-tokenizer", sentencepiece_like=True)
    prefix = f"data.prefix={tmp_path / 'prepared' / 'other'}"
    prepare(build_config({}, [f"data.sources=[{tmp_path / 'docs.jsonl'}]", prefix, f"data.tokenizer={other}",
                              f"data.cache_dir={tmp_path / 'cache'}"]).data)
    capsys.readouterr()
    assert main(["evaluate", "--load", str(runs["diff"]), prefix]) == 2
    refusal = capsys.readouterr().err
    assert "was prepared with tokenizer" in refusal
    monkeypatch.setattr(needles, "load_model", lambda *args: pytest.fail("the weights were read"))
    assert main(["needles", "--load", str(runs["diff"]), "--lengths", "160", "--trials", "1", prefix]) == 2
    assert capsys.readouterr().err == refusal


def test_a_bundled_corpus_found_prepared_is_said_once(runs, tmp_path, capsys):
    """The cases' check before the weights are read prepares the haystack's bundled corpus: the command then
    prepared it again, printing that it was up to date twice."""
    from megadiff.data.prepare import prepare

    data = ["data.sources=[]", "data.bundled_corpus=kjv", f"data.prefix={tmp_path / 'kjv'}"]
    cfg = evaluation_config(load_checkpoint(runs["diff"]).cfg, None, data)
    prepare(cfg.data)
    capsys.readouterr()
    prepare(cfg.data)  # what finding it prepared says
    up_to_date = capsys.readouterr().out
    assert main(["needles", "--load", str(runs["diff"]), "--lengths", "160", "--depths", "0", "--trials", "1",
                 *data]) == 0
    assert capsys.readouterr().out.count(up_to_date) == 1


def test_an_exported_model_retrieves_as_its_checkpoint(runs, tmp_path, capsys, monkeypatch):
    """--hf on the DIFF run's Hugging Face export (stock DiffLlama, run by transformers), the haystack
    named by data.* overrides: the answer positions' logits are the checkpoint's, so are the one-pass
    checks, the command's report and the attention rows (--attention). Lengths its cases cannot fit are
    refused before its weights are read, as a checkpoint's."""
    from megadiff.inference import needles
    from megadiff.inference.hf_attention import hf_attention_rows
    from megadiff.inference.hf_model import load_hf_model

    run_dir, export = runs["diff"], tmp_path / "hf"
    assert main(["convert", "to-hf", "--load", str(run_dir), "--save", str(export)]) == 0
    ours, theirs = load_checkpoint(run_dir, torch.float32), load_hf_model(export, "fp32")
    tokens = held_out_tokens(evaluation_config(ours.cfg, None, []), "valid")
    case = build_case(ours.tokenizer, tokens, 256, 0.5, 2, random.Random(2), queries=2)
    positions = list(range(case.answer_start - 1, len(case.tokens) - 1))
    with torch.no_grad():
        torch.testing.assert_close(theirs.logits_at(torch.tensor([case.tokens]), positions),
                                   ours.logits_at(torch.tensor([case.tokens]), positions), rtol=1e-4, atol=1e-4)
    assert retrieved(theirs, case, ours.tokenizer) == retrieved(ours, case, ours.tokenizer)
    one = build_case(ours.tokenizer, tokens, 160, 1.0, 2, random.Random(3))
    greedy = _greedy(ours, one.tokens[:one.answer_start], len(one.answer) + 1)
    forced = dataclasses.replace(one, tokens=one.tokens[:one.answer_start] + greedy[:-1])
    assert retrieved(theirs, forced, ours.tokenizer) == float(not ours.tokenizer.decode(greedy[-1:])[:1].isdigit())

    data = [f"data.{key}={getattr(ours.cfg.data, key)}" for key in ("prefix", "split", "cache_dir")]
    options = ["--lengths", "256", "--depths", "0", "1", "--trials", "2", "--needles", "2"]
    assert main(["needles", "--load", str(run_dir), *options, "--output", str(tmp_path / "run.json")]) == 0
    assert main(["needles", "--hf", str(export), "--dtype", "fp32", *options, *data,
                 "--output", str(tmp_path / "hf.json")]) == 0
    report, from_hf = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("run", "hf"))
    assert from_hf["accuracy"] == report["accuracy"] and from_hf["checkpoint"] == str(export)
    capsys.readouterr()
    # transformers' DiffLlama: the differential rows of the checkpoint, so its allocation
    assert attention_allocation(theirs, case) == pytest.approx(attention_allocation(ours, case), rel=1e-4)
    for mine, exported in zip(attention_rows(ours, case.tokens, 200), hf_attention_rows(theirs, case.tokens, 200),
                              strict=True):
        torch.testing.assert_close(exported, mine, rtol=1e-4, atol=1e-5)
    # the export's own run's data by default (its sidecar); a model of no megadiff run names none
    own = tmp_path / "own.json"
    assert main(["needles", "--hf", str(export), "--dtype", "fp32", *options, "--output", str(own)]) == 0
    assert json.loads(own.read_text())["accuracy"] == report["accuracy"]
    shutil.copytree(export, tmp_path / "other")
    (tmp_path / "other" / "megadiff_config.yaml").unlink()
    capsys.readouterr()
    assert main(["needles", "--hf", str(tmp_path / "other"), *options]) == 2  # no haystack named
    assert "data.prefix" in capsys.readouterr().err
    monkeypatch.setattr(needles, "load_model", lambda *args: pytest.fail("the weights were read"))
    assert main(["needles", "--hf", str(export), "--lengths", "5"]) == 2
    assert "5 tokens are fewer than the needles, question and answer take" in capsys.readouterr().err


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    """Argmax decoding over the whole context, each step through the model's full logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("variant", ["diff", "softmax"])
def test_attention_rows_are_the_maps_the_layer_applies(runs, variant):
    """Each layer's row, times the values (DIFF: then x (1 - lambda), head norm, x (1 - lambda_init)),
    is the core attention's own output at that position."""
    model = load_checkpoint(runs[variant])
    tokens = held_out_tokens(evaluation_config(model.cfg, None, []), "valid")[:40].tolist()
    position = 30
    rows = attention_rows(model, tokens, position)
    applied = []
    handles = [layer.self_attention.core_attention.register_forward_hook(
        lambda module, args, output: applied.append((module, args[2], output))) for layer in model.gpt.decoder.layers]
    with torch.no_grad():
        model.hidden_states(torch.tensor([tokens[:position + 1]]))
    for handle in handles:
        handle.remove()
    assert len(rows) == len(applied) == len(model.gpt.decoder.layers)
    for row, (module, value, output) in zip(rows, applied):
        torch.testing.assert_close(row.sum(-1), torch.ones(row.shape[0]))
        heads = row.shape[0]
        if variant == "diff":
            d = module.head_dim
            v = value[:position + 1, 0].reshape(position + 1, -1, 2 * d).float()
            lam = module.current_lambda().float()
            mixed = torch.einsum("hj,hjd->hd", row * (1 - lam),
                                 v.permute(1, 0, 2).repeat_interleave(heads // v.shape[1], 0))
            mixed = F.rms_norm(mixed, (2 * d,), module.head_norm_weight.float(), module.head_norm_eps)
            expected = mixed * (1.0 - module.lambda_init)
        else:
            v = value[:position + 1, 0].float()
            expected = torch.einsum("hj,hjd->hd", row, v.permute(1, 0, 2).repeat_interleave(heads // v.shape[1], 0))
        torch.testing.assert_close(output[position, 0].float(), expected.reshape(-1), rtol=1e-4, atol=1e-5)


def test_attention_allocation_sums_the_rows_over_the_answer_and_the_haystack(runs):
    model = load_checkpoint(runs["diff"])
    haystack = held_out_tokens(evaluation_config(model.cfg, None, []), "valid")
    case = build_case(model.tokenizer, haystack, 200, 0.5, 3, random.Random(2))
    assert model.tokenizer.decode(case.tokens[slice(*case.answer_span)]) == model.tokenizer.decode(case.answer)
    rows = torch.cat(attention_rows(model, case.tokens, case.answer_start - 1))
    in_needles = {i for start, end in case.needle_spans for i in range(start, end)}
    haystack_positions = [i for i in range(case.question_start) if i not in in_needles]
    to_answer, noise = attention_allocation(model, case)
    assert to_answer == pytest.approx(rows[:, list(range(*case.answer_span))].sum(-1).mean().item(), rel=1e-5)
    assert noise == pytest.approx(rows[:, haystack_positions].sum(-1).mean().item(), rel=1e-5)
    assert 0 < len(haystack_positions) < case.question_start


def test_a_length_the_haystack_cannot_fill_is_refused_before_any_case_is_scored(tokenizer, haystack, monkeypatch):
    from megadiff.inference import needles

    scored = []
    monkeypatch.setattr(needles, "retrieved", lambda model, case: scored.append(case) or 0.0)
    with pytest.raises(ConfigError, match="haystack tokens"):
        retrieval_grid(None, tokenizer, haystack[:500], [120, 300, 5000], [0.0, 1.0], 1, 2, seed=0)
    assert scored == []


def test_the_haystack_is_the_splits_documents_read_in_place(tmp_path):
    """The held-out split's documents, in order, with no copy of them made: a 1T-token corpus's
    valid split would take tens of GB of host memory per rank."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, 2000)
    with AtomicIndexedWriter(tmp_path / "corpus", np.int32) as writer:
        writer.add_documents(rng.integers(0, 100_000, lengths.sum()), lengths)
        writer.commit()
    cfg = build_config({"data": {"prefix": str(tmp_path / "corpus"), "tokenizer": "cl100k_base",
                                 "split": "40,50,10"}}, [])
    documents = IndexedDataset(str(tmp_path / "corpus"))
    for split, (begin, end) in (("valid", (800, 1800)), ("test", (1800, 2000))):
        tracemalloc.start()
        try:
            tokens = held_out_tokens(cfg, split)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        np.testing.assert_array_equal(tokens, np.concatenate([documents[i] for i in range(begin, end)]))
        assert peak < tokens.nbytes / 4
