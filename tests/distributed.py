"""Spawn real gloo ranks for multi-process tests.

Ranks fork from a forkserver that imported torch and megatron-core once (a fresh interpreter that
never ran a torch op, so forking it is safe on CPU) instead of each rank importing them anew: that
import is most of a small multi-rank test's time. Where CUDA exists, ranks are spawned. A forkserver
child inherits the server's stdout and stderr, not the test's, so each rank writes to a log file that
the test's stderr then receives.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Iterator

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megadiff.models.builder",
           "megadiff.training.engine"]


def reserve(port: int = 0) -> socket.socket:
    """A socket holding `port` (0: one the kernel picks) for a rendezvous, so that nothing else on the machine
    takes it until the socket closes. A port merely seen free (bound, then released) was free only then:
    another test's ranks, or any connection's ephemeral port, could take it before rank 0's store bound it, and
    rank 0 failed with EADDRINUSE while the other ranks waited on a stranger's socket until the test's timeout.
    Bound with SO_REUSEADDR and never listening, it is given to no other bind or connection, while a server that
    binds with SO_REUSEADDR too (torch's TCPStore, Slurm's daemons) may still listen on it."""
    reservation = socket.socket()
    try:
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reservation.bind(("127.0.0.1", port))
    except OSError:
        reservation.close()
        raise
    return reservation


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port for a rendezvous, held (`reserve`) until the block ends."""
    with reserve() as reservation:
        yield reservation.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, environ: dict, log_path: str, target: Callable,
                args: tuple) -> None:
    import torch

    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()  # the test's environment, not the one the forkserver started with
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # torch read OMP_NUM_THREADS when the forkserver imported it
    tempfile.tempdir = None  # found again from this rank's TMPDIR, not the one the forkserver found
    target(rank, world_size, *args)


NODES = 2


def node_environment(nodes: Path, rank: int, world_size: int) -> dict:
    """What rank `rank` of a run over NODES nodes (world_size / NODES ranks each, in node order, as torchrun's static
    rendezvous numbers them) has of its own node's: node-local disks (TMPDIR, HOME, XDG_CACHE_HOME under
    `nodes`/node<N>, made here) and the local rank and size torchrun --nnodes sets."""
    per_node = world_size // NODES
    node = nodes / f"node{rank // per_node}"
    local = {name: node / name.lower() for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME")}
    for directory in local.values():
        directory.mkdir(parents=True, exist_ok=True)
    return {**{name: str(directory) for name, directory in local.items()}, "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node)}


def run_ranks(world_size: int, target: Callable, *args, timeout: float = 300.0, fresh: bool = False,
              nodes: Path | None = None) -> None:
    """Run target(rank, world_size, *args) in `world_size` fresh processes; fail if any rank fails. `fresh`: each
    rank a new interpreter, for settings read as a module is imported (TRITON_INTERPRET, read as the kernel's
    module is), which the forkserver may have imported before the test set them. `nodes`: the ranks as NODES
    nodes would run them, each node's disks a directory of `nodes` (node_environment)."""
    import torch

    if torch.cuda.is_available() or fresh:
        # on a GPU machine importing PRELOAD initialised CUDA in the server, and its children failed with
        # "Cannot re-initialize CUDA in forked subprocess" (seen on an H100): there, each rank starts afresh
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    with reserved_port() as port, tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        log_paths = [str(Path(logs) / f"rank{rank}.log") for rank in range(world_size)]
        environ = [{**os.environ, "LOCAL_RANK": str(rank),
                    **(node_environment(nodes, rank, world_size) if nodes else {})} for rank in range(world_size)]
        procs = [ctx.Process(target=_rank_entry, args=(rank, world_size, port, environ[rank], log_paths[rank],
                                                       target, args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for rank, path in enumerate(log_paths):
            output = Path(path).read_text(errors="replace") if Path(path).exists() else ""
            if output:
                sys.stderr.write(f"----- rank {rank} -----\n{output}")
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s (see captured stderr)")
    failed = {rank: proc.exitcode for rank, proc in enumerate(procs) if proc.exitcode != 0}
    if failed:
        raise RuntimeError(f"ranks failed with exit codes {failed} (see captured stderr)")


def _reporting_rank(rank: int, world_size: int, outputs: str, command: Callable[..., int], args: tuple) -> None:
    """command(*args) in a test rank: what it prints and the exit code it returns, into files under `outputs`."""
    with open(f"{outputs}/{rank}.out", "w") as out, open(f"{outputs}/{rank}.err", "w") as err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = command(*args)
        except Exception:  # noqa: BLE001 -- a crash, as torchrun reports a worker's: code 1, the traceback kept
            traceback.print_exc()
            code = 1
    Path(f"{outputs}/{rank}.code").write_text(str(code))


def run_reporting_ranks(nproc: int, command: Callable[..., int], *args, timeout: float = 300, expect: int = 0,
                        nodes: Path | None = None) -> subprocess.CompletedProcess:
    """command(*args) (a module's function: the ranks import it) in `nproc` ranks, as torchrun would run a
    command line, but started in a second where a torchrun process takes ten: the ranks' output, one after
    another as torchrun gathers it as it comes, and the exit code every rank returned (`expect`). `nodes`: as
    run_ranks'."""
    with tempfile.TemporaryDirectory(prefix="command-") as outputs:
        run_ranks(nproc, _reporting_rank, outputs, command, args, timeout=timeout, nodes=nodes)
        codes = {int(Path(outputs, f"{rank}.code").read_text()) for rank in range(nproc)}
        stdout, stderr = ("".join(Path(outputs, f"{rank}.{stream}").read_text() for rank in range(nproc))
                          for stream in ("out", "err"))
    assert codes == {expect}, f"exit codes {codes}, expected {expect}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return subprocess.CompletedProcess([getattr(command, "__name__", "command"), *map(str, args)], expect, stdout,
                                       stderr)


def megadiff_main(argv: list[str]) -> int:
    """`megadiff ARGV`'s exit code (for run_reporting_ranks)."""
    from megadiff.cli import main

    return main(argv)
