"""launch/: the torchrun launchers run `megadiff pretrain` on one node and across nodes.

The multi-node launcher runs as two "nodes" on this machine (two invocations, node ranks 0 and 1,
rendezvous on localhost). Its run is preempted through one node's torchrun only and rerun: the
resumed curve must equal the uninterrupted single-node run's.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from megadiff.checkpoint.format import CHECKPOINTS_DIR
from megadiff.observability.metrics import read_metrics
from tests.distributed import reserved_port
from tests.pretrain_runs import DEMO_CONFIG, losses
from tests.slurm_launch_runs import (ITERS, LAUNCH, data_cache, finish, launch, launch_environment, reference_losses,
                                     run_overrides, single_node_run)

LATEST = "latest_checkpointed_iteration.txt"


def _logged_iterations(output_dir) -> int:
    try:
        return len(read_metrics(output_dir))
    except FileNotFoundError:
        return 0


def _wait_for_iterations(output_dir, count: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while _logged_iterations(output_dir) < count:
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended and time.monotonic() < deadline, (
            f"no iteration {count} in {output_dir} (ended: {ended}):\n" +
            "\n".join(p.communicate()[0][-3000:] for p in procs if p.poll() is not None))
        time.sleep(0.2)


def test_single_node_launcher_trains_two_processes(tmp_path_factory, small_tokenizer_dir):
    output_dir, output = single_node_run(tmp_path_factory, small_tokenizer_dir)
    assert "2 ranks" in output
    assert [r["iteration"] for r in read_metrics(output_dir)] == list(range(1, ITERS + 1))
    assert (output_dir / CHECKPOINTS_DIR / LATEST).read_text().strip() == str(ITERS)


def test_two_node_launch_preempted_on_one_node_resumes_the_single_node_curve(tmp_path, tmp_path_factory,
                                                                           small_tokenizer_dir):
    reference = reference_losses(tmp_path_factory, small_tokenizer_dir)
    output_dir = tmp_path / "run"
    args = [str(DEMO_CONFIG), *run_overrides(small_tokenizer_dir, data_cache(tmp_path_factory), output_dir)]

    def start_nodes(port: int) -> list[subprocess.Popen]:
        env = launch_environment(NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return [launch("pretrain_multi_node.sh", args, {**env, "NODE_RANK": str(rank)}) for rank in (1, 0)]

    with reserved_port() as port:
        node1, node0 = start_nodes(port)
        _wait_for_iterations(output_dir, 2, [node0, node1])
        node1.send_signal(signal.SIGUSR1)  # torchrun of node 1 only: it forwards to its worker, the ranks agree
        outputs = [finish(node, expect=1) for node in (node0, node1)]  # torchrun exits 1 when a worker exits 75
    stopped = int((output_dir / CHECKPOINTS_DIR / LATEST).read_text())
    assert 2 <= stopped < ITERS, f"stopped at iteration {stopped}"
    # rank 0 (node 0) never saw the signal itself: it stops because the ranks agree
    assert re.search(rf"on another rank received: checkpointing at iteration {stopped}\b", outputs[0])

    with reserved_port() as port:
        node1, node0 = start_nodes(port)
        output = finish(node0)
        finish(node1)
    assert re.search(rf"resumed from \S+ at iteration {stopped}\b", output)
    assert losses(output_dir) == reference


def test_launchers_explain_missing_arguments(tmp_path):
    usage = subprocess.run([str(LAUNCH / "pretrain_single_node.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "pretrain_single_node.sh CONFIG" in usage.stderr
    env = launch_environment(GPUS_PER_NODE="1", NNODES="2", NODE_RANK="0")
    env.pop("MASTER_ADDR", None)
    missing = subprocess.run([str(LAUNCH / "pretrain_multi_node.sh"), str(DEMO_CONFIG)], env=env,
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "MASTER_ADDR" in missing.stderr
    # an interpreter without megadiff (the environment not activated): said, with the way out
    bare_python = tmp_path / "python3"
    bare_python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'megadiff'\" >&2\nexit 1\n")
    bare_python.chmod(0o755)
    bare = subprocess.run([str(LAUNCH / "pretrain_single_node.sh"), str(DEMO_CONFIG)],
                          env=launch_environment(PYTHON=str(bare_python)), capture_output=True, text=True)
    assert bare.returncode == 2 and "PYTHON=" in bare.stderr
    assert "cannot import megadiff (ModuleNotFoundError: No module named 'megadiff')" in bare.stderr
    # from the repository root, where the docs run the launchers, any interpreter finds megadiff's source tree
    outside = tmp_path / "outside-python"
    outside.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # no site-packages: no torch
    outside.chmod(0o755)
    at_root = subprocess.run([str(LAUNCH / "pretrain_single_node.sh"), str(DEMO_CONFIG)], cwd=LAUNCH.parent,
                             env=launch_environment(PYTHON=str(outside)), capture_output=True, text=True)
    assert at_root.returncode == 2 and "No module named 'torch'" in at_root.stderr and "PYTHON=" in at_root.stderr


CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@pytest.mark.parametrize("variable, name", zip(CACHE_VARIABLES, ("triton", "inductor")))
def test_the_compile_caches_are_on_the_node_s_own_disk_for_the_user_alone(tmp_path, variable, name):
    """Not Triton's ~/.triton, a network home on most clusters, which every rank of every node would
    write at once, nor torch's /tmp/torchinductor_<user>, a name anyone on the node can make first; a
    directory the caller chose stands."""
    def cache_dir(**preset: str) -> str:
        env = {key: value for key, value in launch_environment().items() if key not in CACHE_VARIABLES}
        env.update(TMPDIR=str(tmp_path), USER="someone", **preset)
        script = f'source {LAUNCH / "process_env.sh"} CONFIG; export_process_env 8; echo "${variable}"'
        return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.strip()

    assert cache_dir() == f"{tmp_path}/megadiff-{name}-someone"
    assert (tmp_path / f"megadiff-{name}-someone").stat().st_mode & 0o777 == 0o700  # made for its user alone
    assert cache_dir(**{variable: "/shared/cache"}) == "/shared/cache"


@pytest.mark.parametrize("planted", ["writable by others", "a link"])
def test_a_triton_cache_name_someone_else_made_first_in_tmp_is_not_used(tmp_path, planted):
    """/tmp/megadiff-triton-<user> is a name anyone on the node can make first: Triton would load the compiled
    launchers planted there as native code in the user's ranks."""
    node_cache = tmp_path / "megadiff-triton-someone"
    if planted == "a link":
        (tmp_path / "elsewhere").mkdir()
        node_cache.symlink_to(tmp_path / "elsewhere")
    else:
        node_cache.mkdir()
        node_cache.chmod(0o777)
    env = {key: value for key, value in launch_environment().items() if key not in CACHE_VARIABLES}
    env.update(TMPDIR=str(tmp_path), USER="someone")
    script = f'source {LAUNCH / "process_env.sh"} CONFIG; export_process_env 8; echo "[${{TRITON_CACHE_DIR:-}}]"'
    shell = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    assert shell.stdout.strip() == "[]"  # Triton's own default
    assert f"megadiff: {node_cache} is not a directory of this user's alone" in shell.stderr


@pytest.mark.parametrize("torch_version, said", [("2.8.0+cu128", True), ("2.9.0", False), ("2.10.1", False)])
def test_a_torchrun_that_does_not_forward_sigusr1_is_said(tmp_path, torch_version, said):
    """Before torch 2.9 torchrun dies of the SIGUSR1 the sbatch scripts' preemption sends, and its workers
    with it, unsaved."""
    python = tmp_path / "python3"  # the launchers' import check: megadiff imports, torch is this version
    python.write_text(f"#!/bin/sh\necho {torch_version}\n")
    python.chmod(0o755)
    script = f'source {LAUNCH / "torchrun_env.sh"} CONFIG'
    proc = subprocess.run(["bash", "-c", script], env=launch_environment(PYTHON=str(python), GPUS_PER_NODE="1"),
                          capture_output=True, text=True, check=True)
    message = f"megadiff: torchrun of torch {torch_version} does not forward SIGUSR1 (torch 2.9 does)"
    assert (message in proc.stderr) == said, proc.stderr


def test_tensor_parallel_groups_spanning_nodes_are_said(monkeypatch):
    """megatron's tensor-parallel groups are consecutive ranks: with 8 processes per node, TP=16 or TP=3 puts
    a group on two nodes; TP=8, or any TP on one node, does not."""
    from megadiff.config import ParallelConfig
    from megadiff.parallel import tensor_parallel_across_nodes

    def said(tensor: int, per_node: int, world: int) -> str | None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return tensor_parallel_across_nodes(ParallelConfig(tensor=tensor))

    assert said(8, 8, 32) is None and said(2, 8, 32) is None and said(3, 6, 6) is None
    assert "parallel.tensor=16 over 8 processes per node: tensor-parallel groups span nodes" in said(16, 8, 32)
    assert "parallel.tensor=3 over 8 processes per node" in said(3, 8, 48)


def test_more_processes_on_a_node_than_its_gpus_are_refused(monkeypatch):
    """8 processes per node where each sees the node's 4 GPUs put two on each GPU (local rank modulo the
    devices), and NCCL hung or failed at its first collective. One GPU bound to each task (Slurm's binding:
    device 0 in every task) is the case the modulo is for."""
    import torch

    from megadiff.config import ConfigError
    from megadiff.parallel.initialize import local_device

    def device(local_rank: int, processes: int, visible: int) -> int:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        return local_device()

    assert device(5, 8, 8) == 5 and device(5, 8, 1) == 0 and device(3, 4, 8) == 3
    with pytest.raises(ConfigError, match="8 processes on this node, and 4 GPUs visible to each: some would share"):
        device(5, 8, 4)

