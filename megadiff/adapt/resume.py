"""The DeepSpeed checkpoint an adaptation rerun resumes from: its marker checked before the minutes of start-up
(model, head selection, DeepSpeed), its files' damage named when DeepSpeed reads them (a traceback from inside
torch.load or a bare AssertionError of DeepSpeed's file list, before)."""
from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import torch

from megadiff.adapt.deepspeed_setup import NO_WEIGHT_DECAY
from megadiff.adapt.settings import TrainSection
from megadiff.config import ConfigError
from megadiff.errors import MegadiffError
from megadiff.files import ITERATION_PREFIX, numbered_dirs

LATEST_FILE = "latest"  # beside the checkpoints: the tag a rerun resumes from (DeepSpeed's name for it)
MODEL_STATES = "*model_states.pt"  # one at least in every DeepSpeed checkpoint, whatever the ZeRO stage
OPTIMIZER_STATES = "*optim_states.pt"  # one a data-parallel rank


class DamagedCheckpoint(MegadiffError):
    """A checkpoint of the run that cannot be resumed from."""


def whole_checkpoints(checkpoint_dir: Path) -> list[str]:
    return [path.name for _, path in numbered_dirs(checkpoint_dir, ITERATION_PREFIX) if any(path.glob(MODEL_STATES))]


def resume_point(checkpoint_dir: Path, rank: int, world: int) -> Path | None:
    """The checkpoint the marker names (None without a marker: a first run), refused where it is no whole one,
    was written by another number of data-parallel ranks than `world`, or lacks this rank's optimizer shard
    (each rank reads its own: one failing alone would leave the others waiting in DeepSpeed's collectives)."""
    marker = checkpoint_dir / LATEST_FILE
    if not marker.is_file():
        return None
    tag = marker.read_text(errors="replace").strip()
    path = checkpoint_dir / tag
    if not (tag.startswith(ITERATION_PREFIX) and "/" not in tag and any(path.glob(MODEL_STATES))):
        whole = whole_checkpoints(checkpoint_dir)
        fix = f"write the one to resume from ({', '.join(whole)}) into it" if whole else "remove it to start afresh"
        raise DamagedCheckpoint(f"{marker} names {tag!r}, which is no whole checkpoint in {checkpoint_dir}: {fix}, "
                                "or give a new output_dir")
    _check_written_by(path, world)
    shard = f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # with a bf16_ prefix under DeepSpeed's bf16 optimizer
    if any(path.glob(OPTIMIZER_STATES)) and not any(path.glob(shard)):
        raise DamagedCheckpoint(f"{path} lacks rank {rank}'s optimizer state ({shard}): a checkpoint copied in "
                                f"part?{_others(path)}")
    return path


def _check_written_by(checkpoint: Path, world: int) -> None:
    """Refuse a checkpoint written by another number of data-parallel ranks. ZeRO partitions Adam's state among
    the ranks that wrote it, and DeepSpeed cannot partition it anew: 2 ranks -> 1 failed in DeepSpeed's load
    after the model and its engine were built, 1 -> 2 was called a checkpoint copied in part."""
    written_by = _data_parallel_size(checkpoint)
    if written_by is not None and written_by != world:
        raise ConfigError(f"{checkpoint} was written by {written_by} data-parallel rank(s), and this run has {world}: "
                          "DeepSpeed ZeRO keeps the optimizer state partitioned among the ranks that wrote it. Resume "
                          f"on {written_by} rank(s) (train.grad_accum sets the global batch) or give a new output_dir")


def _data_parallel_size(checkpoint: Path) -> int | None:
    """The data-parallel size DeepSpeed recorded in the checkpoint's model states (read memory-mapped: its
    tensors stay on disk); None where they cannot be read, damage that DeepSpeed's load names (damage_named)."""
    try:
        states = torch.load(min(checkpoint.glob(MODEL_STATES)), map_location="cpu", mmap=True, weights_only=True)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError):
        return None
    return states.get("dp_world_size") if isinstance(states, dict) else None


@contextlib.contextmanager
def damage_named(checkpoint: Path):
    """DeepSpeed's load of `checkpoint`: a file missing or cut short as a DamagedCheckpoint naming it."""
    try:
        yield
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, AssertionError) as error:
        if isinstance(error, torch.OutOfMemoryError):  # a RuntimeError too, but the device's, not the files'
            raise
        detail = str(error).splitlines()[0] if str(error) else "a file it lists is missing"
        raise DamagedCheckpoint(f"{checkpoint} cannot be resumed from ({type(error).__name__}: {detail}): a "
                                f"checkpoint copied or written in part?{_others(checkpoint)}") from error


def _others(checkpoint: Path) -> str:
    others = [name for name in whole_checkpoints(checkpoint.parent) if name != checkpoint.name]
    return f" The run's other checkpoints: {', '.join(others)} (name one in {LATEST_FILE})" if others else ""


def keep_this_runs_adam_settings(optimizer, train: TrainSection) -> None:
    """After a checkpoint is loaded: Adam's betas, eps and weight decay are this run's config's. Loading the
    optimizer state (torch's Optimizer.load_state_dict, under every ZeRO stage) replaced them with the saving
    run's, so a rerun that changed them trained on with the old ones, silently (its clipping, a DeepSpeed engine
    setting, and its lr schedule followed the config). Biases and norm weights stay undecayed."""
    for group in optimizer.param_groups:
        group.update(betas=tuple(train.adam_betas), eps=train.adam_eps,
                     weight_decay=0.0 if group.get(NO_WEIGHT_DECAY) else train.weight_decay)
