"""slurm/job.sh's step runner on its own: Slurm's commands are stand-ins that record their calls, so
the races between a step ending and a signal reaching the batch script can be set up exactly."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# scancel takes its time (as a busy controller does): a step may end while the trap waits on it; a requeue
# ends the batch script's run with SIGTERM, as Slurm's does
STANDINS = {"scancel": 'echo "scancel $*" >> "$CALLS"; touch "$FORWARDED"; sleep 1.5',
            "srun": 'echo "srun $*" >> "$CALLS"',
            "scontrol": 'if [[ $1 == show ]]; then echo node1; else echo "scontrol $*" >> "$CALLS"; fi\n'
                        'if [[ $1 == requeue ]]; then kill -TERM $PPID; fi'}


def _slurm_environment(tmp_path: Path, **variables: str) -> dict:
    """A job's environment with the stand-ins first on its PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STANDINS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
            "FORWARDED": str(tmp_path / "forwarded"), "TMPDIR": str(tmp_path), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_SUBMIT_DIR": str(tmp_path), **variables}


def _run_step(tmp_path: Path, step: str, usr1_after: float | None,
              submit_dir: Path | None = None) -> tuple[int, str, str]:
    env = _slurm_environment(tmp_path, SLURM_SUBMIT_DIR=str(submit_dir or tmp_path))
    calls = Path(env["CALLS"])
    (tmp_path / "config.yaml").touch()
    started = tmp_path / "started"
    started.unlink(missing_ok=True)
    Path(env["FORWARDED"]).unlink(missing_ok=True)
    script = (f"source {ROOT / 'slurm/job.sh'} {tmp_path / 'config.yaml'}\n"
              f"run_step_requeue_on_preemption bash -c 'touch {started}; {step}'")
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if usr1_after is not None:
        # the step runs once the traps are set (a loaded machine may take longer than usr1_after to get there)
        while not started.exists() and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(usr1_after)
        proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=60)[0]
    return proc.returncode, output, calls.read_text() if calls.exists() else ""


def _ends_once_signalled(code: int) -> str:
    """A step that ends with `code` once the batch script's trap has forwarded SIGUSR1 (30 s at most): a fixed
    sleep ended before the signal came on a loaded machine, and the test failed by chance."""
    return f'for _ in $(seq 600); do [[ -e $FORWARDED ]] && break; sleep 0.05; done; exit {code}'


@pytest.mark.parametrize("step,usr1_after,code,requeued", [
    (_ends_once_signalled(0), 0.3, 0, False),   # ends while the trap forwards the signal: done, not preempted
    (_ends_once_signalled(3), 0.3, 0, True),    # failed once asked to stop (e.g. killed while saving): requeued
    (_ends_once_signalled(75), 0.3, 0, True),   # stopped for the preemption: requeued
    (_ends_once_signalled(3), 1.2, 0, True),    # the signal late, as on a loaded machine: the same
    ("exit 75", None, 0, True),           # signalled directly (not through this script): requeued too
    ("exit 3", None, 3, False),
])
def test_the_step_s_own_exit_code_decides(tmp_path, step, usr1_after, code, requeued):
    returncode, output, calls = _run_step(tmp_path, step, usr1_after)
    assert returncode == code, output
    assert ("scontrol requeue 4242" in calls) is requeued, output
    assert "the job is not requeued" not in output  # Slurm's SIGTERM of a requeue is no scancel
    if not requeued:
        assert f"the step finished with exit code {code}" in output


def test_failures_after_the_signal_are_requeued_a_few_times_in_a_row_at_most(tmp_path):
    """A save that fails on every preemption must not requeue the job for ever: three requeues without
    a committed checkpoint in a row, then the job ends with the step's exit code."""
    failed_save = _ends_once_signalled(3)
    for restart in range(1, 4):
        returncode, output, calls = _run_step(tmp_path, failed_save, 0.3)
        assert returncode == 0 and calls.count("scontrol requeue") == restart, output
        assert f"({restart} of at most 3 in a row)" in output
    # a committed preemption checkpoint in between starts the count again
    _run_step(tmp_path, _ends_once_signalled(75), 0.3)
    _run_step(tmp_path, failed_save, 0.3)
    assert _run_step(tmp_path, failed_save, 0.3)[2].count("scontrol requeue") == 6
    _run_step(tmp_path, failed_save, 0.3)
    returncode, output, calls = _run_step(tmp_path, failed_save, 0.3)
    assert returncode == 3 and calls.count("scontrol requeue") == 7, output
    assert "without a new checkpoint 4 times in a row: not requeueing" in output
    assert not list(tmp_path.glob(".megadiff-uncommitted-requeues-*"))


def test_a_count_that_cannot_be_kept_ends_the_job_rather_than_requeueing_for_ever(tmp_path):
    """The submit directory unwritable (a full disk, as a save failing every time may find) or its count
    unreadable: no requeue without a committed checkpoint."""
    returncode, output, calls = _run_step(tmp_path, _ends_once_signalled(3), 0.3, submit_dir=tmp_path / "gone")
    assert returncode == 3 and "scontrol requeue" not in calls, output
    assert "cannot be kept" in output
    (tmp_path / ".megadiff-uncommitted-requeues-4242").write_text("")  # left empty by a failed write
    returncode, output, calls = _run_step(tmp_path, _ends_once_signalled(3), 0.3)
    assert returncode == 3 and "scontrol requeue" not in calls and "unreadable" in output, output


@pytest.mark.parametrize("arguments, variables, message", [
    (["missing.yaml"], {}, "config file not found: missing.yaml (in "),
    (["config.yaml"], {"SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_PER_NODE": "h100:4"},
     "--ntasks-per-node=8 differs from --gpus-per-node=4: this script runs one training process per GPU"),
])
def test_a_job_that_cannot_run_ends_before_its_step_starts(tmp_path, arguments, variables, message):
    """Refused once, by the batch script, rather than by every process the step would start on every node."""
    (tmp_path / "config.yaml").touch()
    env = _slurm_environment(tmp_path, MEGADIFF_ROOT=str(ROOT), SLURM_CPUS_ON_NODE="8", **variables)
    proc = subprocess.run(["bash", str(ROOT / "slurm/pretrain_per_gpu.sbatch"), *arguments], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "calls").exists()  # no srun


@pytest.mark.parametrize("script", ["pretrain.sbatch", "pretrain_per_gpu.sbatch", "adapt.sbatch"])
def test_a_job_submitted_from_outside_a_checkout_says_to_name_one(tmp_path, script):
    """Slurm runs a copy of the script, which finds launch/ and slurm/job.sh through the submit directory
    or MEGADIFF_ROOT: from elsewhere it said "command not found" of job.sh's functions."""
    (tmp_path / "config.yaml").touch()
    proc = subprocess.run(["bash", str(ROOT / "slurm" / script), "config.yaml"], env=_slurm_environment(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{tmp_path} is no megadiff checkout: submit from one, or set MEGADIFF_ROOT to it" in proc.stderr
    assert "command not found" not in proc.stderr and not (tmp_path / "calls").exists()


def test_a_gpus_per_node_the_submitting_shell_set_is_said_when_it_differs_from_the_allocation(tmp_path):
    (tmp_path / "config.yaml").touch()
    env = _slurm_environment(tmp_path, GPUS_PER_NODE="4", SLURM_GPUS_PER_NODE="h100:8", SLURM_CPUS_ON_NODE="8")
    script = f"source {ROOT / 'slurm/job.sh'} config.yaml\nrun_torchrun_per_node launch/pretrain_multi_node.sh"
    proc = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "GPUS_PER_NODE=4 (set where the job was submitted) runs 4 processes per node, not one per GPU of " \
           "--gpus-per-node=8" in proc.stdout, proc.stdout + proc.stderr
    assert "srun --label --ntasks-per-node=1" in (tmp_path / "calls").read_text()  # said, and run as asked


@pytest.mark.parametrize("variables, rendezvous", [
    ({}, "rendezvous at node1:14242, arguments"),  # 10000 + the job id
    ({"MASTER_PORT": "29500"}, "rendezvous at node1:29500 (MASTER_PORT, set where the job was submitted), arguments"),
])
def test_the_rendezvous_port_comes_from_the_job_id_unless_the_submitting_shell_set_one(tmp_path, variables, rendezvous):
    """A port exported where the job was submitted is taken, and said: jobs sharing a node on one port hang."""
    (tmp_path / "config.yaml").touch()
    env = {key: value for key, value in _slurm_environment(tmp_path, **variables).items()
           if key != "MASTER_PORT" or "MASTER_PORT" in variables}
    proc = subprocess.run(["bash", "-c", f"source {ROOT / 'slurm/job.sh'} config.yaml"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert rendezvous in proc.stdout, proc.stdout + proc.stderr


def test_a_requeue_marker_name_someone_else_made_first_in_tmp_does_not_requeue_a_failed_step(tmp_path):
    """$TMPDIR/megadiff-requeue-<job id> is a name anyone on the node can make first, and one this job cannot
    remove (another user's file in /tmp, or a directory): a step failing without any preemption was then
    requeued, and again on every restart."""
    (tmp_path / "megadiff-requeue-4242" / "anything").mkdir(parents=True)
    returncode, output, calls = _run_step(tmp_path, "exit 3", None)
    assert returncode == 3 and "scontrol requeue" not in calls, output


def test_the_requeue_marker_lies_in_a_directory_of_the_job_s_own_removed_once_read(tmp_path):
    """Rank 0 leaves the marker under torchrun (whose exit code is its own): the job is requeued on it."""
    step = (f'stat -c %a "$(dirname "$MEGADIFF_REQUEUE_MARKER")" > {tmp_path / "mode"}; '
            f'echo "$MEGADIFF_REQUEUE_MARKER" > {tmp_path / "marker"}; touch "$MEGADIFF_REQUEUE_MARKER"; exit 1')
    returncode, output, calls = _run_step(tmp_path, step, None)
    assert returncode == 0 and "scontrol requeue 4242" in calls, output
    assert (tmp_path / "mode").read_text().strip() == "700"
    marker = Path((tmp_path / "marker").read_text().strip())
    assert marker.parent.parent == tmp_path and not marker.parent.exists()
