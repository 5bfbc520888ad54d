"""Helper processes under the long TMPDIR Slurm sites give jobs (/local/scratch/slurm_job_12345678/<user>/tmp):
multiprocessing binds their sockets below it, and a socket's path holds 107 bytes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megadiff.helper_processes import OWN_DIR, SOCKET, SOCKET_PATH_LIMIT
from tests.pretrain_runs import ROOT, environment

# multiprocessing's socket paths below a TMPDIR this long are longer than a socket's
LONG = SOCKET_PATH_LIMIT - len(OWN_DIR) - len(SOCKET) + 1


def long_tmpdir(tmp_path: Path) -> Path:
    directory = tmp_path / ("t" * (LONG - len(str(tmp_path)) - 1))
    directory.mkdir()
    return directory


def run_under(tmpdir: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**environment(), "TMPDIR": str(tmpdir)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


WRITER_QUEUE = """
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megadiff.checkpoint.weights import start_write_results_queue
from megadiff.helper_processes import socket_directory
start_write_results_queue()
filesystem_async._results_queue.put("written")
print(filesystem_async._results_queue.get(timeout=30), socket_directory())
"""


def test_the_checkpoint_writers_manager_starts_under_a_long_tmpdir(tmp_path):
    """It failed with a bare EOFError at every run's start (CheckpointWriter), its socket's path too long; its
    socket's directory goes with the process."""
    proc = run_under(long_tmpdir(tmp_path), WRITER_QUEUE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said, directory = proc.stdout.split()
    assert said == "written"
    assert not Path(directory).exists()


LOADER = """
import json, sys, torch
from megadiff.training.batches import BATCH_KEYS, IterationBatches, MicroBatchSampler, micro_batch_loader
class Samples(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, index): return {key: torch.arange(4) * index for key in BATCH_KEYS}
loader = micro_batch_loader(Samples(), MicroBatchSampler(64, 0, 8, 2, 0, 1), WORKERS, micro_batches_per_step=4)
with IterationBatches(loader, num_microbatches=4, num_chunks=1, vocab_size=1000) as iterations:
    print(json.dumps([batch["tokens"].tolist() for _ in range(8) for batch in iterations.next_iteration()]))
"""


def test_data_loader_workers_hand_their_batches_over_under_a_long_tmpdir(tmp_path):
    """A worker's batch crosses to the trainer over a socket: with its path too long, the worker's queue dropped the
    batch, and the run waited forever for it. The batches are those read without workers."""
    tmpdir = long_tmpdir(tmp_path)
    proc = run_under(tmpdir, LOADER.replace("WORKERS", "2"), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = run_under(tmpdir, LOADER.replace("WORKERS", "0"))
    assert json.loads(proc.stdout) == json.loads(alone.stdout)


NOWHERE_SHORTER = """
import megadiff.helper_processes as helpers
helpers.SHORT_TEMP_DIRS = (helpers.tempfile.gettempdir(),)  # as long as TMPDIR
try:
    helpers.socket_directory()
except helpers.MegadiffError as error:
    print(error)
"""


def test_a_tmpdir_too_long_with_nowhere_shorter_is_named(tmp_path):
    tmpdir = long_tmpdir(tmp_path)
    proc = run_under(tmpdir, NOWHERE_SHORTER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"TMPDIR {tmpdir} is too long" in proc.stdout and f"holds {SOCKET_PATH_LIMIT} bytes" in proc.stdout
