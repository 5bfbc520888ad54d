"""The stop flags every rank agrees on: a preemption signal, or a spent wall-clock budget."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from megadiff.preemption import (
    REQUEUE_EXIT_CODE, REQUEUE_MARKER_ENV, PreemptionHandler, leave_requeue_marker, signal_name,
)
from tests.distributed import run_ranks


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_budget_stops_once_spent_and_counts_from_the_handler_s_start():
    clock = FakeClock()
    handler = PreemptionHandler(signals=(), budget_minutes=1, clock=clock)
    clock.now += 30
    assert not handler.agreed()
    clock.now += 29.9
    assert not handler.agreed()
    clock.now += 0.1
    assert handler.agreed() and handler.out_of_time and not handler.signalled


def test_a_signal_stops_and_is_told_apart_from_the_budget():
    previous = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler(budget_minutes=60)
    try:
        assert not handler.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.agreed() and handler.signalled and not handler.out_of_time
        assert handler.received == signal.SIGUSR1
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGUSR1) == previous


def _agree(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    clock = FakeClock()
    start = clock.now
    handler = PreemptionHandler(signals=(signal.SIGUSR1,), budget_minutes=1, clock=clock)
    assert not handler.agreed()
    if rank == 1:  # this rank's clock runs ahead: the other stops at the same iteration
        clock.now += 60
    assert handler.agreed() and handler.out_of_time and not handler.signalled
    clock.now = start  # every budget fine again; now a signal reaches rank 0 only
    if rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.agreed() and handler.signalled and not handler.out_of_time
    assert (handler.received is not None) == (rank == 0)
    handler.restore()
    dist.destroy_process_group()


def test_every_rank_agrees_on_either_flag():
    run_ranks(2, _agree)


def test_rank_0_leaves_the_slurm_script_s_requeue_marker(tmp_path, monkeypatch):
    marker = tmp_path / "requeue"
    leave_requeue_marker(0)  # no Slurm script asked for one
    assert not marker.exists()
    monkeypatch.setenv(REQUEUE_MARKER_ENV, str(marker))
    leave_requeue_marker(1)
    assert not marker.exists()
    leave_requeue_marker(0)
    assert marker.exists()


def test_a_marker_that_cannot_be_written_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(REQUEUE_MARKER_ENV, str(tmp_path / "missing" / "requeue"))
    leave_requeue_marker(0)
    assert "could not leave the requeue marker" in capsys.readouterr().err


TRAINER = """
import time
from megadiff.checkpoint.weights import start_write_results_queue
start_write_results_queue()
print("started", flush=True)
time.sleep(600)
"""
# a conversion's model-only save (from-hf's): megatron started its own manager, which a kill left orphaned
CONVERTER = """
import sys, time
from pathlib import Path
from tests.convert_worker import build_tokenizer, save_in_process, variant_config
tokenizer = build_tokenizer(Path(sys.argv[1]) / "tokenizer")
save_in_process(variant_config("softmax", "single", str(tokenizer)), Path(sys.argv[1]) / "checkpoint")
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("program", [TRAINER, CONVERTER], ids=["trainer", "conversion"])
def test_the_checkpoint_writers_manager_ignores_preemption_and_exits_with_its_trainer(program, tmp_path):
    """Slurm signals every process of the step: the manager megatron's writes report through lives on
    through them, and leaves when its trainer (or a conversion) is killed outright (it would otherwise be
    orphaned, holding the output pipe of the job that ran it)."""
    from tests.pretrain_runs import ROOT, environment

    trainer = subprocess.Popen([sys.executable, "-c", program, str(tmp_path)], env=environment(), cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert "started\n" in iter(trainer.stdout.readline, "")  # after what the program printed on the way
        manager = next(child for child in psutil.Process(trainer.pid).children()
                       if "spawn_main" in " ".join(child.cmdline()))
        for preemption in (signal.SIGUSR1, signal.SIGTERM):
            manager.send_signal(preemption)
        time.sleep(0.5)
        assert manager.is_running() and manager.status() != psutil.STATUS_ZOMBIE
        trainer.kill()
        trainer.wait()
        manager.wait(timeout=10)  # psutil.TimeoutExpired if it outlives its trainer
    finally:
        trainer.kill()


def test_only_a_signal_requeues_and_leaves_the_marker_a_spent_budget_exits_0(tmp_path, monkeypatch):
    """A spent budget is a planned stop: requeueing it (exit 75 or the marker) would restart a run whose
    time is up, while a signal that did not requeue would lose the rest of a preempted run."""
    marker = tmp_path / "requeue"
    monkeypatch.setenv(REQUEUE_MARKER_ENV, str(marker))
    clock = FakeClock()
    budget = PreemptionHandler(signals=(), budget_minutes=1, clock=clock)
    clock.now += 60
    assert budget.agreed() and budget.out_of_time
    assert budget.exit_after_checkpoint(0) == 0 and not marker.exists()
    preempted = PreemptionHandler(signals=())
    preempted.received = signal.SIGTERM  # as _handle records it
    assert preempted.agreed() and preempted.signalled
    assert preempted.exit_after_checkpoint(1) == REQUEUE_EXIT_CODE and not marker.exists()  # rank 0's to leave
    assert preempted.exit_after_checkpoint(0) == REQUEUE_EXIT_CODE and marker.exists()


def test_the_signal_name_in_the_stop_message_or_another_rank_s_when_none_arrived_here():
    assert signal_name(signal.SIGUSR1) == "SIGUSR1" and signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(None) == "a signal on another rank"


def test_the_requeue_exit_code_and_marker_are_the_ones_the_slurm_script_requeues_on():
    """slurm/job.sh holds its own copies of the exit code and the marker's variable: a code changed on one side
    only (or one that reads as success or as torchrun's failure, 0 or 1) would end preempted jobs unrequeued."""
    import re
    from pathlib import Path

    job = (Path(__file__).resolve().parents[1] / "slurm" / "job.sh").read_text()
    assert int(re.search(r"^REQUEUE_EXIT_CODE=(\d+)", job, re.MULTILINE).group(1)) == REQUEUE_EXIT_CODE
    assert REQUEUE_EXIT_CODE == os.EX_TEMPFAIL == 75
    assert f"export {REQUEUE_MARKER_ENV}=" in job
