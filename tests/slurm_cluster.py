"""A real Slurm cluster on this machine, two emulated nodes, for the tests of slurm/*.sbatch.

Debian's slurm-wlm (installed with apt-get when missing and we are root): a private munged, a
slurmctld and one slurmd per node, all on 127.0.0.1 with their own ports, state and logs in a
temporary directory. Measured facts behind the settings: ../shared/notes/slurm-on-one-machine.md.
Anything that prevents the cluster from starting raises SlurmUnavailable, which the fixture turns
into a skip; what Slurm does with a job once it runs is the test's business.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.distributed import reserve

NODES = ("megadiff-n1", "megadiff-n2")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# megadiff test Slurm cluster"
# A requeued job may start again only once the credentials of its previous run have expired
# (slurm.conf: "AuthInfo ... cred_expire: this also controls how long a requeued job must wait
# before starting again", default 120 s). A few seconds are plenty on one machine.
CRED_EXPIRE_S = 5
# slurm/job.sh gives a job's rendezvous the port 10000 + its id % 20000, and a fresh cluster's job ids start at
# 1: two test runs on one machine met on 10001. Each cluster holds a block of ports while it runs, its daemons'
# first, then one for each job a test session submits, and numbers its jobs into that block.
JOB_PORT_BASE, JOB_PORT_SPAN = 10000, 20000
PORTS_HELD = 32


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here."""


def _run(args: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def ensure_installed() -> None:
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed, and installing it needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            proc = _run(args, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(args)}` timed out") from None
        if proc.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(args)}` failed: {proc.stderr[-2000:]}")
    if not all(shutil.which(b) for b in BINARIES):
        raise SlurmUnavailable(f"installed {PACKAGES} but some of {BINARIES} are still missing")


def reserved_port_block(count: int, low: int, high: int) -> tuple[int, contextlib.ExitStack]:
    """The first of `count` consecutive ports within [low, high), each held (tests.distributed.reserve) until the
    stack closes: a block somewhere else where another program (another test run's cluster, its jobs) holds one."""
    for _ in range(100):
        start = random.randrange(low, high - count + 1)
        held = contextlib.ExitStack()
        try:
            for port in range(start, start + count):
                held.enter_context(reserve(port))
        except OSError:
            held.close()
            continue
        return start, held
    raise SlurmUnavailable(f"found no {count} consecutive free ports within [{low}, {high})")


def resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


class NodeNames:
    """Job scripts take MASTER_ADDR from the node list, so the emulated node names must resolve.

    Every cluster on the machine (another test run's too) holds a shared lock on the hosts file while it runs,
    and the last one to stop removes the names: the one that added them removed them while another run's
    cluster still ran, whose jobs then could not resolve their MASTER_ADDR."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.lock = None

    def __enter__(self):
        self.lock = HOSTS_FILE.open()
        fcntl.flock(self.lock, fcntl.LOCK_SH)
        if not all(resolves(n) for n in self.names):
            if os.geteuid() != 0:
                self.lock.close()
                raise SlurmUnavailable(f"the node names {self.names} do not resolve and /etc/hosts is not writable")
            with HOSTS_FILE.open("a") as hosts:  # in place: /etc/hosts may be a bind mount
                hosts.write(f"127.0.0.1 {' '.join(self.names)} {HOSTS_MARK}\n")
        return self

    def __exit__(self, *exc):
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another cluster still runs: its jobs resolve the names
            return
        else:
            kept = [line for line in HOSTS_FILE.read_text().splitlines(keepends=True) if HOSTS_MARK not in line]
            HOSTS_FILE.write_text("".join(kept))
        finally:
            self.lock.close()


def slurm_conf(root: Path, ctld_port: int, node_ports: list[int], first_job_id: int, munge_socket: Path) -> str:
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    nodes = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
                      "RealMemory=1000 State=UNKNOWN" for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=megadiff-test
FirstJobId={first_job_id}
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
# Pending jobs (the requeued one) are looked at every second, not every minute.
SchedulerParameters=sched_interval=1
MinJobAge=600
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Start with `start()`, always `stop()`. Commands run with SLURM_CONF pointing at this cluster."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        self.munged_pid: int | None = None
        self.ports = contextlib.ExitStack()

    def _start_munge(self) -> None:
        munge = self.munge_socket.parent
        for directory in (self.root, munge):  # munged insists that everyone may traverse the socket's directories
            directory.mkdir(exist_ok=True)
            directory.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        proc = _run(["munged", f"--key-file={key}", f"--socket={self.munge_socket}", f"--pid-file={munge}/munged.pid",
                     f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        if proc.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {proc.stderr.strip()}")
        self.munged_pid = int((munge / "munged.pid").read_text())

    def _daemon(self, args: list[str], log_name: str) -> None:
        log = open(self.root / log_name, "w")
        self.daemons.append(subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def start(self, timeout: float = 60) -> None:
        self._start_munge()
        first_port, self.ports = reserved_port_block(PORTS_HELD, JOB_PORT_BASE + 1, JOB_PORT_BASE + JOB_PORT_SPAN)
        ctld_port, *node_ports = range(first_port, first_port + 1 + len(NODES))
        first_job_id = node_ports[-1] + 1 - JOB_PORT_BASE
        for sub in ("state", *(f"spool/{node}" for node in NODES)):
            (self.root / sub).mkdir(parents=True)
        self.conf.write_text(slurm_conf(self.root, ctld_port, node_ports, first_job_id, self.munge_socket))
        self._daemon(["slurmctld", "-D"], "slurmctld.out")
        for node in NODES:
            self._daemon(["slurmd", "-D", "-N", node], f"slurmd-{node}.out")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [d.args for d in self.daemons if d.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{dead} exited at start; logs: {self.logs()}")
            states = self.scontrol("show", "nodes", "-o", check=False)
            if states.returncode == 0 and states.stdout.count("State=IDLE") == len(NODES):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"the nodes did not become idle within {timeout} s; logs: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def command(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = _run(list(args), timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr}")
        return proc

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.command("scontrol", *args, check=check)

    def sbatch(self, *args: str, env: dict | None = None) -> str:
        """Submit; returns the job id. `env` is the job's environment (sbatch exports it)."""
        proc = _run(["sbatch", "--parsable", *args], env={**(env or os.environ), "SLURM_CONF": str(self.conf)})
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.scontrol("show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, condition, timeout: float, what: str, poll: float = 0.5, details=None):
        """Poll `condition` until it holds; at the timeout, say what was awaited and `details()` as it is then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = condition()
            if result:
                return result
            time.sleep(poll)
        raise TimeoutError(f"waited {timeout} s for {what}" + (f"\n{details()}" if details else ""))

    def cancel_all(self) -> None:
        """Cancel every job and wait for the queue to empty: a job a failed test left running would hold the
        nodes, and the next test's jobs would wait behind it."""
        self.command("scancel", "--partition=test", check=False)
        try:
            self.wait_for(lambda: not self.command("squeue", "-h", check=False).stdout.strip(), 30, "jobs to end")
        except TimeoutError:
            pass

    def stop(self) -> None:
        if self.daemons:
            self.cancel_all()
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.ports.close()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running two-node Slurm cluster (skips the test where Slurm cannot be set up)."""
    try:
        ensure_installed()
    except SlurmUnavailable as err:
        pytest.skip(str(err))
    # not pytest's tmp_path: munged refuses a socket below a directory that others cannot traverse
    root = Path(tempfile.mkdtemp(prefix="megadiff-slurm-"))
    cluster = SlurmCluster(root)
    try:
        with NodeNames(NODES):
            try:
                cluster.start()
            except (SlurmUnavailable, OSError, subprocess.SubprocessError) as err:
                pytest.skip(f"Slurm could not be started: {err}")
            yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
