"""Model-only save/load in the run checkpoint format (conversion, inference, initial loads)."""
from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import arbitrary_address
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from megadiff.checkpoint.format import (
    CONFIG_FILE, CheckpointError, iteration_dir, model_keys, model_sharded_state, saved_iterations,
)
from megadiff.checkpoint.safe_metadata import metadata_read_once
from megadiff.config import Config, dump_config
from megadiff.errors import first_line
from megadiff.helper_processes import follow_the_trainer, socket_directory
from megadiff.parallel import rank_and_world

# TransformerEngine layers keep their FP8 scaling history as `_extra_state`. Checkpoints of
# megatron's local layers, which every conversion writes, have none: a TE model loaded from one
# starts that history afresh, as at initialisation.
EXTRA_STATE = "_extra_state"


def _named(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def first_failure(error: CheckpointException) -> BaseException:
    """The first of the per-rank failures torch's checkpoint reader or writer gathered into `error`."""
    return next(iter(error.failures.values()))[0]


def write_failure(error: Exception) -> str:
    """What a failed write came down to, where this rank holds it: megatron gives the failures to its coordinator
    rank only, as its writers' "Worker failure: <the OSError>" (the OSError itself is lost on the way)."""
    if not isinstance(error, CheckpointException):
        return str(error)
    if not error.failures:  # this rank's own write may be the one that failed
        return "a write failed; rank 0's message names the rank and the error"
    rank = next(iter(error.failures))
    return f"{str(first_failure(error)).removeprefix('Worker failure: ')}, on rank {rank}"


@contextmanager
def damage_reported(checkpoint_dir: str | Path, also: tuple[type[Exception], ...] = ()):
    """A checkpoint's files that cannot be read (missing, cut short, overwritten) as a CheckpointError naming
    the checkpoint, not torch's traceback from inside its reader; `also`: other errors that mean as much where
    the caller reads nothing else."""
    try:
        yield
    except torch.OutOfMemoryError:  # a RuntimeError too, but the device's, not the files'
        raise
    except CheckpointException as error:
        failure = first_failure(error)
        if isinstance(failure, OSError):
            raise CheckpointError(f"{checkpoint_dir} cannot be read whole ({failure}): a checkpoint copied or "
                                  f"written in part? Its metadata names files it lacks.{_others(checkpoint_dir)}"
                                  ) from None
        raise _damaged(checkpoint_dir, failure) from error
    except OSError as error:  # its metadata itself (.metadata) missing or unreadable
        raise CheckpointError(f"{checkpoint_dir} cannot be read whole ({error}): a checkpoint copied or written "
                              f"in part?{_others(checkpoint_dir)}") from None
    except (json.JSONDecodeError, pickle.UnpicklingError, EOFError, *also) as error:
        raise _damaged(checkpoint_dir, error) from error


def _damaged(checkpoint_dir: str | Path, error: BaseException) -> CheckpointError:
    return CheckpointError(f"{checkpoint_dir} is damaged: a file of it cannot be read "
                           f"({type(error).__name__}: {first_line(error)}).{_others(checkpoint_dir)}")


def _others(checkpoint_dir: str | Path) -> str:
    """The run's other whole checkpoints, which a run or command can use instead."""
    others = [iteration_dir(Path(checkpoint_dir).parent, iteration)
              for iteration in saved_iterations(Path(checkpoint_dir).parent)]
    others = [str(path) for path in others if path.resolve() != Path(checkpoint_dir).resolve()]
    return f" The run's other checkpoints: {', '.join(others)}" if others else ""


def require_common_file(checkpoint_dir: str | Path) -> None:
    """Inside damage_reported: megatron's own report of a missing common.pt fails (an AttributeError, calling
    Path.iterdir on the str path it requires)."""
    common = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if not common.is_file():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(common))


def load_sharded(request: dict, checkpoint_dir: str | Path) -> dict:
    """dist_checkpointing.load of `request`; only TE's `_extra_state` may be absent from the checkpoint."""
    with damage_reported(checkpoint_dir, also=(RuntimeError,)):  # torch.load of a common.pt cut short
        require_common_file(checkpoint_dir)
        with metadata_read_once(checkpoint_dir):
            loaded, _, absent = dist_checkpointing.load(request, str(checkpoint_dir),
                                                        strict=StrictHandling.RETURN_UNEXPECTED)
    required = sorted(key for key in absent if not key.endswith(EXTRA_STATE))
    if required:
        raise CheckpointError(f"{checkpoint_dir} lacks {len(required)} saved tensors this run needs: "
                              f"{_named(required)}")
    return loaded


def load_into_chunks(chunks: list, loaded: dict) -> None:
    """Loaded model state into its chunks: every weight, TE's `_extra_state` where it was saved."""
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        result = chunk.load_state_dict(loaded[key], strict=False)
        problems = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)] + list(result.unexpected_keys)
        if problems:
            raise CheckpointError(f"{key} does not match the checkpoint: {_named(problems)}")


def merged_in_place(sharded_state: dict) -> dict:
    """`sharded_state` (in place) whose factories' merges give back their own tensor where the load filled its
    pieces in place. megatron describes SwiGLU's fc1 as its two halves (views of the parameter, which the load fills)
    and merges them after the load with torch.cat: a copy of every fc1 (about 40% of a SwiGLU model's weights) held
    at once until the weights are copied into the model, on its device."""
    def merging_in_place(factory):
        if isinstance(factory, ShardedTensorFactory):
            return replace(factory, merge_fn=_merge_in_place(factory.data, factory.merge_fn))
        return factory

    return dict_list_map_inplace(merging_in_place, sharded_state)


def _merge_in_place(whole: torch.Tensor, merge_fn):
    def merge(loaded):
        pieces = list(nested_values(loaded))
        filled = whole.device.type != "meta" and all(isinstance(piece, torch.Tensor) for piece in pieces) and \
            sum(piece.numel() for piece in pieces) == whole.numel() and \
            all(piece.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for piece in pieces)
        return whole if filled else merge_fn(loaded)  # filled: the pieces the factory built, views of `whole`

    return merge


def written_uncopied(sharded_state: dict) -> dict:
    """`sharded_state` (in place) whose factories build host shards over their parameter's memory, each with a
    storage of its own. megatron describes SwiGLU's fc1 as its two halves, views of the parameter, and its writer
    clones every host tensor that is a view (torch.save would write the whole storage) before it writes any: a copy
    of every fc1 (about 40% of a SwiGLU model's weights, 75 GB for a converted Llama 70B in bf16) beside the model
    while from-hf wrote it. The same bytes are written."""
    def building_uncopied(factory):
        if isinstance(factory, ShardedTensorFactory) and factory.data.device.type == "cpu":
            return replace(factory, build_fn=_over_their_own_storage(factory.build_fn))
        return factory

    return dict_list_map_inplace(building_uncopied, sharded_state)


def _over_their_own_storage(build_fn):
    def build(*args):
        return dict_list_map_inplace(_with_a_storage_of_its_own, build_fn(*args))

    return build


def _with_a_storage_of_its_own(shard):
    data = shard.data if isinstance(shard, ShardedTensor) else None
    if data is None or not data.is_contiguous() or data.untyped_storage().nbytes() == data.nbytes:
        return shard
    # numpy's array over the view's bytes keeps the parameter alive; the tensor made from it has a storage of
    # exactly those bytes, which the writer takes as it is
    memory = torch.from_numpy(data.detach().view(torch.uint8).numpy())
    return replace(shard, data=memory.view(data.dtype).view(data.shape))


def load_model_weights(chunks: list, checkpoint_dir: str | Path) -> None:
    """Load a checkpoint's model weights into unwrapped GPTModel chunks of any TP/PP layout."""
    load_into_chunks(chunks, load_sharded(merged_in_place(model_sharded_state(chunks)), checkpoint_dir))


def start_write_results_queue() -> None:
    """megatron's checkpoint writers report through a manager process it spawns at the first save. A spawned
    process takes the default action of Slurm's preemption signals (they reach every process of the job step),
    so it died as the preemption checkpoint was being written, and the save with it; and it outlived a process
    killed outright (a conversion's: minutes, holding its output pipe). Started here, it ignores the signals and
    exits with the process that started it. Its socket is named here (the spawned manager would name it under
    TMPDIR, which may be too long for one)."""
    if filesystem_async._results_queue is None:
        socket_directory()  # the directory arbitrary_address names the socket in
        manager = SyncManager(address=arbitrary_address("AF_UNIX"), ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=follow_the_trainer, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps the manager running


def save_model_weights(chunks: list, cfg: Config, checkpoint_dir: str | Path) -> None:
    """Write a model-only checkpoint (no optimizer), e.g. after converting from Hugging Face."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    start_write_results_queue()
    dist_checkpointing.save(written_uncopied(model_sharded_state(chunks)), str(checkpoint_dir))
    if rank_and_world()[0] == 0:
        dump_config(cfg, checkpoint_dir / CONFIG_FILE)
