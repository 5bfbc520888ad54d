"""A plain `python` run (no launcher) forms a process group of one: it starts whatever else runs on the machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RENDEZVOUS_VARIABLES

REPO = Path(__file__).resolve().parents[1]

# Any port this process sees free and releases is taken at once by another program (another test's ranks, a
# connection's ephemeral port): what a busy machine may do between a port's pick and its use.
PORTS_TAKEN_ON_RELEASE = '''
import socket

strangers = []


class TakenOnRelease(socket.socket):
    def close(self):
        port = self.getsockname()[1] if self.fileno() != -1 else 0
        super().close()
        if port:
            stranger = socket.socket()
            stranger.bind(("127.0.0.1", port))
            stranger.listen()
            strangers.append(stranger)


socket.socket = TakenOnRelease
'''

GROUP_OF_ONE = '''
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megadiff.config.schema import ParallelConfig
from megadiff.parallel import initialize, shutdown

initialize(ParallelConfig(timeout_minutes=1), seed=1)
total = torch.full((1,), 3.0)
dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
print("sum", total.item())
shutdown()
'''


DEEPSPEED_WORLD_OF_ONE = '''
import deepspeed.comm
import torch

from megadiff.adapt.deepspeed_setup import init_distributed

assert init_distributed(timeout_minutes=1) == (0, 1)
total = torch.full((1,), 3.0)
deepspeed.comm.all_reduce(total)
print("sum", total.item())
'''


@pytest.mark.parametrize("program", [GROUP_OF_ONE, DEEPSPEED_WORLD_OF_ONE], ids=["megatron", "deepspeed"])
def test_a_plain_run_forms_its_group_of_one_while_other_programs_take_ports(program):
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", PORTS_TAKEN_ON_RELEASE + program], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "sum 3.0"
