"""slurm/: the real sbatch scripts on a real Slurm cluster of two emulated nodes (tests/slurm_cluster.py).

Data preparation: an array job shares the files out and a dependent job merges them.

Each job trains the tiny config across the two nodes (one CPU process per node, gloo), is
preempted with SIGUSR1 once a few iterations ran, must be requeued, resume from its preemption
checkpoint and finish with exactly the uninterrupted single-node run's loss curve.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
from pathlib import Path

import pytest

import tests.slurm_cluster as slurm_cluster_module
from megadiff.config import load_config
from megadiff.data.prepare import prepare
from megadiff.observability.metrics import read_metrics
from tests.conftest import kjv_verses
from tests.pretrain_runs import DEMO_CONFIG, ROOT, losses
from tests.slurm_cluster import NodeNames, resolves, slurm_cluster  # noqa: F401  (the fixture)
from tests.slurm_launch_runs import ITERS, SLURM, data_cache, launch_environment, reference_losses, run_overrides

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")

# (script, how the preemption signal is sent, what the log then says)
PREEMPTIONS = {
    # Slurm's --signal=B:USR1@... path: the batch script's trap forwards to the torchrun tasks
    "torchrun per node, signal to the batch script": (
        "pretrain.sbatch", ["--batch"], "SIGUSR1: asking the training to checkpoint and stop"),
    # the training processes are the tasks: they exit 75 and srun passes it on
    "task per GPU, signal to the tasks": (
        "pretrain_per_gpu.sbatch", [], "stopped for preemption (exit code 75)"),
    # --signal without B: torchrun's exit code is its own; rank 0's marker tells the batch script
    "torchrun per node, signal to the tasks": (
        "pretrain.sbatch", [], "the step stopped for preemption (exit code 1)"),
}


@pytest.fixture(autouse=True)
def no_job_left_running(slurm_cluster):  # noqa: F811
    yield
    slurm_cluster.cancel_all()


def described(job: dict, log: str) -> str:
    """What a test says of a job that did not get where it should: Slurm's view of it, then its log's end."""
    fields = ("JobState", "Reason", "Restarts", "ExitCode", "NodeList")
    return f"job {' '.join(f'{key}={job.get(key)}' for key in fields)}\nlog (end):\n{log[-5000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", PREEMPTIONS)
def test_preempted_job_is_requeued_and_resumes_the_uninterrupted_curve(case, slurm_cluster, tmp_path,  # noqa: F811
                                                                      tmp_path_factory, small_tokenizer_dir):
    script, scancel_options, preemption_message = PREEMPTIONS[case]
    reference = reference_losses(tmp_path_factory, small_tokenizer_dir)
    output_dir = tmp_path / "run"
    job = slurm_cluster.sbatch(
        "--gpus-per-node=0", "--ntasks-per-node=1", "--time=10", f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}",
        str(SLURM / script), str(DEMO_CONFIG),
        *run_overrides(small_tokenizer_dir, data_cache(tmp_path_factory), output_dir),
        env=launch_environment(GPUS_PER_NODE="1"))
    log_file = tmp_path / f"megadiff-pretrain-{job}.out"

    def log() -> str:
        return log_file.read_text() if log_file.exists() else "(no log yet)"

    def state() -> dict:
        return slurm_cluster.job(job)

    def trained(count: int) -> bool:
        assert state()["JobState"] not in ENDED, f"job ended before iteration {count}:\n{log()[-5000:]}"
        return (output_dir / "metrics.jsonl").exists() and len(read_metrics(output_dir)) >= count

    def details() -> str:
        return described(state(), log())

    slurm_cluster.wait_for(lambda: trained(2), 300, "iteration 2", poll=0.2, details=details)
    slurm_cluster.command("scancel", *scancel_options, "--signal=USR1", job)
    slurm_cluster.wait_for(lambda: state()["Restarts"] == "1", 120, "the requeue", details=details)
    slurm_cluster.wait_for(lambda: state()["JobState"] in ENDED, 300, "the job's end", details=details)

    final, text = state(), log()
    context = described(final, text)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), context
    assert preemption_message in text, context
    assert "requeueing (restart 1)" in text and "the job is not requeued" not in text, context
    assert "restart 0 on 2 nodes" in text and "restart 1 on 2 nodes" in text, context
    resumed = re.search(r"resumed from \S+ at iteration (\d+)", text)
    assert resumed and 2 <= int(resumed.group(1)) < ITERS, context
    assert losses(output_dir) == reference, context


@pytest.mark.slow
def test_an_array_job_shares_the_files_and_a_dependent_job_merges(slurm_cluster, tmp_path,  # noqa: F811
                                                                  small_tokenizer_dir):
    """slurm/prepare_data.sbatch: two array tasks tokenize three files between them, a job that
    waits for them merges, and the result is the bytes a one-process prepare-data writes."""
    verses = kjv_verses()
    sources = tmp_path / "sources"
    sources.mkdir()
    for i in range(3):
        documents = (" ".join(verses[j:j + 10]) for j in range(i * 300, (i + 1) * 300, 10))
        (sources / f"{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    config = tmp_path / "prepare.yaml"
    config.write_text(f"data:\n  sources: [{sources}]\n  prefix: {tmp_path / 'slurm' / 'kjv'}\n"
                      f"  tokenizer: {small_tokenizer_dir}\n")
    reference = tmp_path / "reference" / "kjv"
    prepare(load_config(config, [f"data.prefix={reference}"]).data)

    common = ("--cpus-per-task=1", "--time=10", f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}")
    script = (str(SLURM / "prepare_data.sbatch"), str(config))
    array = slurm_cluster.sbatch("--array=0-1", *common, *script, env=launch_environment())
    merge = slurm_cluster.sbatch(f"--dependency=afterok:{array}", *common, *script, env=launch_environment())

    def logs() -> str:
        return "\n".join(path.read_text() for path in sorted(tmp_path.glob("megadiff-prepare-*.out")))

    def details() -> str:
        return "\n".join(described(slurm_cluster.job(job), "") for job in (array, merge)) + logs()[-5000:]

    slurm_cluster.wait_for(lambda: slurm_cluster.job(merge)["JobState"] in ENDED, 300, "the merge job's end",
                           details=details)
    assert slurm_cluster.job(merge)["JobState"] == "COMPLETED", details()
    text = logs()
    assert "--part 0/2 of" in text and "--part 1/2 of" in text, text[-5000:]
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'slurm' / 'kjv'}{ext}").read_bytes() == Path(f"{reference}{ext}").read_bytes()


def test_a_job_s_rendezvous_port_is_held_for_it(slurm_cluster, tmp_path):  # noqa: F811
    """slurm/job.sh's rendezvous port, 10000 + the job id % 20000: the clusters of two test runs on one machine
    both numbered their jobs from 1, and the second run's job failed at its start on 10001 (EADDRINUSE) which
    the first's held. A program of another run that binds the port this cluster's job will use is refused."""
    job = slurm_cluster.sbatch("--wrap=true", f"--output={tmp_path}/%j.out")
    with socket.socket() as another_run:
        with pytest.raises(OSError) as refused:
            another_run.bind(("127.0.0.1", 10000 + int(job) % 20000))
    assert refused.value.errno == errno.EADDRINUSE


def test_a_cluster_stopping_leaves_the_node_names_to_another_still_running(monkeypatch):
    """Two test runs' clusters on one machine: the first adds the node names to /etc/hosts, the second finds them
    there; the first stops, and the second's jobs must still resolve them."""
    if os.geteuid() != 0:
        pytest.skip("writing /etc/hosts needs root")
    names = tuple(f"megadiff-names-test-{os.getpid()}-{node}" for node in (1, 2))
    mark = f"# megadiff test of NodeNames {os.getpid()}"
    monkeypatch.setattr(slurm_cluster_module, "HOSTS_MARK", mark)  # no other cluster's line touched
    first, second = NodeNames(names), NodeNames(names)
    try:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert all(resolves(name) for name in names), "the second cluster's node names no longer resolve"
        second.__exit__(None, None, None)
    finally:
        lines = slurm_cluster_module.HOSTS_FILE.read_text().splitlines(keepends=True)
        slurm_cluster_module.HOSTS_FILE.write_text("".join(line for line in lines if mark not in line))
