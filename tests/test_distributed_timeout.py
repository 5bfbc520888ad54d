"""How long a rank waits in a collective before the job fails: long enough for rank 0 to build dataset
indices (pretrain: parallel.timeout_minutes), or a node's first rank to tokenize the data (adapt:
train.timeout_minutes), while the others wait (torch's own default, 10 minutes, is not); short
enough that a hung job ends. Real gloo ranks, with a 3-second limit."""
from __future__ import annotations

import json
import time

import pytest

from tests.distributed import run_ranks

TIMEOUT_MINUTES = 0.05  # 3 s
LATE_BY_S = 10.0


def _pretrain_group(world_size: int) -> None:
    from megadiff.config import build_config
    from megadiff.parallel import initialize

    cfg = build_config({}, [f"parallel.timeout_minutes={TIMEOUT_MINUTES}", "train.global_batch_size=2"], world_size)
    initialize(cfg.parallel, seed=0)


def _adapt_group(world_size: int) -> None:
    from megadiff.adapt.deepspeed_setup import init_distributed

    init_distributed(TIMEOUT_MINUTES)


def worker(rank: int, world_size: int, command: str, out_dir: str) -> None:
    import torch.distributed as dist

    {"pretrain": _pretrain_group, "adapt": _adapt_group}[command](world_size)
    if rank == 1:
        time.sleep(LATE_BY_S)  # rank 0 waits for this rank in the barrier below
    started = time.monotonic()
    try:
        dist.barrier()
        outcome = "completed"
    except RuntimeError as err:  # the timeout, or (rank 1) the peer that gave up
        outcome = f"failed: {str(err).splitlines()[0]}"
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"outcome": outcome, "waited_s": time.monotonic() - started}, f)


@pytest.mark.parametrize("command", ["pretrain", "adapt"])
def test_a_collective_fails_after_the_configured_timeout(command, tmp_path):
    run_ranks(2, worker, command, str(tmp_path), timeout=120)
    waiting = json.loads((tmp_path / "rank0.json").read_text())
    assert waiting["outcome"].startswith("failed"), waiting
    assert waiting["waited_s"] < LATE_BY_S - 2, waiting  # gave up at ~3 s, long before the late rank came
