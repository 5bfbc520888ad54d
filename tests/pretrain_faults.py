"""Runs inside a spawned rank: `megadiff pretrain` with a fault injected (a test-only patch)."""
from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import shutil
import signal
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

import megadiff.checkpoint.training_checkpoint as training_checkpoint
import megadiff.files as files
import megadiff.training.pretrain as pretrain
import megadiff.training.step as step
from megadiff.checkpoint.format import LATEST_FILE
from megadiff.cli import main
from megadiff.config import load_config
from tests.pretrain_runs import DEMO_CONFIG


def poisoned_run(rank: int, world_size: int, overrides: list[str], poisoned_steps: list[int], report: str,
                 factor: float = float("nan"), gradients_only: bool = False, masked: bool = False) -> None:
    """The losses (so the gradients) of the listed steps of this process (1 = its first) are multiplied
    by `factor`: NaN, or a spike; with `gradients_only`, only the gradients (the losses stay finite, as
    in an fp16 overflow); with `masked`, their loss masks are zeros instead (no loss tokens). Records what the
    parameters did around every step and the run's exit code."""
    original_forward, original_step = step.forward_step, pretrain.train_step
    current = {"iteration": 0}

    def forward_step(data_iterator, model, **options):  # options: validation's `summed`
        if current["iteration"] in poisoned_steps and masked:
            data_iterator = (dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"])) for batch in data_iterator)
            return original_forward(data_iterator, model, **options)
        per_token_loss, loss_func = original_forward(data_iterator, model, **options)
        if current["iteration"] in poisoned_steps and gradients_only:
            per_token_loss = per_token_loss.detach() + (per_token_loss - per_token_loss.detach()) * factor
        elif current["iteration"] in poisoned_steps:
            per_token_loss = per_token_loss * factor
        return per_token_loss, loss_func

    def train_step(engine, *args, **kwargs):
        current["iteration"] += 1
        before = [p.detach().clone() for chunk in engine.unwrapped() for p in chunk.parameters()]
        result = original_step(engine, *args, **kwargs)
        after = [p.detach() for chunk in engine.unwrapped() for p in chunk.parameters()]
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        events.append({"iteration": current["iteration"], "updated": result.updated, "params_changed": changed,
                       "spike": result.spike})
        return result

    events: list[dict] = []
    step.forward_step, pretrain.train_step = forward_step, train_step
    exit_code = main(["pretrain", str(DEMO_CONFIG), *overrides])
    if rank == 0:
        with open(report, "w") as handle:
            json.dump({"exit_code": exit_code, "events": events}, handle)


class FakeGpuMemory:
    """torch.cuda's memory counters for a run on the CPU: `held` bytes allocated, and the peak since the last
    reset; each of torch's other attributes is torch's own."""

    def __init__(self, held: int):
        self.held = self.peak = held

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def is_available(self) -> bool:
        return True

    def get_device_name(self) -> str:
        return "a fake GPU"

    def max_memory_allocated(self) -> int:
        return self.peak

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.held


class _TorchWithFakeGpuMemory:
    """torch, as megadiff.training.throughput sees it, with FakeGpuMemory as torch.cuda (its tensors stay on
    the CPU)."""

    def __init__(self, memory: FakeGpuMemory):
        self.cuda = memory

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, dtype=None, device=None):
        return torch.tensor(data, dtype=dtype)


def resumed_with_a_load_transient(rank: int, world_size: int, overrides: list[str], held: int, transient: int,
                                  report: str) -> None:
    """`megadiff pretrain` whose fake GPU holds `held` bytes, and `transient` more a moment while a checkpoint
    is restored (the loaded copy of the optimizer state and weights); writes its exit code."""
    import megadiff.training.throughput as throughput

    memory = FakeGpuMemory(held)
    throughput.torch = _TorchWithFakeGpuMemory(memory)
    original_restore = pretrain.restore

    def restore(*args, **kwargs):
        memory.peak = max(memory.peak, held + transient)
        return original_restore(*args, **kwargs)

    pretrain.restore = restore
    Path(report).write_text(str(main(["pretrain", str(DEMO_CONFIG), *overrides])))


def poisoned_on_the_last_rank(rank: int, world_size: int, overrides: list[str], poisoned_steps: list[int],
                              report: str) -> None:
    """poisoned_run with the last rank's losses alone poisoned; each rank writes what it printed to
    `report`.RANK (rank 0 its exit code and events to `report` too)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        poisoned_run(rank, world_size, overrides, poisoned_steps if rank == world_size - 1 else [], report)
    Path(f"{report}.{rank}").write_text(printed.getvalue())


def signalled_while_starting(rank: int, world_size: int, overrides: list[str], report: str,
                             disk_full: bool = False) -> None:
    """`megadiff pretrain` whose ranks get SIGUSR1 as their process groups come up, before the data,
    the model or a checkpoint, with `disk_full` every checkpoint write failing: records the run's exit code
    and error."""
    original_initialize = pretrain.initialize

    def initialize(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return original_initialize(*args, **kwargs)

    def save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    pretrain.initialize = initialize
    if disk_full:
        training_checkpoint.dist_checkpointing.save = save
    _report_pretrain(rank, overrides, report)


def signalled_while_evaluating(rank: int, world_size: int, overrides: list[str], report: str) -> None:
    """`megadiff pretrain` whose rank 0 gets SIGUSR1 as its first evaluation batch runs: records the run's exit code
    and error, and the evaluation batches each rank ran (`report`.batches.RANK)."""
    original, batches = pretrain.validation_sums, []

    def validation_sums(*args, **kwargs):
        if rank == 0 and not batches:
            os.kill(os.getpid(), signal.SIGUSR1)
        batches.append(None)
        return original(*args, **kwargs)

    pretrain.validation_sums = validation_sums
    try:
        _report_pretrain(rank, overrides, report)
    finally:
        Path(f"{report}.batches.{rank}").write_text(str(len(batches)))


def _report_pretrain(rank: int, overrides: list[str], report: str) -> None:
    """`megadiff pretrain` in this rank: rank 0 writes its exit code and what it printed to stderr to `report`,
    another rank to `<report>.rank<N>`."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        exit_code = main(["pretrain", str(DEMO_CONFIG), *overrides])
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as handle:
        json.dump({"exit_code": exit_code, "stderr": errors.getvalue()}, handle)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def killed_while_saving(rank: int, world_size: int, overrides: list[str], doomed_iteration: int) -> None:
    """SIGKILL (nothing can be cleaned up) in the middle of writing the checkpoint of one iteration."""
    original_save = training_checkpoint.dist_checkpointing.save

    def save(state, directory, *args, **kwargs):
        if f"iter_{doomed_iteration:07d}" in str(directory):
            with open(os.path.join(directory, "half_written.distcp"), "wb") as handle:
                handle.write(b"\0" * 1024)
            # with its helper processes (checkpoint writers), as a node failure or a job's cgroup
            # OOM kill takes them: left behind they would wait on their dead parent for ever
            for child in _children(os.getpid()):
                os.kill(child, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(state, directory, *args, **kwargs)

    training_checkpoint.dist_checkpointing.save = save
    pretrain.pretrain(load_config(DEMO_CONFIG, overrides, world_size=world_size))


def disk_full_while_saving(rank: int, world_size: int, overrides: list[str], doomed_iteration: int,
                           report: str) -> None:
    """Every file write of one iteration's checkpoint fails as on a full disk, in megatron's writer processes
    (forked from this one, so they see the patch): records the run's exit code and error."""
    original_save, original_write = training_checkpoint.dist_checkpointing.save, filesystem_async._write_item
    doomed = {"now": False}

    def save(state, directory, *args, **kwargs):
        doomed["now"] = f"iter_{doomed_iteration:07d}" in str(directory)
        return original_save(state, directory, *args, **kwargs)

    @functools.wraps(original_write)  # megatron reads its signature
    def write_item(*args, **kwargs):
        if doomed["now"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original_write(*args, **kwargs)

    training_checkpoint.dist_checkpointing.save, filesystem_async._write_item = save, write_item
    _report_pretrain(rank, overrides, report)


def marker_refused_while_committing(rank: int, world_size: int, overrides: list[str], doomed_iteration: int,
                                    report: str) -> None:
    """The latest-checkpoint marker naming one iteration cannot be written (a full disk), a write rank 0 makes
    alone: records each rank's exit code and error."""
    original_write = files.write_atomically

    def write_atomically(path, data):
        if Path(path).name == LATEST_FILE and data == f"{doomed_iteration}\n".encode():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original_write(path, data)

    files.write_atomically = write_atomically
    _report_pretrain(rank, overrides, report)


def crashing_at_step(crash_step: int, overrides: list[str], in_evaluation: bool = False) -> None:
    """`megadiff pretrain` in this interpreter whose step `crash_step` (or, `in_evaluation`, evaluation
    `crash_step`'s first forward) raises an unexpected error (a CUDA or NCCL error's stand-in), left to reach the
    interpreter's top as a real one does."""
    import sys

    from megadiff.cli import entry_point

    name = "validation_sums" if in_evaluation else "train_step"
    original, calls = getattr(pretrain, name), []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == crash_step:
            raise RuntimeError(f"an unexpected failure at step {crash_step}")
        return original(*args, **kwargs)

    setattr(pretrain, name, failing)
    sys.exit(entry_point(["pretrain", str(DEMO_CONFIG), *overrides]))


def loaded_while_its_run_saves(rank: int, world_size: int, overrides: list[str], source_checkpoints: str,
                               report: str) -> None:
    """`megadiff pretrain` starting from checkpoint.load, a run still training (`source_checkpoints`): while this
    run builds its model, after it chose the checkpoint to load, that run commits a newer one with keep_last=1."""
    original_build = pretrain.build_engine
    checkpoints = Path(source_checkpoints)

    def build_engine(cfg):
        if rank == 0:
            newest = training_checkpoint.read_latest_iteration(checkpoints)
            newer = files.iteration_dir(checkpoints, newest + 1)
            shutil.copytree(files.iteration_dir(checkpoints, newest), files.staging_dir(newer))
            files.commit_iteration(checkpoints, newest + 1, LATEST_FILE, f"{newest + 1}\n", keep_last=1)
        return original_build(cfg)

    pretrain.build_engine = build_engine
    _report_pretrain(rank, overrides, report)
