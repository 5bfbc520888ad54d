"""A text begins as the tokenizer begins one (its text_start: Llama's BOS, nothing for GPT-2's or
tiktoken's), wherever megadiff makes one: prepared documents and prompt/response pairs, plain-text
prompts, needle cases, conversations (where their template writes no start of its own). Data prepared before
documents began with it is prepared again, and a run reading such data is told. (lm-eval's contexts:
tests/test_lm_eval.py, against the harness's Hugging Face model; adaptation's documents:
tests/test_adapt_finetune.py.)"""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megadiff.config import build_config
from megadiff.data.checks import check_training_data
from megadiff.data.indexed import loss_mask_prefix
from megadiff.data.manifest import manifest_path
from megadiff.data.prepare import prepare
from megadiff.data.tokenizers import load_tokenizer
from megadiff.inference.chat_prompts import encode_prompt, render_chat
from megadiff.inference.needles import build_case
from tests.convert_worker import build_tokenizer
from tests.test_chat_data import CHATML
from tests.test_data_prepare import read_back

BOS = "<s>"
TEXTS = ["In the beginning God created the heaven and the earth.", "", "And God said, Let there be light."]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """Tokenizer specs: one that puts a BOS before every text, one (same vocabulary) that does not."""
    root = tmp_path_factory.mktemp("text_start")
    return {"llama_like": str(build_tokenizer(root / "llama_like", bos=BOS, adds_bos=True)),
            "plain": str(build_tokenizer(root / "plain", bos=BOS))}


def test_text_start_is_what_the_tokenizer_adds_before_a_text(tokenizers):
    from transformers import AutoTokenizer

    for name, spec in tokenizers.items():
        hf = AutoTokenizer.from_pretrained(spec)
        added = hf("verse")["input_ids"][:-len(hf("verse", add_special_tokens=False)["input_ids"])]
        assert load_tokenizer(spec).text_start == tuple(added) == ((1,) if name == "llama_like" else ())
    assert load_tokenizer("cl100k_base").text_start == ()


def _prepare(tmp_path: Path, spec: str, *overrides: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t, "answer": t[::-1]}) + "\n" for t in TEXTS))
    cfg = build_config({}, [f"data.sources=[{tmp_path / 'docs.jsonl'}]", f"data.prefix={tmp_path / 'out' / 'docs'}",
                            f"data.cache_dir={tmp_path / 'cache'}", f"data.tokenizer={spec}", *overrides])
    prepare(cfg.data)
    return cfg


def test_prepared_documents_and_pairs_begin_with_it(tokenizers, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers["llama_like"])
    eos = hf.eos_token_id
    _prepare(tmp_path / "docs", tokenizers["llama_like"])
    # as the tokenizer encodes a text (BOS first), then the EOD; the empty document is skipped
    assert read_back(tmp_path / "docs" / "out" / "docs") == [hf(t)["input_ids"] + [eos] for t in TEXTS if t]
    _prepare(tmp_path / "pairs", tokenizers["llama_like"], "data.text_key=text", "data.response_key=answer")
    pairs = tmp_path / "pairs" / "out" / "docs"
    expected = [hf(t + t[::-1])["input_ids"] + [eos] for t in TEXTS if t]  # one text
    assert read_back(pairs) == expected
    # the BOS is context, like the prompt: no loss on it
    masks = read_back(loss_mask_prefix(pairs))
    assert [mask[0] for mask in masks] == [0] * len(expected) and all(sum(mask) > 0 for mask in masks)
    plain = _prepare(tmp_path / "plain", tokenizers["plain"])
    assert read_back(tmp_path / "plain" / "out" / "docs") == [load_tokenizer(tokenizers["plain"]).encode(t) + [eos]
                                                             for t in TEXTS if t]
    assert "text_start" not in json.loads(manifest_path(plain.data.prefix).read_text())["fingerprint"]["tokenizer"]


def test_data_prepared_without_it_is_prepared_again_and_a_run_is_told(tokenizers, tmp_path, capsys):
    cfg = _prepare(tmp_path, tokenizers["llama_like"], "data.split=50,50,0", "model.seq_length=8")
    manifest = manifest_path(cfg.data.prefix)
    recorded = json.loads(manifest.read_text())
    assert recorded["fingerprint"]["tokenizer"]["text_start"] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(cfg, load_tokenizer(tokenizers["llama_like"]))
    # as an earlier megadiff wrote it: no text_start recorded (the tokens themselves left as they are)
    del recorded["fingerprint"]["tokenizer"]["text_start"]
    manifest.write_text(json.dumps(recorded))
    with pytest.warns(UserWarning, match=r"prepared before documents began with the tokenizer's \[1\]"):
        check_training_data(cfg, load_tokenizer(tokenizers["llama_like"]))
    capsys.readouterr()
    prepare(cfg.data)
    assert "text_start" in json.loads(manifest.read_text())["fingerprint"]["tokenizer"]
    assert "is up to date" not in capsys.readouterr().out
    prepare(cfg.data)  # the control: now it is
    assert "is up to date" in capsys.readouterr().out


def test_a_plain_prompt_begins_with_it_and_a_chat_as_its_template_writes(tokenizers):
    tokenizer = load_tokenizer(tokenizers["llama_like"])
    text = "And the earth was without form"
    bare = tokenizer.encode(text)
    assert bare[0] != 1 and encode_prompt(tokenizer, text) == [1] + bare
    assert encode_prompt(tokenizer, BOS + text) == [1] + bare  # spelled out: not twice
    chat = render_chat([{"role": "user", "content": text}], Path(CHATML).read_text(), tokenizer)
    assert encode_prompt(tokenizer, chat, chat=True) == tokenizer.encode(chat)
    with_bos = "{{ bos_token }}" + Path(CHATML).read_text()
    chat = render_chat([{"role": "user", "content": text}], with_bos, tokenizer)
    assert encode_prompt(tokenizer, chat, chat=True)[:2] == [1, tokenizer.encode("<|im_start|>")[0]]
    plain = load_tokenizer(tokenizers["plain"])
    assert encode_prompt(plain, text) == plain.encode(text)


def test_a_conversation_begins_with_it_where_its_template_writes_none(tokenizers, tmp_path):
    """data.chat_template without a BOS of its own (ChatML, Tulu) on a tokenizer that begins texts with one: a
    conversation begins with it, without loss, as open-instruct's tokenizer(text) begins one, and so does its chat
    prompt; the template saved with an export writes it, so apply_chat_template gives the trained ids. A template
    that writes it (Llama 2's {{ bos_token }}) has it once; a tokenizer without one is left as it is."""
    from transformers import AutoTokenizer

    from megadiff.data.conversations import chat_template_of, encode_conversation, save_chat_template

    messages = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Seth."}]
    tokenizer = load_tokenizer(tokenizers["llama_like"])
    chatml = Path(CHATML).read_text()
    for template in (chatml, "{{ bos_token }}" + chatml):
        data = SimpleNamespace(chat_template=template)
        ids, mask = encode_conversation(messages, chat_template_of(data, tokenizer), tokenizer)
        unopened, _ = encode_conversation(messages, chatml, tokenizer)
        assert ids == [1] + unopened and mask[0] == 0 and sum(mask) > 0
        prompt = encode_prompt(tokenizer, render_chat(messages[:1], chat_template_of(data, tokenizer), tokenizer),
                               chat=True)
        assert prompt == ids[:len(prompt)]
        save_chat_template(data, tokenizer, tmp_path)
        exported = AutoTokenizer.from_pretrained(tokenizers["llama_like"])
        exported.chat_template = (tmp_path / "chat_template.jinja").read_text()
        rendered = exported.apply_chat_template(messages, tokenize=False)
        assert exported.encode(rendered, add_special_tokens=False) == ids[:-1]  # all but the EOD
    plain = load_tokenizer(tokenizers["plain"])
    assert chat_template_of(SimpleNamespace(chat_template=chatml), plain) == chatml


def test_a_needle_case_is_one_text(tokenizers):
    tokenizer = load_tokenizer(tokenizers["llama_like"])
    documents = [[1] + tokenizer.encode(t) + [tokenizer.eod] for t in TEXTS[::2] * 40]
    haystack = np.asarray([token for document in documents for token in document])
    for depth in (0.0, 0.5, 1.0):
        case = build_case(tokenizer, haystack, 300, depth, 3, random.Random(4))
        # the BOS once, first; no document's BOS or EOD inside; exactly the length asked
        assert case.tokens[0] == 1 and 1 not in case.tokens[1:] and tokenizer.eod not in case.tokens
        assert len(case.tokens) == 300
        needle = case.tokens[slice(*case.needle_spans[0])]
        assert tokenizer.decode(needle).startswith("\nThe magic number of")
    assert build_case(tokenizer, haystack, 300, 0.0, 3, random.Random(4)).needle_spans[0][0] == 1  # after the BOS
    plain = load_tokenizer(tokenizers["plain"])
    assert build_case(plain, haystack[haystack != 1], 300, 0.0, 3, random.Random(4)).needle_spans[0][0] == 0


def test_the_text_start_is_no_attention_noise(tokenizers, monkeypatch):
    """needles --attention: a Llama's BOS (its attention sink) counts neither as the answer nor as noise."""
    import torch

    from megadiff.inference import needles

    tokenizer = load_tokenizer(tokenizers["llama_like"])
    haystack = np.asarray([token for t in TEXTS[::2] * 40 for token in tokenizer.encode(t) + [tokenizer.eod]])
    case = build_case(tokenizer, haystack, 200, 0.5, 2, random.Random(1))
    width = case.answer_start
    for attended, noise in ((0, 0.0), (case.question_start - 1, 1.0)):  # all on the BOS, then on the haystack
        rows = torch.zeros(1, width)
        rows[0, attended] = 1.0
        monkeypatch.setattr(needles, "attention_rows", lambda model, tokens, position: [rows])
        assert needles.attention_allocation(object(), case) == (0.0, noise)
    uniform = torch.full((1, width), 1.0 / width)
    monkeypatch.setattr(needles, "attention_rows", lambda model, tokens, position: [uniform])
    needle_tokens = sum(end - start for start, end in case.needle_spans)
    expected = (case.question_start - 1 - needle_tokens) / width
    assert needles.attention_allocation(object(), case)[1] == pytest.approx(expected)


def test_a_bos_that_is_the_eod_begins_prompts_not_documents(tokenizers, tmp_path):
    """OPT's </s> begins and ends a text: a prompt begins with it, a document does not (the previous
    document's end gives it), so document boundaries stay one EOD apiece."""
    from transformers import AutoTokenizer
    from tokenizers import processors

    hf = AutoTokenizer.from_pretrained(tokenizers["plain"])
    eod = hf.eos_token_id
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{hf.eos_token} $A", pair=f"{hf.eos_token} $A {hf.eos_token} $B", special_tokens=[(hf.eos_token, eod)])
    hf.bos_token = hf.eos_token
    hf.save_pretrained(tmp_path / "opt_like")
    tokenizer = load_tokenizer(str(tmp_path / "opt_like"))
    assert tokenizer.text_start == (eod,)
    assert encode_prompt(tokenizer, TEXTS[0]) == [eod] + tokenizer.encode(TEXTS[0])
    cfg = _prepare(tmp_path / "data", str(tmp_path / "opt_like"))
    assert read_back(tmp_path / "data" / "out" / "docs") == [tokenizer.encode(t) + [eod] for t in TEXTS if t]
    assert "text_start" not in json.loads(manifest_path(cfg.data.prefix).read_text())["fingerprint"]["tokenizer"]


def test_prepared_conversations_begin_with_it_once(tokenizers, tmp_path):
    """Conversation data of a BOS-adding tokenizer, with a template that writes none: the BOS begins each
    conversation (the template's opening, which the data's fingerprint holds), and a run is not warned of it."""
    conversation = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Seth."}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": conversation}) + "\n" for _ in range(40)))
    cfg = build_config({}, [f"data.sources=[{tmp_path / 'chat.jsonl'}]", f"data.prefix={tmp_path / 'out' / 'chat'}",
                            f"data.cache_dir={tmp_path / 'cache'}", f"data.tokenizer={tokenizers['llama_like']}",
                            "data.messages_key=messages", f"data.chat_template={CHATML}", "data.split=50,50,0",
                            "model.seq_length=8"])
    prepare(cfg.data)
    assert "text_start" not in json.loads(manifest_path(cfg.data.prefix).read_text())["fingerprint"]["tokenizer"]
    assert all(document[0] == 1 and 1 not in document[1:] for document in read_back(tmp_path / "out" / "chat"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(cfg, load_tokenizer(tokenizers["llama_like"]))


def test_a_needle_case_reads_as_one_text_with_a_sentencepiece_tokenizer(tmp_path):
    """A Llama 2-like tokenizer begins every text it encodes with a space: each needle and the question, encoded
    apart, began with one inside the case ("dove \nThe magic number ..."); the answers are the needles' numbers."""
    tokenizer = load_tokenizer(str(build_tokenizer(tmp_path, bos=BOS, adds_bos=True, sentencepiece_like=True)))
    haystack = np.asarray([token for text in TEXTS[::2] * 40 for token in tokenizer.encode(text)])
    case = build_case(tokenizer, haystack, 400, 0.5, 2, random.Random(0), queries=2)
    text = tokenizer.decode(case.tokens)
    assert text.count("\nThe magic number of ") == 2 and " \nThe magic" not in text and " \nWhat" not in text
    assert ". The magic number of" in text.split("\nWhat")[1]  # the second query, after the first answer
    assert case.answer_span != case.needle_spans[0]  # the number found inside its needle
    assert [case.tokens[slice(*span)] for span in case.answer_spans][0] == case.tokens[slice(*case.answer_span)]


def test_a_messages_special_token_text_reads_as_written_with_a_sentencepiece_tokenizer(tmp_path):
    """A message's "<s>" stays text, encoded apart from what surrounds it: a Llama 2-like tokenizer began each
    piece with a space ("Is  <s> a tag?"). The conversation reads as rendered, its chat prompt as its start."""
    from megadiff.data.conversations import chat_template_of, encode_conversation, render_conversation

    tokenizer = load_tokenizer(str(build_tokenizer(tmp_path, bos=BOS, adds_bos=True, sentencepiece_like=True)))
    template = chat_template_of(SimpleNamespace(chat_template=Path(CHATML).read_text()), tokenizer)
    # "<s>nd": the text after it opens with letters the encoding's lead-in "a" joins ("and")
    messages = [{"role": "user", "content": "Is <s> a tag?"}, {"role": "assistant", "content": "Yes, <s>nd is."}]
    ids, mask = encode_conversation(messages, template, tokenizer)
    assert tokenizer.decode(ids[:-1]) == render_conversation(messages, template, tokenizer.special_tokens)
    assert ids.count(1) == 1  # the opening BOS; the messages' "<s>" are text
    assert tokenizer.decode([i for i, learned in zip(ids, mask) if learned][:-1]) == "Yes, <s>nd is.<|im_end|>\n"
    prompt = encode_prompt(tokenizer, render_chat(messages[:1], template, tokenizer), chat=True)
    assert prompt == ids[:len(prompt)]
