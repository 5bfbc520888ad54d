"""The multi-process test harness itself (tests/distributed.py): its ranks meet whatever else runs on the machine."""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from tests.distributed import run_ranks


def _meet_after_another_program_binds_the_port(rank: int, world_size: int, report: str) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:  # before its store listens: what any program (another test's ranks) may do in that window
        with socket.socket() as stranger:
            try:
                stranger.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
                Path(report, "stranger").write_text("bound the ranks' port")
            except OSError as err:
                Path(report, "stranger").write_text(errno.errorcode[err.errno])
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    Path(report, f"rank{rank}").write_text(str(int(total.item())))
    dist.destroy_process_group()


def test_no_other_program_takes_the_ranks_port_before_they_meet(tmp_path):
    run_ranks(2, _meet_after_another_program_binds_the_port, str(tmp_path), timeout=120)
    assert (tmp_path / "stranger").read_text() == "EADDRINUSE"
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ["2", "2"]
