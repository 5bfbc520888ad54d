"""Tiny pre-training runs started the way users start them: launch/*.sh and slurm/*.sbatch.

Every run here has world size 2 (two processes on one node, two nodes of one process, two Slurm
nodes) and the same config, so each loss curve must equal the single-node run's, which is
computed once per session and shared by test_launch.py and test_slurm.py (and their xdist workers).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import RENDEZVOUS_VARIABLES
from tests.pretrain_runs import DEMO_CONFIG, ROOT, losses, tiny_overrides

LAUNCH = ROOT / "launch"
SLURM = ROOT / "slurm"
ITERS = 40
# 8 micro-batches per rank and iteration: long enough iterations that a preemption signal sent
# after iteration 2 lands well before the last one.
BATCH = ["train.micro_batch_size=2", "train.global_batch_size=32", f"train.iters={ITERS}"]


def run_overrides(tokenizer_dir: Path, cache_dir: Path, output_dir: Path) -> list[str]:
    return [*tiny_overrides(tokenizer_dir, cache_dir), *BATCH, f"output_dir={output_dir}"]


def launch_environment(**extra: str) -> dict:
    """The caller's environment as a user's shell has it; what torchrun needs is the launcher's job."""
    env = {key: value for key, value in os.environ.items()
           if key not in RENDEZVOUS_VARIABLES and not key.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", **extra}


def launch(script: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(LAUNCH / script), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300, expect: int = 0) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s:\n{output[-5000:]}") from None
    assert proc.returncode == expect, f"{proc.args}: exit code {proc.returncode}, expected {expect}\n{output[-5000:]}"
    return output


_SESSION: dict = {}  # what is computed once per test session (pytest's factory objects are not hashable)


def data_cache(tmp_path_factory) -> Path:
    """One prepared-corpus cache for every run of the session (prepared by the first)."""
    if "data_cache" not in _SESSION:
        _SESSION["data_cache"] = tmp_path_factory.mktemp("slurm-launch-data")
    return _SESSION["data_cache"]


def single_node_run(tmp_path_factory, tokenizer_dir: Path) -> tuple[Path, str]:
    """launch/pretrain_single_node.sh with 2 processes, uninterrupted: (output_dir, console output). Run once
    per session, by the first xdist worker to ask (test_launch.py and test_slurm.py may run on two)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "single-node"
    console = shared / "console.txt"
    with FileLock(f"{shared}.lock"):
        if not console.is_file():
            shutil.rmtree(shared, ignore_errors=True)  # a failed first try's checkpoints would be resumed
            shared.mkdir()
            args = [str(DEMO_CONFIG), *run_overrides(tokenizer_dir, shared / "data", shared / "run")]
            console.write_text(finish(launch("pretrain_single_node.sh", args, launch_environment(GPUS_PER_NODE="2"))))
    return shared / "run", console.read_text()


def reference_losses(tmp_path_factory, tokenizer_dir: Path) -> list[float]:
    curve = losses(single_node_run(tmp_path_factory, tokenizer_dir)[0])
    assert len(curve) == ITERS
    return curve
