"""<prefix>.manifest.json: what a prepared dataset was made from, written last as its completion mark.

prepare-data skips its work when the manifest's fingerprint (sources with their sizes and
modification times, text key, tokenizer, token dtype) equals the current one and every indexed
dataset it wrote (the tokens, and a loss mask) still has the .bin/.idx sizes it recorded.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

from megadiff.data.indexed import bin_path, idx_path
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN, Tokenizer, document_start
from megadiff.files import write_atomically

FORMAT = 1
# text every kind of pre-tokenizer and merge meets: a tokenizer retrained with its vocabulary's ids
# unchanged still splits some of it otherwise
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog; it's 2024-11-25, $1,299.99 (#000123456789). "
              "Größe, naïve façade; 東京は2024年に; Ελληνικά; 😀👍🏽 x²+y³\n\n\tindented   spaces\r\nend")
# without a tokenizer.json: the vocabulary files a slow tokenizer is built from
VOCABULARY_FILE_PATTERNS = ("vocab*", "merges*", "*.tiktoken", "*.model", "added_tokens.json")


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def read_manifest(prefix: str | Path) -> Optional[dict]:
    """The manifest, or None where there is none or none prepare-data wrote is there (cut short, overwritten, not
    UTF-8): as for data without one, prepare-data prepares it again and a run skips the checks it would feed. Its
    readers index it as prepare-data writes it: another JSON value (a list, a string) failed them with a TypeError
    or an AttributeError (a traceback from pretrain or prepare-data, not a word on the file)."""
    try:
        manifest = json.loads(manifest_path(prefix).read_text(encoding="utf-8"))
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return manifest if _is_written_as_prepare_data_writes(manifest) else None


# the parts of write_manifest's mapping that its readers index without looking, and the types it writes them as
INDEXED_TYPES = {"sources": list, "tokenizer": dict}


def _is_written_as_prepare_data_writes(manifest) -> bool:
    """A mapping whose fingerprint is one, and those of its parts there are (a fingerprint's sources and tokenizer,
    the stats) of the types write_manifest writes."""
    fingerprint = manifest.get("fingerprint") if isinstance(manifest, dict) else None
    return (isinstance(fingerprint, dict) and isinstance(manifest.get("stats", {}), dict)
            and all(isinstance(fingerprint[key], kind) for key, kind in INDEXED_TYPES.items() if key in fingerprint))


def tokenizer_digest(directory: str | Path) -> str:
    """A hash of how a Hugging Face tokenizer directory splits text: a retrained tokenizer may keep
    its vocabulary size and EOS id, yet tokenize otherwise. Metadata (tokenizer_config.json, a chat
    template) is left out, so an exported copy of the same tokenizer hashes alike."""
    directory = Path(directory)
    fast = directory / "tokenizer.json"
    digest = hashlib.sha256()
    if fast.is_file():
        from tokenizers import Tokenizer as FastTokenizer

        # what it does, not how its file is written (merges and defaults differ between library versions)
        tokenizer = FastTokenizer.from_file(str(fast))
        vocabulary = sorted(tokenizer.get_vocab(with_added_tokens=True).items())
        digest.update(json.dumps([vocabulary, tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids]).encode())
        return digest.hexdigest()
    files = sorted({path for pattern in VOCABULARY_FILE_PATTERNS for path in directory.glob(pattern) if path.is_file()})
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def read_alike(spec: str, other: str) -> bool:
    """Whether two tokenizer directories, whose tokenizer_digests differ, read text into the same ids: a directory
    of vocabulary files alone (vocab.json and merges.txt, no tokenizer.json) hashes its files, and the copy
    transformers saves of it (a converted checkpoint's tokenizer/) its tokenizer.json's behaviour."""
    from transformers import AutoTokenizer

    def behaviour(directory: str) -> str:
        hf = AutoTokenizer.from_pretrained(directory)
        return json.dumps([sorted(hf.get_vocab().items()), hf.encode(PROBE_TEXT, add_special_tokens=False)])

    if not (Path(spec).is_dir() and Path(other).is_dir()):
        return False
    try:
        return behaviour(spec) == behaviour(other)
    except (OSError, ValueError):  # one transformers cannot read: not shown to be alike
        return False


def tokenizer_identity(spec: str) -> Optional[str]:
    """What token ids mean: the packaged encoding's name, or how a tokenizer directory splits text (a copy of it
    elsewhere is the same tokenizer); None for a spec naming neither (loading it says so)."""
    if spec in PACKAGED_TIKTOKEN:
        return spec
    return tokenizer_digest(spec) if Path(spec).is_dir() else None


def tokenizer_fingerprint(spec: str, tokenizer: Tokenizer, documents: bool = True) -> dict:
    """The manifest's tokenizer entry: its spec, ids, and for a directory a hash of how it splits text and,
    for `documents` (not conversations, which begin as their template writes), the ids each begins with
    where there are any (data prepared before documents began with them is prepared again); for tiktoken's
    conversations, that a template's special tokens are read as ids."""
    if spec in PACKAGED_TIKTOKEN:
        # conversations: a template's special tokens (its EOS) became their ids (before: their text's tokens)
        return {"spec": spec, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                **({} if documents else {"template_special_tokens": "ids"})}
    start = document_start(tokenizer) if documents else []
    # a Unigram model's special pieces read as text (before: "</s>" in a document ended it there)
    literal = {"special_texts": "text"} if tokenizer.literal_hf is not tokenizer.hf else {}
    return {"spec": str(Path(spec).resolve()), "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "splits": tokenizer_digest(spec), **({"text_start": start} if start else {}), **literal}


def _output_sizes(outputs: Sequence[str | Path]) -> Optional[list[int]]:
    files = [path for prefix in outputs for path in (bin_path(prefix), idx_path(prefix))]
    return [f.stat().st_size for f in files] if all(f.is_file() for f in files) else None


def is_up_to_date(prefix: str | Path, fingerprint: dict, outputs: Sequence[str | Path]) -> bool:
    """Whether the manifest at `prefix` matches `fingerprint` and the indexed datasets `outputs` are intact
    (call it holding the prefix's lock: an older manifest that matches is rewritten in the current form)."""
    manifest = read_manifest(prefix)
    if not (manifest is not None and manifest.get("format") == FORMAT
            and _same_inputs(manifest.get("fingerprint"), fingerprint)
            and _same_outputs(manifest.get("output_bytes"), _output_sizes(outputs))):
        return False
    if manifest["fingerprint"] != fingerprint:  # so that a later change of what it lacked is seen
        write_manifest(prefix, fingerprint, manifest["stats"], outputs)
    return True


# Manifests written before tokenizer directories were hashed, loss masks' sizes and hub datasets'
# commits recorded hold less: they stand for what they record (the data is taken to be that of the
# tokenizer and commit found now), so upgrading does not tokenize a whole corpus again.

def _same_inputs(recorded: dict | None, current: dict) -> bool:
    if recorded is None:
        return False
    unhashed = {key: value for key, value in current["tokenizer"].items() if key != "splits"}
    uncommitted = [source[:1] if all(isinstance(entry, str) or entry is None for entry in source) else source
                   for source in current["sources"]]  # a hub dataset's [name, commit]; files are lists
    return any(recorded == {**current, **tokenizer, **sources}
               for tokenizer in ({}, {"tokenizer": unhashed}) for sources in ({}, {"sources": uncommitted}))


def _same_outputs(recorded: list | None, sizes: list | None) -> bool:
    """`sizes` (the tokens' .bin/.idx first) against the manifest's, which may hold the tokens' only."""
    return sizes is not None and recorded in (sizes, sizes[:2])


def write_manifest(prefix: str | Path, fingerprint: dict, stats: dict, outputs: Sequence[str | Path]) -> None:
    """Record `fingerprint`, `stats` and the sizes of every indexed dataset written (`outputs`)."""
    manifest = {"format": FORMAT, "fingerprint": fingerprint, "stats": stats, "output_bytes": _output_sizes(outputs)}
    write_atomically(manifest_path(prefix), (json.dumps(manifest, indent=2) + "\n").encode())


def remove_manifest(prefix: str | Path) -> None:
    manifest_path(prefix).unlink(missing_ok=True)
