"""Helpers for the pre-training tests: tiny runs of `megadiff pretrain`, as a user launches them."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from megadiff.observability.metrics import read_metrics
from tests.conftest import RENDEZVOUS_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo" / "diff-tiny.yaml"
# torchrun forwards these to its workers (torch 2.13 reads PET_*, older ones TORCHELASTIC_*)
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# set by bench/run_on_gpu.sh: commands write their output into files there as they run
OUTPUT_DIR_ENV = "MEGADIFF_TEST_OUTPUT_DIR"
_command_numbers = itertools.count(1)


def tiny_overrides(tokenizer_dir: Path, cache_dir: Path) -> list[str]:
    """The demo config shrunk for tests: the 512-id KJV tokenizer, 32-token sequences."""
    return ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
            "model.vocab_size=512", "model.make_vocab_size_divisible_by=64", "model.tie_embeddings=false",
            f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={cache_dir}", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.lr=5e-3", "train.lr_warmup_iters=2", "train.eval_interval=null",
            "checkpoint.save_interval=null", "logging.tensorboard=false"]


def environment() -> dict:
    """This process's environment without the rendezvous variables a test rank may have set."""
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    # keep what PYTHONPATH already holds (the GPU machine's carried wheels live there)
    python_path = os.pathsep.join(p for p in (str(ROOT), inherited.get("PYTHONPATH")) if p)
    return {**inherited, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS, "PET_SIGNALS_TO_HANDLE": SIGNALS}


def pretrain_command(nproc: int, overrides: list[str], config: Path = DEMO_CONFIG) -> list[str]:
    entry = ["-m", "megadiff", "pretrain", str(config), *overrides]
    if nproc == 1:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry]


def run_command(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`command` (a megadiff command line) with its output captured; where $MEGADIFF_TEST_OUTPUT_DIR is set,
    written as it runs to numbered files there too, so that a run its stage's time limit kills still shows
    how far each command got (captured output dies with the test)."""
    directory = os.environ.get(OUTPUT_DIR_ENV)
    if not directory:
        return subprocess.run(command, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    subcommand = command[command.index("megadiff") + 1]
    stem = Path(directory) / f"{next(_command_numbers):02d}-{subcommand}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.run(command, env={**environment(), "PYTHONUNBUFFERED": "1"}, cwd=ROOT, stdout=stdout,
                              stderr=stderr, timeout=timeout)
    return subprocess.CompletedProcess(command, proc.returncode, out.read_text(), err.read_text())


def run_pretrain(nproc: int, overrides: list[str], config: Path = DEMO_CONFIG, timeout: float = 300,
                 expect: int = 0) -> subprocess.CompletedProcess:
    proc = run_command(pretrain_command(nproc, overrides, config), timeout)
    assert proc.returncode == expect, (f"exit code {proc.returncode}, expected {expect}\n"
                                       f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_pretrain_in_ranks(nproc: int, overrides: list[str], config: Path = DEMO_CONFIG, timeout: float = 300,
                          expect: int = 0, nodes: Path | None = None) -> subprocess.CompletedProcess:
    """run_pretrain's run in the gloo ranks of tests/distributed.py (run_reporting_ranks). For tests of what a run
    does, not of how torchrun starts it (test_launch.py, test_slurm.py). `nodes`: as run_ranks'."""
    from tests.distributed import megadiff_main, run_reporting_ranks

    return run_reporting_ranks(nproc, megadiff_main, ["pretrain", str(config), *overrides], timeout=timeout,
                               expect=expect, nodes=nodes)


def losses(output_dir: Path) -> list[float]:
    return [record["lm_loss"] for record in read_metrics(output_dir) if "lm_loss" in record]
