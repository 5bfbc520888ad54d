"""Training checkpoints: model, optimizer, training state and RNG, committed atomically.

A save writes `iter_NNNNNNN.partial/` with megatron dist_checkpointing, then (after every rank
finished) rank 0 renames it to `iter_NNNNNNN/` and only then rewrites the latest marker. A crash
at any point (kill -9 included) leaves the previous checkpoint and marker untouched; leftover
`.partial` directories are removed by the next save (pre-training: as its next run starts). With
`async_save` the files are written in the background and the commit runs when every rank's write
has finished.

The training state (iteration, consumed samples, LR schedule, ...) is a plain dict stored in
dist_checkpointing's common state. RNG states are stored per global rank and restored only when
the layout (world size, TP, PP, CP) is unchanged; any layout can load the rest (resharding).
"""
from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint.api import CheckpointException

from megadiff.checkpoint.format import (
    CONFIG_FILE, LATEST_FILE, TOKENIZER_DIR, CheckpointError, iteration_dir, model_sharded_state,
    read_latest_iteration,
)
from megadiff.checkpoint.optimizer_state import (
    load_optimizer_state, main_params_unlike_weights, optimizer_sharded_state,
)
from megadiff.checkpoint.weights import (
    damage_reported, load_into_chunks, load_sharded, merged_in_place, require_common_file, start_write_results_queue,
    write_failure,
)
from megadiff.config import Config, dump_config
from megadiff.config.validate import gradient_bucket_numel
from megadiff.data.tokenizers import Tokenizer
from megadiff.errors import refused_together
from megadiff.files import commit_iteration, remove_staging_leftovers, staging_dir
from megadiff.parallel import rank_and_world, wait_for_ranks

TRAIN_STATE_KEY = "train_state"
RNG_KEY = "rng_state"
# the distributed optimizer's checkpoint.optimizer_format and the layout it was saved in (common state): a load
# reads the format the checkpoint holds, and the parallel one loads into its own layout only
OPTIMIZER_FORMAT_KEY = "optimizer_format"


def optimizer_layout(cfg: Config, world_size: int) -> dict:
    """What lays out the distributed optimizer's buckets on each rank, but for the data-parallel size: the
    parallel format's parts of a bucket reshard over data-parallel ranks alone. TransformerEngine's layers hold
    other parameters in another order than the local ones, which a continued run may change to."""
    parallel = cfg.parallel
    return {"tensor": parallel.tensor, "pipeline": parallel.pipeline, "virtual_pipeline": parallel.virtual_pipeline,
            "context": parallel.context, "gradient_bucket_numel": gradient_bucket_numel(parallel, world_size),
            "transformer_impl": cfg.model.transformer_impl}


def saved_optimizer_format(checkpoint_dir: str | Path) -> dict:
    """{"format": checkpoint.optimizer_format, "layout": optimizer_layout} of a checkpoint's distributed
    optimizer state; a checkpoint saved before the choice existed is reshardable."""
    with damage_reported(checkpoint_dir, also=(RuntimeError,)):
        require_common_file(checkpoint_dir)
        common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    return common.get(OPTIMIZER_FORMAT_KEY, {"format": "reshardable"})


def _rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
              "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _rng_sharded_object(states: dict | None) -> ShardedObject:
    rank, world = rank_and_world()
    return ShardedObject(RNG_KEY, states, (world,), (rank,), replica_id=0)


def save_strategy(fully_parallel: bool):
    """dist_checkpointing's save strategy: with `fully_parallel` (checkpoint.fully_parallel_save), the tensors that
    data-parallel ranks hold alike (the model's weights, replicated over DP) are written by one of them each, spread
    evenly, as Megatron-LM's --ckpt-fully-parallel-save: without it each tensor/pipeline shard's data-parallel rank 0
    wrote them all, its write bandwidth the save's bound. Only who writes a tensor changes, not the files' format. The
    group is data-parallel with context parallelism, whose ranks hold the same weights too."""
    strategy = get_default_save_sharded_strategy()
    if not fully_parallel or not parallel_state.model_parallel_is_initialized():
        return strategy
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(strategy, data_parallel)


def _staging_dir(checkpoints_dir: Path, iteration: int) -> Path:
    """Where a save writes before its commit renames it to iteration_dir(...)."""
    return staging_dir(iteration_dir(checkpoints_dir, iteration))


def _prepare_staging(checkpoints_dir: Path, staging: Path) -> None:
    remove_staging_leftovers(checkpoints_dir)
    staging.mkdir(parents=True)


class CheckpointWriter:
    """Saves training checkpoints of one run; `async_save` overlaps the file writes with training."""

    def __init__(self, checkpoints_dir: str | Path, cfg: Config, keep_last: int | None = None,
                 async_save: bool = False, tokenizer: Tokenizer | None = None):
        """`tokenizer`: the run's, copied into each checkpoint where it is files (a directory; a packaged
        encoding is named): generate and to-hf read the checkpoint's copy, where the directory that
        data.tokenizer names may be gone (a from-hf checkpoint deleted once a continued run had begun)."""
        self.dir = Path(checkpoints_dir)
        self.cfg = cfg
        self.tokenizer = tokenizer if tokenizer is not None and Path(cfg.data.tokenizer).is_dir() else None
        self.keep_last = keep_last
        start_write_results_queue()
        self.queue = AsyncCallsQueue() if async_save else None
        self.in_flight: int | None = None  # the iteration of the background save not yet committed
        self.staged = None  # the host copies the background save's writer reads, kept until it has finished

    def save(self, iteration: int, chunks: list, optimizer, train_state: dict,
             kept_before: int | None = None) -> None:
        """`kept_before`: the iteration where the run's current streak of skipped steps began, if it is in one:
        keep_last then keeps the newest checkpoint saved before it too (files.remove_older_numbered)."""
        self.wait()  # one save in flight at a time: its commit must precede the next one's
        staging = _staging_dir(self.dir, iteration)
        with self._failure_reported(iteration):
            self._on_rank_zero(iteration, lambda: _prepare_staging(self.dir, staging))
            state = model_sharded_state(chunks)
            optimizer_format = self.cfg.checkpoint.optimizer_format
            state["optimizer"] = optimizer_sharded_state(optimizer, state, is_loading=False,
                                                         optimizer_format=optimizer_format)
            state[OPTIMIZER_FORMAT_KEY] = {"format": optimizer_format,
                                           "layout": optimizer_layout(self.cfg, rank_and_world()[1])}
            state[TRAIN_STATE_KEY] = train_state
            state[RNG_KEY] = _rng_sharded_object(_rng_states())
            commit = self._commit_fn(iteration, kept_before)
            strategy = save_strategy(self.cfg.checkpoint.fully_parallel_save)
            if self.queue is None:
                dist_checkpointing.save(state, str(staging), sharded_strategy=strategy)
                wait_for_ranks()
                commit()
                wait_for_ranks()
            else:
                request = dist_checkpointing.save(state, str(staging), sharded_strategy=strategy,
                                                  async_sharded_save=True)
                request.add_finalize_fn(commit)
                self.queue.schedule_async_request(self._keeping_staged_copies(request))
                self.in_flight = iteration

    def _keeping_staged_copies(self, request):
        """`request` whose host copies of the tensors stay referenced here until its write has finished.

        megatron-core 0.16.1 (TemporalAsyncCaller) copies the tensors to pinned host memory, forks the writer and
        drops the copies at once (megatron PR #2288). Pinned memory is not copy-on-write across a fork: PyTorch
        hands the freed blocks to the next pinned allocations (the data loader's batches), which could overwrite
        what the writer was still writing: a checkpoint with other data in place of some weights or moments."""
        preload = request.preload_fn
        if preload is None:
            return request

        def preload_and_keep():
            self.staged = preload()
            return self.staged

        return request._replace(preload_fn=preload_and_keep)

    @contextlib.contextmanager
    def _failure_reported(self, iteration: int):
        """A save that failed (a full disk, a quota, a lost mount: megatron's writers report it as a "Worker
        failure" on every rank) as a CheckpointError saying what is kept, not a traceback from the writers. Its
        partial files are removed, to give back the space."""
        try:
            yield
        except (CheckpointException, OSError) as error:
            kept = read_latest_iteration(self.dir)
            if rank_and_world()[0] == 0:
                shutil.rmtree(_staging_dir(self.dir, iteration), ignore_errors=True)
                if kept != iteration:  # renamed into place, its marker not written: no checkpoint, only its space
                    shutil.rmtree(iteration_dir(self.dir, iteration), ignore_errors=True)
            kept = (f"the run's last checkpoint, {iteration_dir(self.dir, kept)}, is kept and a rerun resumes from it"
                    if kept is not None else "the run has no checkpoint yet")
            raise CheckpointError(f"the checkpoint of iteration {iteration} could not be written into {self.dir} "
                                  f"({write_failure(error)}); {kept}") from error

    def _on_rank_zero(self, iteration: int, write) -> None:
        """`write()` on rank 0, refused on every rank where it fails (collective): rank 0 writing alone (the
        staging directory, config.yaml, the marker) into a full disk or a read-only mount stopped alone, while the
        other ranks waited in their next collective until its timeout, then failed with a traceback of their own."""
        def guarded() -> None:
            if rank_and_world()[0] == 0:
                with self._failure_reported(iteration):
                    write()
        refused_together(guarded)

    def _commit_fn(self, iteration: int, kept_before: int | None):
        def commit() -> None:
            self._on_rank_zero(iteration, lambda: self._commit(iteration, kept_before))
        return commit

    def _commit(self, iteration: int, kept_before: int | None) -> None:
        dump_config(self.cfg, _staging_dir(self.dir, iteration) / CONFIG_FILE)
        if self.tokenizer is not None:
            self.tokenizer.save_hf(_staging_dir(self.dir, iteration) / TOKENIZER_DIR)
        commit_iteration(self.dir, iteration, LATEST_FILE, f"{iteration}\n", self.keep_last, kept_before)

    def poll(self) -> None:
        """Commit background saves that every rank has finished (collective: call on every rank)."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        self._finalize(blocking=True)
        if self.queue is not None:
            wait_for_ranks()

    def _finalize(self, blocking: bool) -> None:
        if self.queue is not None and self.in_flight is not None:
            with self._failure_reported(self.in_flight):
                if self.queue.maybe_finalize_async_calls(blocking=blocking):
                    self.in_flight, self.staged = None, None

    def close(self) -> None:
        self.wait()
        if self.queue is not None:
            self.queue.close()


def read_train_state(checkpoint_dir: str | Path) -> dict | None:
    """The training state saved with a checkpoint (None for a model-only one), weights untouched."""
    with damage_reported(checkpoint_dir, also=(RuntimeError,)):  # torch.load of a common.pt cut short
        require_common_file(checkpoint_dir)
        return dist_checkpointing.load_common_state_dict(str(checkpoint_dir)).get(TRAIN_STATE_KEY)


def _refuse_shifted_optimizer_state(checkpoint_dir, chunks: list, optimizer, state: dict) -> None:
    """A checkpoint whose optimizer state is not its weights' (saved by a megadiff without mend (e) of
    optimizer_state): resumed, it trained from shifted fp32 weights and moments, its loss jumping without a word."""
    unlike = main_params_unlike_weights(optimizer, state, chunks)
    if unlike:
        raise CheckpointError(
            f"{checkpoint_dir}: the optimizer's fp32 weights of {len(unlike)} parameters are not the saved weights "
            f"({', '.join(unlike[:5])}{', ...' if len(unlike) > 5 else ''}): its optimizer state was saved shifted, "
            "as megadiff before the mend of padded buckets saved it (parallel.overlap_grad_reduce with a data-parallel "
            "size such as 3 or 6, or pipeline parallelism with tied embeddings). Its weights are sound: start from "
            "them with checkpoint.load=<it> checkpoint.load_optimizer=false in a new output_dir")


def load_training_checkpoint(checkpoint_dir: str | Path, chunks: list, optimizer, *, load_optimizer: bool = True,
                             restore_rng: bool = True, optimizer_format: str = "reshardable") -> None:
    """Load into this rank's model chunks (any TP/PP layout) and, optionally, the optimizer.

    `restore_rng` only where the run's world size and TP/PP/CP equal the saved run's. `optimizer_format`: the
    checkpoint's (saved_optimizer_format), whose layout, if parallel, must be this run's.
    """
    request = model_sharded_state(chunks)
    if load_optimizer:
        optimizer_request = optimizer_sharded_state(optimizer, request, is_loading=True,
                                                    optimizer_format=optimizer_format)
    # after the optimizer's request, whose entries megatron derives from the model's: theirs merge as they did
    request = merged_in_place(request)
    if load_optimizer:
        request["optimizer"] = optimizer_request
    if restore_rng:
        request[RNG_KEY] = _rng_sharded_object(None)
    loaded = load_sharded(request, checkpoint_dir)
    load_into_chunks(chunks, loaded)
    if load_optimizer:
        state = loaded["optimizer"]
        refused_together(lambda: _refuse_shifted_optimizer_state(checkpoint_dir, chunks, optimizer, state))
        load_optimizer_state(optimizer, state)
    else:  # the optimizer's fp32 copies must follow the loaded weights
        optimizer.reload_model_params()
    if restore_rng:
        _restore_rng_states(loaded[RNG_KEY])
