"""A tiktoken tokenizer exported as Hugging Face files (what `convert to-hf` writes beside the
weights) must split text exactly as tiktoken does: the model never saw any other split."""
from __future__ import annotations

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
