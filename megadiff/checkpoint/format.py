"""On-disk layout of a run and its checkpoints (shared by training, conversion and inference).

    OUTPUT_DIR/
      config.yaml                       resolved config of the run
      checkpoints/
        latest_checkpointed_iteration.txt   the commit marker: written last, after a save completed
        iter_0000100/                   megatron dist_checkpointing (torch_dist), any TP/PP layout
          config.yaml                   the config the weights belong to
          ...

A checkpoint holds the model under "model" ("model0", "model1", ... with
virtual pipeline chunks); sharded keys are global, so it loads into any layout.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from megadiff.config import Config
from megadiff.config.loader import read_saved_config, saved_config
from megadiff.errors import MegadiffError
from megadiff.files import ITERATION_PREFIX, iteration_dir, numbered_dirs, reading

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest_checkpointed_iteration.txt"
CONFIG_FILE = "config.yaml"
# a checkpoint may carry its own Hugging Face tokenizer files here (from-hf and pre-training write them)
TOKENIZER_DIR = "tokenizer"


def checkpoint_tokenizer_spec(checkpoint_dir: str | Path, cfg: Config) -> str:
    """The tokenizer a checkpoint's embeddings stand for: its own copy (tokenizer/), else its data.tokenizer."""
    local = Path(checkpoint_dir) / TOKENIZER_DIR
    return str(local) if local.is_dir() else cfg.data.tokenizer


class CheckpointError(MegadiffError, RuntimeError):
    """A checkpoint path that cannot be used."""


def read_latest_iteration(checkpoints_dir: str | Path) -> int | None:
    marker = Path(checkpoints_dir) / LATEST_FILE
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker}: expected an iteration number, found {text!r}")
    return int(text)


def saved_iterations(checkpoints_dir: str | Path) -> list[int]:
    """The iterations of the whole checkpoints in `checkpoints_dir` (committed: named, with their metadata)."""
    return [iteration for iteration, path in numbered_dirs(checkpoints_dir, ITERATION_PREFIX)
            if (path / "metadata.json").is_file()]


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The checkpoint the marker names, else the newest whole one (a crash between a first commit's rename
    and its marker, or checkpoints copied without the marker: starting afresh would overwrite their run);
    None where there is none. A marker naming a removed checkpoint is refused."""
    iteration = read_latest_iteration(checkpoints_dir)
    saved = saved_iterations(checkpoints_dir)
    if iteration is None:
        return iteration_dir(checkpoints_dir, saved[-1]) if saved else None
    path = iteration_dir(checkpoints_dir, iteration)
    if iteration not in saved:  # committed once, since damaged: megatron's error would not name the marker
        fix = (f"write the iteration to resume from ({', '.join(map(str, saved))}) into it" if saved
               else "remove it to start afresh")
        state = "missing" if not path.is_dir() else "not a whole checkpoint (its metadata.json is gone)"
        raise CheckpointError(f"{Path(checkpoints_dir) / LATEST_FILE} names iteration {iteration}, but {path} is "
                              f"{state}: {fix}, or use a new output_dir")
    return path


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A run's output_dir, its checkpoints/ directory (-> latest) or one iteration's directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path does not exist: {path}")
    if (path / CHECKPOINTS_DIR).is_dir():
        path = path / CHECKPOINTS_DIR
    if not (path / "metadata.json").is_file():  # a checkpoints/ directory: its marker's, or its newest whole one
        path = latest_checkpoint(path) or path
    if not (path / "metadata.json").is_file() or not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path} is not a megadiff checkpoint (no metadata.json / {CONFIG_FILE}); pass a run's "
                              "output_dir, its checkpoints/ directory or an iter_* directory")
    return path


@contextlib.contextmanager
def reading_checkpoint(path: str | Path) -> Iterator[Path]:
    """resolve_checkpoint_dir(path), kept from checkpoint.keep_last's removal while the block reads it: a run
    still training removes its older checkpoints as it commits new ones, the one just resolved among them."""
    for _ in range(3):
        checkpoint_dir = resolve_checkpoint_dir(path)
        with reading(checkpoint_dir):
            if (checkpoint_dir / "metadata.json").is_file():  # not removed before the lock was taken
                yield checkpoint_dir
                return
    raise CheckpointError(f"{path}: its latest checkpoint was removed three times as it was about to be read "
                          "(checkpoint.keep_last of a run saving that often): try again, or once the run stops")


# keys that earlier megadiff versions wrote into checkpoints' config.yaml and that no longer
# exist: dropped on reading, so checkpoints saved before their removal still load
RETIRED_CONFIG_KEYS = {"logging": ("rank0_only",)}


def checkpoint_config(checkpoint_dir: str | Path) -> Config:
    saved = read_saved_config(Path(checkpoint_dir) / CONFIG_FILE)
    for section, keys in RETIRED_CONFIG_KEYS.items():
        for key in keys:
            (saved.get(section) or {}).pop(key, None)
    return saved_config(saved)


def model_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_sharded_state(chunks: list) -> dict:
    """{"model": chunk.sharded_state_dict()} (or model0, model1, ...) for unwrapped GPTModel chunks."""
    return {key: chunk.sharded_state_dict() for key, chunk in zip(model_keys(len(chunks)), chunks)}
