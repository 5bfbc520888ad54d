"""A resume restores each rank's random number generators (Python's, NumPy's, torch's and megatron's
tracker), as they were when its checkpoint was saved: pre-training has no dropout, so no loss curve shows a
restore that was skipped, or one rank's states given to every rank."""
from __future__ import annotations

import json
import random

import numpy as np
import torch

from tests.distributed import run_ranks
from tests.parity_worker import MODEL


def _draws() -> list[float]:
    """One number from each generator a run's randomness comes from, in a fixed order: megatron's tracker is
    the one its tensor-parallel layers draw dropout from."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = float(torch.rand(()))
    return [random.random(), float(np.random.rand()), float(torch.rand(())), tracker]


def _worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter, load_training_checkpoint
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + ["model.variant=diff"], world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    for _ in range(rank + 1):  # each rank's generators in a state of their own
        _draws()
    writer = CheckpointWriter(checkpoints, cfg)
    writer.save(1, engine.unwrapped(), engine.optimizer, {"iteration": 1})
    writer.close()
    report = {"after_save": [_draws() for _ in range(3)]}
    for restore in (True, False):
        load_training_checkpoint(iteration_dir(checkpoints, 1), engine.unwrapped(), engine.optimizer,
                                 load_optimizer=False, restore_rng=restore)
        report[f"after_load_restore_{restore}"] = [_draws() for _ in range(3)]
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def test_a_resume_restores_each_ranks_generators_as_saved(tmp_path):
    out = tmp_path / "report.json"
    run_ranks(2, _worker, str(tmp_path / "checkpoints"), str(out))
    reports = [json.loads((tmp_path / f"report.json.{rank}").read_text()) for rank in range(2)]
    for report in reports:
        assert report["after_load_restore_True"] == report["after_save"]
        assert report["after_load_restore_False"] != report["after_save"]  # the draws go on: a real negative
    assert reports[0]["after_save"] != reports[1]["after_save"]  # each rank restores its own states
