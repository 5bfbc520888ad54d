"""Checks pre-training runs on its data before any compute; each error names the file or key.

Call after `ensure_prepared` (and its barrier) and before `build_datasets`: megatron's own
builder would otherwise assert deep inside, misread the files, or loop forever on a split
without tokens.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from functools import cache
from pathlib import Path
from typing import Callable, Collection

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix, parse_and_normalize_split,
)

from megadiff.config import Config, DataConfig
from megadiff.data.conversations import chat_template_of
from megadiff.data.errors import DataError
from megadiff.data.indexed import (
    IndexSummary, bin_path, idx_path, loss_mask_prefix, open_index, read_index, refuse_too_many_documents,
    refuse_unprepared, token_dtype,
)
from megadiff.data.locations import index_cache_dir, training_blend
from megadiff.data.manifest import read_manifest, tokenizer_fingerprint
from megadiff.data.tokenizers import PACKAGED_TIKTOKEN, Tokenizer, document_start
from megadiff.errors import refused_together

SPLITS = ("train", "valid", "test")


def check_training_data(cfg: Config, tokenizer: Tokenizer, splits_read: Collection[str] = SPLITS) -> None:
    """The data's vocabulary, tokenizer, masks, and each split of `splits_read` holding a sample."""
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the vocabulary of data.tokenizer "
                        f"{cfg.data.tokenizer!r} ({tokenizer.vocab_size} ids); set model.vocab_size >= "
                        f"{tokenizer.vocab_size}")
    key = _data_key(cfg)
    encoding = _encoding_reader(cfg, tokenizer)
    prepared = _read_prepared(cfg)
    _check_tokenizers(cfg, tokenizer, encoding, prepared)
    for prefix, summary, manifest in prepared:
        _check_splits(prefix, summary, cfg, key, splits_read)
        _warn_of_an_earlier_encoding(prefix, manifest, encoding)
        if cfg.data.masks_loss:
            _check_loss_mask(prefix, summary, cfg.data)
            _check_same_masking(prefix, manifest, cfg, tokenizer)
            if cfg.data.document_masking:
                _check_documents_whole(prefix, manifest)
        else:
            _warn_of_a_loss_mask_left_out(prefix, manifest, key)


def check_training_data_once(cfg: Config, tokenizer: Tokenizer, splits_read: Collection[str] = SPLITS) -> None:
    """check_training_data on one rank of a process group (the first; collective: every rank raises where it
    refuses): its checks read every document's length, 4 bytes a document (8 GB for a 1T-token corpus), which every
    rank of a 1,000-rank job read from the shared filesystem at each start. The others check that the files they
    read themselves (a node's own copy) are whole, a few bytes each."""
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    refused_together(lambda: check_training_data(cfg, tokenizer, splits_read) if first else _check_files_whole(cfg))


def _check_files_whole(cfg: Config) -> None:
    key = _data_key(cfg)
    for prefix in training_blend(cfg.data)[0]:
        open_index(prefix, key)
        if cfg.data.masks_loss and idx_path(loss_mask_prefix(prefix)).is_file():  # a missing one: rank 0 names it
            open_index(loss_mask_prefix(prefix), cfg.data.loss_mask_key)


def _data_key(cfg: Config) -> str:
    return "data.blend" if cfg.data.blend else "data.prefix"


def _encoding_reader(cfg: Config, tokenizer: Tokenizer) -> Callable[[bool], dict]:
    """How data of each kind (documents or conversations) is prepared now: read once, if a manifest asks."""
    return cache(lambda documents: tokenizer_fingerprint(cfg.data.tokenizer, tokenizer, documents=documents))


def _read_prepared(cfg: Config) -> list[tuple[str, IndexSummary, dict | None]]:
    """(prefix, its checked index, its manifest) of each prefix of cfg's data, read once for all the checks."""
    key = _data_key(cfg)
    return [(prefix, _checked_index(prefix, key, cfg.data), read_manifest(prefix))
            for prefix in training_blend(cfg.data)[0]]


def _checked_index(prefix: str, key: str, data: DataConfig) -> IndexSummary:
    """read_index (every document's length read: 8 GB for a 1T-token corpus, at each start) once per prepared
    data; a later start finds its mark and opens the index (a few bytes read)."""
    refuse_unprepared(prefix, key)
    mark = _check_mark(data, [prefix], "index")
    if mark.is_file():
        return open_index(prefix, key)
    summary = read_index(prefix, key)
    _set(mark)
    return summary


def _check_mark(data: DataConfig, prefixes: list[str], check: str) -> Path:
    """Where a check of every document of `prefixes` that passed is marked: beside megatron's indices, named by
    their files' paths, sizes and modification times, so data prepared again, or changed in place, is checked
    again."""
    files = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
             for prefix in prefixes for path in (bin_path(prefix), idx_path(prefix))]
    return index_cache_dir(data) / f"{hashlib.sha256(json.dumps(files).encode()).hexdigest()[:32]}-{check}-checked"


def _set(mark: Path) -> None:
    """Marked where the cache can be written (megatron writes its indices there); else checked again next time."""
    with contextlib.suppress(OSError):
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()


def check_prepared_with(cfg: Config, tokenizer: Tokenizer) -> None:
    """Each prefix of cfg's data was prepared with `tokenizer` (or a copy of it): read with another, its ids would
    stand for other text."""
    _check_tokenizers(cfg, tokenizer, _encoding_reader(cfg, tokenizer), _read_prepared(cfg))


def _check_tokenizers(cfg: Config, tokenizer: Tokenizer, encoding: Callable[[bool], dict],
                      prepared: list[tuple[str, IndexSummary, dict | None]]) -> None:
    """check_prepared_with on `prepared` (_read_prepared's); `encoding`: an _encoding_reader the caller reads too."""
    # how the tokenizer splits text (a directory's hash, None for tiktoken's): the same reading, not a second one
    splits = lambda: encoding(True).get("splits")  # noqa: E731
    for prefix, summary, manifest in prepared:
        _check_tokenizer(prefix, summary, manifest, tokenizer, cfg.data.tokenizer, splits,
                         cfg.data.messages_key is not None)


def _check_tokenizer(prefix: str, summary: IndexSummary, manifest: dict | None, tokenizer: Tokenizer,
                     spec: str, splits: Callable[[], str | None], conversations: bool) -> None:
    prepared = manifest["fingerprint"]["tokenizer"] if manifest else None
    if prepared is not None and (prepared["vocab_size"], prepared["eod"]) != (tokenizer.vocab_size, tokenizer.eod):
        raise DataError(f"data.tokenizer: {prefix} was prepared with tokenizer {prepared['spec']!r} "
                        f"({prepared['vocab_size']} ids), not {spec!r} ({tokenizer.vocab_size} ids); "
                        "prepare it again with this tokenizer")
    if summary.dtype.itemsize < token_dtype(tokenizer.vocab_size).itemsize:
        raise DataError(f"data.tokenizer: {prefix}.bin stores {summary.dtype} ids, too narrow for {spec!r} "
                        f"({tokenizer.vocab_size} ids): it was prepared with another tokenizer")
    if prepared is not None and "splits" in prepared and splits() not in (None, prepared["splits"]):
        raise DataError(f"data.tokenizer: {prefix} was prepared with tokenizer {prepared['spec']!r}, which split text "
                        f"otherwise than {spec!r} now does (the same vocabulary size and EOD, but another "
                        "vocabulary, merges or normalisation, e.g. retrained): its tokens would mean other text; "
                        "prepare it again")
    start = document_start(tokenizer)
    if prepared is not None and start and not conversations and prepared.get("text_start") != start:
        warnings.warn(f"data.tokenizer: {prefix} was prepared before documents began with the tokenizer's "
                      f"{start} (e.g. Llama's BOS), which prompts, evaluations and Hugging Face pipelines put "
                      "before a text: prepare it again (prepare-data does so) for a model that reads texts as "
                      "they are given to it", stacklevel=2)


# what the manifests of data prepared now record of its encoding, and what earlier megadiffs did otherwise
ENCODING_CHANGES = {"conversation_encoding": "its conversations were tokenized turn by turn (the tokens at a turn's "
                                             "edges differ from a chat prompt's)",
                    "pair_encoding": "its prompts and responses were tokenized apart",
                    "without_prompt": "its records without a prompt were trained on their response alone",
                    "first_token": "a document's first token (with tiktoken, an empty prompt's response's, or an "
                                   "opening assistant turn's) took the loss, learnt from the document packed before it",
                    "split_characters": "with tiktoken, a token holding the first bytes of a reply's first character "
                                        "took no loss",
                    "generation_blocks": "its chat template's {% generation %} blocks written by a macro or inside a "
                                         "filter gave the loss to the text before the assistant's"}
TOKENIZER_CHANGES = {"template_special_tokens": "its chat template's special tokens (its EOS) were read as text, "
                                                "which the model would learn to write instead of stopping",
                     "special_texts": "the tokenizer read a document's literal </s> as its end"}


def _warn_of_an_earlier_encoding(prefix: str, manifest: dict | None, encoding: Callable[[bool], dict]) -> None:
    """Data an earlier megadiff prepared otherwise than prepare-data now does, as CHANGELOG's upgrade notes
    say: prepare-data prepares it again, but a run reading the prefix said nothing of it."""
    if manifest is None:
        return
    prepared = manifest["fingerprint"]
    pairs, conversations = "response_key" in prepared, "messages_key" in prepared
    tiktoken = prepared.get("tokenizer", {}).get("spec") in PACKAGED_TIKTOKEN
    # the data each marker is recorded for now (prepare's _fingerprint)
    marked_for = {"conversation_encoding": conversations, "pair_encoding": pairs, "without_prompt": pairs,
                  "first_token": pairs or conversations, "split_characters": (pairs or conversations) and tiktoken,
                  "generation_blocks": conversations}
    stale = [why for marker, why in ENCODING_CHANGES.items() if marked_for[marker] and marker not in prepared]
    stale += [why for marker, why in TOKENIZER_CHANGES.items()
              if marker not in prepared.get("tokenizer", {}) and marker in encoding("messages_key" not in prepared)]
    if stale:
        warnings.warn(f"data.prefix: {prefix} was prepared by an earlier megadiff: {'; '.join(stale)}. Prepare it "
                      "again (prepare-data does so) before training on it", stacklevel=2)


def _check_same_masking(prefix: str, manifest: dict | None, cfg: Config, tokenizer: Tokenizer) -> None:
    """Conversations prepared with another chat template (or prompt/response data read as conversations): the
    run's config, which chat, generate and the export read, would name a template the model never saw."""
    prepared = manifest["fingerprint"] if manifest else {}
    if not ({"response_key", "messages_key"} & prepared.keys()):
        return  # plain text (the loss mask check refuses it), or a manifest from before these were recorded
    data, mask_key = cfg.data, cfg.data.loss_mask_key
    kind = mask_key.removeprefix("data.")
    if prepared.get(kind) is None:
        other = next(key for key in ("response_key", "messages_key") if prepared.get(key) is not None)
        raise DataError(f"{mask_key}: {prefix} was prepared with data.{other}={prepared[other]}, not {mask_key}; "
                        "set the key it was prepared with, or prepare it again")
    template = chat_template_of(data, tokenizer) if data.messages_key is not None else None
    if template is not None and hashlib.sha256(template.encode()).hexdigest() != prepared.get("chat_template"):
        source = "data.chat_template" if data.chat_template is not None else "the tokenizer's"
        raise DataError(f"data.chat_template: {prefix} was prepared with another chat template than this run's "
                        f"({source}): chat, generate --chat and the export would prompt the model in a format it "
                        "was not tuned on. Set the template it was prepared with, or prepare it again")


def _warn_of_a_loss_mask_left_out(prefix: str, manifest: dict | None, key: str) -> None:
    """Prompt/response data or conversations read without their key take the loss on every token, the
    prompts' and the user's turns' too: allowed (a baseline), but never unsaid."""
    prepared = manifest["fingerprint"] if manifest else {}
    for mask_key in ("response_key", "messages_key"):
        if prepared.get(mask_key) is not None:
            warnings.warn(f"{key}: {prefix} was prepared with data.{mask_key}={prepared[mask_key]}, not set here: "
                          "the loss is taken on every token, prompts included (set it to train on what it marks)",
                          stacklevel=2)


def _check_loss_mask(prefix: str, summary: IndexSummary, data: DataConfig) -> None:
    """Prompt/response and conversation data need the loss mask prepare-data writes beside their
    tokens, document for document (compared once per prepared data, as _checked_index reads it)."""
    key, mask_prefix = data.loss_mask_key, loss_mask_prefix(prefix)
    if not idx_path(mask_prefix).is_file():
        raise DataError(f"{key}: {prefix} has no loss mask ({mask_prefix}.bin/.idx): it was prepared "
                        f"without {key}; prepare it again with it")
    refuse_unprepared(mask_prefix, key)
    mark = _check_mark(data, [prefix, mask_prefix], "loss-mask")
    if mark.is_file():
        open_index(mask_prefix, key)
        return
    mask = read_index(mask_prefix, key)
    if not np.array_equal(mask.sequence_lengths, summary.sequence_lengths):
        raise DataError(f"{key}: {mask_prefix} does not describe the documents of {prefix}; prepare "
                        "the data again")
    _set(mark)


def _check_documents_whole(prefix: str, manifest: dict | None) -> None:
    """Document masking cuts at every EOD: prompt/response or conversation documents that hold the
    EOD inside (prepare-data counts them) would lose the context of their later turns."""
    inner = manifest["stats"].get("inner_eods", 0) if manifest else 0
    if inner:
        eod = manifest["fingerprint"]["tokenizer"]["eod"]
        raise DataError(f"data.document_masking: {prefix} holds the tokenizer's EOD (id {eod}) {inner:,} times inside "
                        "its documents (e.g. a chat template that ends every turn with the EOS token, as SmolLM2's "
                        "<|im_end|>): document masking would cut each conversation at every turn; set "
                        "data.document_masking=false")


def split_documents(summary: IndexSummary, split: str) -> dict[str, tuple[int, int, int]]:
    """{split name: (first document, end document, tokens)} for each split `split` (data.split) gives
    a share: the same document ranges megatron's BlendedMegatronDatasetBuilder cuts."""
    count = len(summary.sequence_lengths)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    ranges = {name: (int(round(bounds[0] * count)), int(round(bounds[1] * count)))
              for name, bounds in zip(SPLITS, matrix) if bounds is not None}
    return {name: (begin, end, summary.tokens_between(begin, end)) for name, (begin, end) in ranges.items()}


def split_tokens(prefix: str, data_split: str, split: str) -> np.ndarray | None:
    """The tokens of `split`'s documents of `prefix`, one after another (EOD ids between them, as
    prepared), memory-mapped from the stretch of its .bin they fill: a copy (or an offset per
    document) would grow with the corpus. None when `data_split` gives `split` no documents. The index is opened,
    not read whole: the split's bounds need a few of its entries, where reading every document's length took 4
    bytes a document (6 GB for a 1T-token corpus) at each needles or recall run."""
    summary = open_index(prefix)
    splits = split_documents(summary, data_split)
    if split not in splits:
        return None
    begin, _, tokens = splits[split]
    start = summary.tokens_between(0, begin)
    return np.memmap(bin_path(prefix), dtype=summary.dtype, mode="r")[start:start + tokens]


def _check_splits(prefix: str, summary: IndexSummary, cfg: Config, key: str, splits_read: Collection[str]) -> None:
    """Every split of `splits_read` that data.split gives a share must hold at least one sample (seq_length + 1
    tokens); the others are never built (pre-training reads no test split)."""
    count = len(summary.sequence_lengths)
    refuse_too_many_documents(count, prefix)  # prepared by another tool
    if summary.tokens == 0:
        raise DataError(f"{key}: {prefix} holds no tokens ({count} documents); prepare it from non-empty text")
    needed = cfg.model.seq_length + 1
    for name, (begin, end, tokens) in split_documents(summary, cfg.data.split).items():
        if name in splits_read and tokens < needed:
            raise DataError(f"model.seq_length: the {name} split of {prefix} (documents {begin}..{end} of {count}, "
                            f"data.split={cfg.data.split}) holds {tokens} tokens, fewer than one sample of "
                            f"model.seq_length + 1 = {needed}; lower model.seq_length, add data, or give that "
                            "split weight 0 in data.split")
