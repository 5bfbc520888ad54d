"""Spawn real gloo ranks for multi-process tests."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, target: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    target(rank, world_size, *args)


def run_ranks(world_size: int, target: Callable, *args, timeout: float = 300.0) -> None:
    """Run target(rank, world_size, *args) in `world_size` fresh processes; fail if any rank fails."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(rank, world_size, port, target, args)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout)
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
    failed = {rank: proc.exitcode for rank, proc in enumerate(procs) if proc.exitcode != 0}
    if failed:
        raise RuntimeError(f"ranks failed with exit codes {failed} (see captured stderr)")
