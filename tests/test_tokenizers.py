"""A tiktoken tokenizer exported as Hugging Face files (what `convert to-hf` writes beside the
weights) must split text exactly as tiktoken does: the model never saw any other split."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megadiff.data.tokenizers import load_tokenizer
from tests.conftest import kjv_verses

# numbers of every length (cl100k groups digits by three from the left), dates, prices, ids, and the
# other pieces of the split pattern: contractions, non-Latin letters, punctuation runs, newlines
TEXTS = [
    "7 42 123 2024 12345 1234567 99999999999",
    "On 2024-11-25 it cost $1,299.99 (order #000123456789).",
    "I'll say they're 'fine', we've been\n\n\n  here\t\tbefore...!!",
    "Größe, naïve façade; 東京は2024年に; Ελληνικά; 😀👍🏽 x²+y³",
    "   leading and trailing spaces   \n",
]


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_an_exported_tiktoken_tokenizer_splits_as_tiktoken(name, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(name)
    tokenizer.save_hf(tmp_path)
    exported = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + kjv_verses()[:300:7]:
        assert exported.encode(text, add_special_tokens=False) == tokenizer.encode(text), text
    assert exported.convert_tokens_to_ids("<|endoftext|>") == tokenizer.eod
    assert len(exported) == tokenizer.vocab_size


def test_a_sentencepiece_model_without_its_package_is_named(tmp_path):
    """A directory holding only tokenizer.model (Llama 2's, Gemma's): transformers needs the sentencepiece
    package for it, and without it reads the file as tiktoken's, failing on a line of bytes."""
    import importlib.util

    from megadiff.data.tokenizers import TokenizerError

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed: transformers reads the model itself")
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0e\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}')
    with pytest.raises(TokenizerError, match="tokenizer.model is a SentencePiece model: pip install sentencepiece"):
        load_tokenizer(str(tmp_path))


def test_a_converter_s_missing_package_is_a_tokenizer_error(tmp_path, monkeypatch):
    """transformers converts some tokenizer files with a package of their own (tiktoken before 0.12 read
    a local encoding with blobfile's): its ImportError is said as the directory's, not as a traceback."""
    import transformers

    from megadiff.data.tokenizers import TokenizerError

    (tmp_path / "tokenizer.model").write_bytes(b"IQ== 0\n")

    def missing_package(*args, **kwargs):
        raise ImportError("blobfile is not installed. Please install it by running `pip install blobfile`.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing_package)
    with pytest.raises(TokenizerError, match=rf"{re.escape(str(tmp_path))}: no usable Hugging Face tokenizer files "
                                             r"\(blobfile is not installed"):
        load_tokenizer(str(tmp_path))


def test_a_directory_without_tokenizer_files_is_said_to_hold_none(tmp_path):
    """transformers' error for it speaks of converting a slow tokenizer with sentencepiece or tiktoken; a model's
    directory saved without its tokenizer (config.json and weights alone) is the usual case."""
    from megadiff.data.tokenizers import TokenizerError

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(TokenizerError, match=r"no usable Hugging Face tokenizer files \(it holds none of "
                                             r"tokenizer.json, tokenizer.model, "):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("files", [{"tokenizer.json": '{"not": "a tokenizer"'}, {"cl100k.tiktoken": "not base64"}],
                         ids=["tokenizer.json cut short", "a tiktoken file"])
def test_a_directory_with_unreadable_tokenizer_files_gets_transformers_reason(tmp_path, files):
    """Files are there but cannot be read: transformers' own reason, not that the directory holds none."""
    from megadiff.data.tokenizers import TokenizerError

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer(str(tmp_path))
    assert "no usable Hugging Face tokenizer files (" in str(refused.value)
    assert "holds none" not in str(refused.value)


def test_an_absolute_tokenizer_path_that_is_gone_is_said_to_be_gone(tmp_path):
    """A from-hf checkpoint's config names its tokenizer/ by absolute path: moved, the checkpoint's config names
    a directory that no longer exists, which is no hub name."""
    from megadiff.data.tokenizers import TokenizerError

    with pytest.raises(TokenizerError, match=re.escape(f"data.tokenizer: {tmp_path / 'moved'} does not exist (moved "
                                                       "or deleted?): give data.tokenizer= its path now")):
        load_tokenizer(str(tmp_path / "moved"))


def test_a_tokenizer_named_neither_packaged_nor_a_directory_is_refused(tmp_path):
    """A hub name (models are read from a directory here, offline), or a tokenizer's file rather than its
    directory: said as such, not as a missing file."""
    from megadiff.data.tokenizers import PACKAGED_TIKTOKEN, TokenizerError

    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=re.escape(f"data.tokenizer: '{tmp_path / 'tokenizer.json'}' is neither "
                                                       f"one of {PACKAGED_TIKTOKEN} nor a directory")):
        load_tokenizer(str(tmp_path / "tokenizer.json"))

    with pytest.raises(TokenizerError, match=re.escape(f"data.tokenizer: 'gpt2' is neither one of {PACKAGED_TIKTOKEN} "
                                                      "nor a directory of Hugging Face tokenizer files (a relative "
                                                      f"path is read from the current directory, {Path.cwd()})")):
        load_tokenizer("gpt2")


def test_a_tokenizer_without_an_eos_token_is_refused(tmp_path):
    """Documents are separated by the EOS id: a tokenizer naming none gives them no end."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megadiff.data.tokenizers import TokenizerError

    words = Tokenizer(models.WordLevel({"in": 0, "the": 1, "beginning": 2, "[UNK]": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match=f"tokenizer {tmp_path} has no eos token to use as end-of-document"):
        load_tokenizer(str(tmp_path))


def test_an_adapted_exports_tokenizer_loads_without_a_false_model_type_warning(tmp_path, monkeypatch):
    """`evaluate --hf` (needles, outliers) prepares its held-out text with the export's own tokenizer, read without
    trusting the directory's code: transformers then falls back to a generic config and warned that the model
    type "is otherwise not supported and can yield errors". The tokenizer is the one a trusting load gives."""
    from transformers import AutoTokenizer
    from transformers import configuration_utils

    from megadiff.adapt import apply_dex
    from megadiff.adapt.export import save_adapted
    from tests.convert_worker import build_tokenizer
    from tests.test_adapt import tiny_model, tokens

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tokenizer"))
    save_adapted(apply_dex(tiny_model("llama"), {}, calibration=[tokens(seed=1)]), tmp_path / "hf", tokenizer=tokenizer)
    warned = []
    monkeypatch.setattr(configuration_utils.logger, "warning", lambda message, *args, **kwargs: warned.append(message))
    loaded = load_tokenizer(str(tmp_path / "hf"))
    assert warned == []
    trusted = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    text = " ".join(kjv_verses()[:3])
    assert loaded.encode(text) == trusted(text, add_special_tokens=False).input_ids
    assert (loaded.eod, loaded.vocab_size) == (trusted.eos_token_id, len(trusted))


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_tokenizer_directory_replaced_in_the_same_process_is_read_again(relative, tmp_path, monkeypatch):
    """A notebook or sweep retrains its tokenizer into the same directory (or names it relative to another working
    directory) between two calls: the second call reads what is there now, as a fresh process would."""
    from transformers import AutoTokenizer

    from tests.conftest import save_small_tokenizer

    verses = kjv_verses()
    for name, first in (("a", 0), ("b", 20000)):
        save_small_tokenizer(tmp_path / name / "tok", verses[first:first + 5000])
    monkeypatch.chdir(tmp_path / "a")
    spec = "tok" if relative else str(tmp_path / "a" / "tok")
    load_tokenizer(spec).encode(verses[0])  # the first tokenizer, loaded and cached
    if relative:
        monkeypatch.chdir(tmp_path / "b")
    else:
        save_small_tokenizer(tmp_path / "a" / "tok", verses[20000:25000])
    expected = AutoTokenizer.from_pretrained(tmp_path / "b" / "tok")
    text = " ".join(verses[:20])
    assert load_tokenizer(spec).encode(text) == expected.encode(text, add_special_tokens=False)
