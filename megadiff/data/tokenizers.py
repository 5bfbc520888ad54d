"""Tokenizers: tiktoken BPEs shipped by a package (cl100k_base, the DIFF paper's, by default)
or any Hugging Face tokenizer directory.

Every tokenizer has `name`, `vocab_size` (ids in use, before the model pads its embedding),
`undecodable_ids` (those below vocab_size that no token has, never to be generated), `eod` (the
end-of-document id megatron's datasets append), `eos_ids` (the ids generation stops at: the EOD, then any other
EOS the generation_config.json beside a Hugging Face tokenizer names), `text_start` (the ids the tokenizer puts before a
text of its own accord: Llama's BOS, nothing for GPT-2's or tiktoken's; documents and plain-text
prompts begin with them, chat templates write their own or are given them), `chat_template` (its
Jinja chat template, if it has one), `special_tokens` (the names a chat template reads, e.g.
eos_token), `special_texts` (the texts `encode` reads as special tokens), `encode` (prompts,
rendered chat templates), `encode_ordinary` (documents: a special token's text stays text), `decode`
`pad` (an id batches of an export may be padded with, never read from text; None where the tokenizer names
none) and `save_hf(dir, model_max_length=None)`, which writes Hugging Face tokenizer files so an exported model
directory is complete.
`load_tokenizer(spec)` takes the `data.tokenizer` config value.
"""
from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import os
import re
import shutil
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Optional, Protocol

from megadiff.errors import MegadiffError, first_line


# tiktoken encodings whose rank files ship in the `bpe-openai` wheel (no download at run time)
PACKAGED_TIKTOKEN = ("cl100k_base", "o200k_base")
END_OF_TEXT = "<|endoftext|>"
GENERATION_CONFIG = "generation_config.json"  # transformers' name for it in a model directory


class TokenizerError(MegadiffError, ValueError):
    """A tokenizer that cannot be loaded."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    undecodable_ids: frozenset[int]
    eod: int
    eos_ids: tuple[int, ...]
    bos: int  # the tokenizer's BOS id, where it names one (else eod)
    text_start: tuple[int, ...]
    chat_template: Optional[str]
    special_tokens: dict[str, str]
    special_texts: tuple[str, ...]
    pad: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def encode_ordinary(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str, ordinary: bool) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save_hf(self, directory: str | Path, model_max_length: int | None = None) -> None: ...


class TiktokenTokenizer:
    def __init__(self, name: str):
        import tiktoken
        from bpe_openai import registry

        self.name = name
        spec = getattr(registry, name)()
        self.encoding = tiktoken.Encoding(**spec)
        self.vocab_size = self.encoding.n_vocab
        # ids with neither a rank nor a special token (cl100k: 100256 and 100261-100275): tiktoken cannot decode them
        self.undecodable_ids = frozenset(range(self.vocab_size)) - set(spec["mergeable_ranks"].values()) \
            - set(spec["special_tokens"].values())
        self.eod = self.encoding.eot_token
        self.eos_ids = (self.eod,)
        self.bos = self.eod
        self.text_start = ()
        self.chat_template = None
        self.special_tokens = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}  # as save_hf names them
        # what `encode` reads as special tokens' ids, as the exported tokenizer (save_hf) reads them: a chat
        # template's EOS is trained on as the id the export's apply_chat_template and generation stop give
        self.special_texts = tuple(sorted(self.encoding.special_tokens_set))
        # batched pipelines of an export need a pad token: a reserved id, which tiktoken never gives (the EOS
        # would be masked out of fine-tuning labels by collators that mask the pad)
        self.pad = min(self.undecodable_ids, default=None)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_with_offsets(self, text: str, ordinary: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """encode's (or with `ordinary`, encode_ordinary's) ids, each with the (start, end) of its characters
        in `text`."""
        ids = self.encode_ordinary(text) if ordinary else self.encode(text)
        return ids, character_spans([self.encoding.decode_single_token_bytes(i) for i in ids])

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode([i for i in ids if i < self.vocab_size and i not in self.undecodable_ids])

    def save_hf(self, directory: str | Path, model_max_length: int | None = None) -> None:
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
        pad = {} if self.pad is None else {"pad_token": by_id.get(self.pad, f"<|reserved_{self.pad}|>")}
        context = {} if model_max_length is None else {"model_max_length": model_max_length}
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
                                     **context, **pad)
        save_for_any_transformers(hf, directory)


def character_spans(pieces: list[bytes]) -> list[tuple[int, int]]:
    """Each token's (start, end) in the text whose UTF-8 bytes the tokens' `pieces` are: every character any of
    its bytes belong to, as Hugging Face's offsets give them. A character split across tokens (cl100k's rare
    CJK characters and emoji) is in each; tiktoken's offsets ended a token where the next began, so the one
    holding a reply's first bytes seemed to hold none of its characters and took no loss."""
    spans, begun = [], 0  # the characters begun before the token
    for piece in pieces:
        goes_on = bool(piece) and _is_continuation(piece[0])  # its first byte is in a character begun before
        start = begun - goes_on
        begun += sum(not _is_continuation(byte) for byte in piece)
        spans.append((start, begun))
    return spans


def _is_continuation(byte: int) -> bool:
    """A UTF-8 byte that goes on with a character (10xxxxxx), not one beginning it."""
    return 0x80 <= byte < 0xC0


def oniguruma_pattern(pattern: str) -> str:
    """tiktoken's split pattern as the tokenizers library's Oniguruma engine must read it. There a
    bounded repeat followed by `+` is not possessive but repeated: cl100k's `\\p{N}{1,3}+` would take
    a whole run of digits as one piece, so "2024" would split as 20|24 where tiktoken has 202|4.
    An atomic group is what tiktoken means."""
    return re.sub(r"(\\p\{\w+\}\{\d+,\d+\})\+", r"(?>\1)", pattern)


def _untrusted_model_config(path: str, trust_remote_code: bool) -> dict:
    """For a model directory whose config.json names code of its own (a Dex/DAA export) that is not
    trusted here: the generic config transformers falls back to for the tokenizer anyway, given up front, since
    the fallback also warns that the model type is not supported and "can yield errors", which is not so."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):  # a tokenizer directory alone, or a config transformers will name itself
        return {}
    if trust_remote_code or not isinstance(config, dict) or "AutoConfig" not in config.get("auto_map", {}):
        return {}
    from transformers import PretrainedConfig

    return {"config": PretrainedConfig.from_dict({k: v for k, v in config.items() if k != "model_type"})}


class HFTokenizer:
    undecodable_ids: frozenset[int] = frozenset()  # every id below len(hf) decodes

    def __init__(self, path: str, hf=None, trust_remote_code: bool = False):
        """The tokenizer files in `path`, or `hf`, one already loaded from there (e.g. from a GGUF file);
        `trust_remote_code` for a model directory whose code is run anyway (`--hf`), else transformers asks."""
        from transformers import AutoTokenizer

        self.name = path
        try:
            self.hf = hf if hf is not None else AutoTokenizer.from_pretrained(
                path, trust_remote_code=trust_remote_code, **_untrusted_model_config(path, trust_remote_code))
        except (OSError, ValueError, ImportError) as err:  # ImportError: a converter's package is missing
            raise TokenizerError(f"{path}: no usable Hugging Face tokenizer files "
                                 f"({why_unreadable(path, err)}){_sentencepiece_hint(path)}") from None
        self.vocab_size = len(self.hf)
        eod = self.hf.eos_token_id
        if eod is None:
            raise TokenizerError(f"tokenizer {path} has no eos token to use as end-of-document")
        self.eod = eod
        self.eos_ids = generation_eos_ids(path, eod)
        self.bos = eod if self.hf.bos_token_id is None else self.hf.bos_token_id
        self.text_start = text_start(self.hf)
        template = self.hf.chat_template
        # a tokenizer may hold several named templates; "default" is the one transformers applies
        self.chat_template = template.get("default") if isinstance(template, dict) else template
        self.special_tokens = {name: token for name, token in self.hf.special_tokens_map.items()
                               if isinstance(token, str)}
        # the texts `encode` reads as special tokens' ids (chat markup such as <|im_start|>, the EOS)
        self.special_texts = tuple(token.content for token in self.hf.added_tokens_decoder.values() if token.special)
        self.literal_hf = _reading_special_texts_as_text(self.hf, self.special_texts)
        self.pad = self.hf.pad_token_id
        # what decode does to the text of the ids (" ' s" -> "'s"), or None: streamed text applies it
        # where no later token can change its outcome (TextStream)
        self.space_cleanup = _space_cleanup(self.hf)

    def encode(self, text: str) -> list[int]:
        """Special tokens' texts in `text` become their ids: for prompts and chat templates' renderings."""
        return self.hf.encode(text, add_special_tokens=False)

    def encode_ordinary(self, text: str) -> list[int]:
        """Special tokens' texts in `text` stay text, as tiktoken's encode reads them: for documents,
        where a literal "<|endoftext|>" must not end the document."""
        return self.literal_hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode_with_offsets(self, text: str, ordinary: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """encode's (or with `ordinary`, encode_ordinary's) ids, each with the (start, end) of its characters in
        `text`; NotImplementedError for a tokenizer without offsets (a slow, Python one)."""
        if not self.hf.is_fast:
            raise NotImplementedError(f"{self.name} gives no character offsets")
        encoded = (self.literal_hf if ordinary else self.hf)(text, add_special_tokens=False,
                                                             split_special_tokens=ordinary, return_offsets_mapping=True)
        return encoded["input_ids"], [tuple(span) for span in encoded["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def decode_uncleaned(self, ids: list[int]) -> str:
        """decode's text before its space_cleanup."""
        return self.hf.decode(ids, clean_up_tokenization_spaces=False)

    def save_hf(self, directory: str | Path, model_max_length: int | None = None) -> None:
        exported = copy.copy(self.hf)
        if model_max_length is not None:  # truncation=True then cuts at the model's context, not the base model's
            exported.model_max_length = model_max_length
        save_for_any_transformers(exported, directory)


def _space_cleanup(hf) -> Optional[Callable[[str], str]]:
    """hf's clean_up_tokenization where its decode applies it (a WordPiece or Unigram tokenizer saved with
    clean_up_tokenization_spaces=True; transformers 5 skips it for BPE, 4 does not: seen on a probe)."""
    if not getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    probe = hf.encode("a ' s , b .", add_special_tokens=False)  # spaces WordPiece's decoder keeps between tokens
    return hf.clean_up_tokenization if hf.decode(probe) != hf.decode(probe, clean_up_tokenization_spaces=False) \
        else None


def generation_eos_ids(directory: str, eod: int) -> tuple[int, ...]:
    """`eod`, then the other EOS ids of the generation_config.json in `directory` (a model's, or a converted
    checkpoint's tokenizer/), where transformers' generate() stops too: a Llama 3 Instruct's tokenizer names
    <|eot_id|> its EOS, its generation config <|end_of_text|> beside it."""
    try:
        named = json.loads((Path(directory) / GENERATION_CONFIG).read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # none there, or not a JSON object: the EOD alone
        return (eod,)
    named = named if isinstance(named, list) else [named]
    return tuple(dict.fromkeys([eod, *(token for token in named if isinstance(token, int))]))


def save_for_any_transformers(hf, directory: str | Path) -> None:
    """`hf.save_pretrained(directory)`, readable by transformers 4.x too. transformers 5 names a tokenizer
    read from its tokenizer.json alone `TokenizersBackend`, a class 4.x lacks (its AutoTokenizer refused the
    export); named by its 4.x name, PreTrainedTokenizerFast (5.x's alias of it), 4.x reads it with that
    class's default inputs, token_type_ids among them, which generate() refuses: the config names them."""
    hf.save_pretrained(str(directory))
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=list(hf.model_input_names))
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _reading_special_texts_as_text(hf, special_texts: tuple[str, ...]):
    """`hf`, or a copy of it whose model never picks a special token's piece out of text. split_special_tokens
    keeps a special token's text away from the added-token matcher only: a converted SentencePiece Unigram
    model (T5's) lists "</s>" and "<unk>" among its pieces, scored as likely as any, and would read a web page's
    "<s>struck</s>" as an end of document. SentencePiece itself never matches those control pieces in text."""
    import json

    from tokenizers import Tokenizer as Backend

    if not getattr(hf, "is_fast", False) or type(hf.backend_tokenizer.model).__name__ != "Unigram":
        return hf
    spec = json.loads(hf.backend_tokenizer.to_str())
    pieces = [piece for piece in spec["model"]["vocab"] if piece[0] in special_texts]
    if not pieces:
        return hf
    for piece in pieces:
        piece[1] = UNREACHABLE_SCORE
    literal = copy.copy(hf)
    literal._tokenizer = Backend.from_str(json.dumps(spec))  # transformers' fast tokenizers encode with it
    return literal


# a Unigram piece's log probability that no split of a text into other pieces (even <unk>'s) falls below
UNREACHABLE_SCORE = -1e9


TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                        "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def why_unreadable(directory: str | Path, err: Exception) -> str:
    """Why transformers read no tokenizer from a directory: where it holds no tokenizer file at all, that, not
    transformers' error, which then speaks of converting a slow tokenizer with sentencepiece or tiktoken."""
    directory = Path(directory)
    if any((directory / name).is_file() for name in TOKENIZER_FILE_NAMES) or any(directory.glob("*.tiktoken")):
        return first_line(err)
    return f"it holds none of {', '.join(TOKENIZER_FILE_NAMES)}"


def _sentencepiece_hint(path: str) -> str:
    """Where a directory holds only a SentencePiece model (Llama 2's, Gemma's tokenizer.model): transformers reads
    it with the sentencepiece package alone, and without it tries it as a tiktoken file, whose error misleads."""
    directory = Path(path)
    if not (directory / "tokenizer.model").is_file() or (directory / "tokenizer.json").is_file():
        return ""
    if importlib.util.find_spec("sentencepiece") is not None:
        return ""
    return "; its tokenizer.model is a SentencePiece model: pip install sentencepiece"


def text_start(hf) -> tuple[int, ...]:
    """The ids a Hugging Face tokenizer adds before a text of its own accord (its post-processor's), as the
    model's pre-training documents began and transformers' pipelines and run_clm encode a text: Llama's
    BOS, nothing for GPT-2's or Qwen's."""
    probe = "a"
    plain, framed = hf(probe, add_special_tokens=False)["input_ids"], hf(probe)["input_ids"]
    for start in range(len(framed) - len(plain) + 1):
        if framed[start:start + len(plain)] == plain:
            return tuple(framed[:start])
    return ()


def document_start(tokenizer: Tokenizer) -> list[int]:
    """What a document begins with in prepared data: the text_start, unless it is the EOD (OPT's </s>
    begins and ends a text), which the previous document's end already puts before it."""
    return [] if tokenizer.text_start == (tokenizer.eod,) else list(tokenizer.text_start)


# what a continued text is encoded after, then left out: a word, which no space, newline or punctuation joins;
# a newline, which no letter joins (a text opening with a letter may merge with the word: "a" + "now")
CONTINUED = ("a", "\n")


def encode_continuing(tokenizer: Tokenizer, text: str, ordinary: bool = False) -> list[int]:
    """The ids of `text` where it goes on from other text: a SentencePiece tokenizer (Llama 2's) begins every
    text it encodes with a space, which there is none of. `ordinary`: special tokens' texts stay text
    (encode_ordinary)."""
    return _continuing(tokenizer, text, ordinary, with_offsets=False)[0]


def encode_continuing_with_offsets(tokenizer: Tokenizer, text: str,
                                   ordinary: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """encode_continuing's ids, with encode_with_offsets' character spans in `text`."""
    return _continuing(tokenizer, text, ordinary, with_offsets=True)


def _continuing(tokenizer: Tokenizer, text: str, ordinary: bool, with_offsets: bool):
    """`text` encoded after the first lead-in whose own ids begin the encoding unchanged, those ids dropped
    (and the offsets moved back by the lead-in's length); `text` alone where no lead-in stays apart."""
    def encode(piece: str):
        if with_offsets:
            return tokenizer.encode_with_offsets(piece, ordinary=ordinary)
        return (tokenizer.encode_ordinary if ordinary else tokenizer.encode)(piece), None

    for before, lead in _lead_ins(tokenizer, ordinary):
        ids, offsets = encode(before + text)
        if ids[:len(lead)] == lead:
            return ids[len(lead):], offsets and [(max(start - len(before), 0), max(end - len(before), 0))
                                                 for start, end in offsets[len(lead):]]
    return encode(text)


@lru_cache(maxsize=8)
def _lead_ins(tokenizer: Tokenizer, ordinary: bool) -> tuple[tuple[str, list[int]], ...]:
    """CONTINUED's texts with their ids, encoded once per tokenizer (a conversation asks for them per chunk)."""
    encode = tokenizer.encode_ordinary if ordinary else tokenizer.encode
    return tuple((before, encode(before)) for before in CONTINUED)


def with_text_start(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A plain text's ids as the model reads a text: after the tokenizer's text_start, unless they begin
    with it already (a prompt that spells out "<s>")."""
    start = list(tokenizer.text_start)
    return ids if ids[:len(start)] == start else start + ids


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Tokenizer:
    """'cl100k_base' / 'o200k_base', or a directory holding Hugging Face tokenizer files."""
    return _load_tokenizer(spec, trust_remote_code, _directory_state(spec))


def _directory_state(spec: str) -> tuple | None:
    """What a directory's tokenizer is read from: its absolute path and its files' identities, sizes and times.
    Cached by the spec alone, a directory retrained or replaced in place (a sweep's tokenizer, a run directory used
    again), or a relative path read from another working directory, gave a process the first tokenizer it loaded:
    prepare-data then wrote the old tokenizer's ids under the new one's fingerprint, found up to date ever after."""
    path = Path(spec)
    if spec in PACKAGED_TIKTOKEN or not path.is_dir():
        return None
    return str(path.resolve()), tuple(sorted(_file_identity(entry) for entry in os.scandir(path) if entry.is_file()))


def _file_identity(entry: os.DirEntry) -> tuple:
    """A file rewritten or replaced changes one of these (a new file, another size, a later time)."""
    stat = entry.stat()
    return entry.name, stat.st_ino, stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=4)
def _load_tokenizer(spec: str, trust_remote_code: bool, directory_state: tuple | None) -> Tokenizer:
    """load_tokenizer's work, once per spec and state of its directory (`directory_state` keys the cache only)."""
    if spec in PACKAGED_TIKTOKEN:
        return TiktokenTokenizer(spec)
    if Path(spec).is_dir():
        return HFTokenizer(spec, trust_remote_code=trust_remote_code)
    if Path(spec).is_absolute() and not Path(spec).exists():  # from-hf's checkpoints name their tokenizer/ so: moved?
        raise TokenizerError(f"data.tokenizer: {spec} does not exist (moved or deleted?): give data.tokenizer= its "
                             "path now (a converted checkpoint's tokenizer/ moves with it)")
    relative = "" if Path(spec).is_absolute() else (
        f" (a relative path is read from the current directory, {Path.cwd()})")
    raise TokenizerError(f"data.tokenizer: {spec!r} is neither one of {PACKAGED_TIKTOKEN} nor a directory of "
                         f"Hugging Face tokenizer files{relative}")
