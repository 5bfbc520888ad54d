"""checkpoint.optimizer_format=parallel: every data-parallel rank writes its own part of the distributed optimizer's
state (megatron's `dp_reshardable`), and a resume reproduces the uninterrupted run's whole loss curve.

`megadiff pretrain` in real gloo ranks for the curves (as tests/test_pretrain_resume.py), engines in gloo ranks
(tests/distributed.py) for what is saved and loaded.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, iteration_dir, read_latest_iteration
from megadiff.observability.metrics import read_metrics
from tests.distributed import run_ranks
from tests.parity_worker import MODEL
from tests.pretrain_runs import losses, run_pretrain_in_ranks, tiny_overrides
from tests.test_optimizer_checkpoint import STEPS, _adam_states, _padding_between_buckets, _step_all_chunks

ITERS = 6
STOP = 3
PARALLEL = ["parallel.distributed_optimizer=true", "checkpoint.optimizer_format=parallel"]
# (ranks, overrides): the layouts megatron's distributed-optimizer checkpoints went wrong in (optimizer_state's mends)
LAYOUTS = {"dp2": (2, []),
           "tp2_dp2": (4, ["parallel.tensor=2"]),
           "pp2_dp2_tied": (4, ["parallel.pipeline=2", "model.tie_embeddings=true"]),
           "dp3_overlap_grad_reduce": (3, ["parallel.overlap_grad_reduce=true", "train.global_batch_size=12"])}


@pytest.fixture(scope="module")
def base(small_tokenizer_dir, tmp_path_factory) -> list[str]:
    return tiny_overrides(small_tokenizer_dir, tmp_path_factory.mktemp("data-cache")) + [f"train.iters={ITERS}"]


def _grad_norms(output_dir: Path) -> list[float]:
    return [record["grad_norm"] for record in read_metrics(output_dir)]


def _uninterrupted_and_stopped(base: list[str], root: Path, ranks: int, overrides: list[str]) -> tuple[Path, Path]:
    full, stopped = root / "uninterrupted", root / "stopped"
    run_pretrain_in_ranks(ranks, base + PARALLEL + overrides + [f"output_dir={full}"])
    run_pretrain_in_ranks(ranks, base + PARALLEL + overrides + [f"output_dir={stopped}", f"train.exit_interval={STOP}"])
    assert read_latest_iteration(stopped / CHECKPOINTS_DIR) == STOP
    return full, stopped


@pytest.fixture(scope="module")
def dp2_runs(base, tmp_path_factory) -> tuple[Path, Path]:
    ranks, overrides = LAYOUTS["dp2"]
    return _uninterrupted_and_stopped(base, tmp_path_factory.mktemp("dp2"), ranks, overrides)


def _resumed(base: list[str], stopped: Path, to: Path, ranks: int, overrides: list[str]) -> Path:
    shutil.copytree(stopped, to)
    rerun = run_pretrain_in_ranks(ranks, base + PARALLEL + overrides + [f"output_dir={to}"])
    assert f"resumed from {to / CHECKPOINTS_DIR}" in rerun.stdout
    return to


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_parallel_checkpoint_resumes_the_uninterrupted_curve(base, dp2_runs, layout, tmp_path):
    ranks, overrides = LAYOUTS[layout]
    full, stopped = dp2_runs if layout == "dp2" else _uninterrupted_and_stopped(base, tmp_path, ranks, overrides)
    resumed = _resumed(base, stopped, tmp_path / "resumed", ranks, overrides)
    assert len(losses(resumed)) == ITERS
    assert losses(resumed) == losses(full)  # every iteration, bit for bit
    assert _grad_norms(resumed) == _grad_norms(full)


@pytest.mark.slow
def test_a_parallel_checkpoint_resumes_at_another_data_parallel_size(base, dp2_runs, tmp_path):
    """Saved at DP=2, resumed in one process: its buckets' parts read back as one."""
    full, stopped = dp2_runs
    resumed = _resumed(base, stopped, tmp_path / "resumed", 1, [])
    assert len(losses(resumed)) == ITERS
    assert losses(resumed) == pytest.approx(losses(full), abs=1e-5)  # DP=1 sums the gradients in another order


@pytest.mark.slow
def test_a_parallel_checkpoint_saved_in_the_background_holds_its_own_step(base, dp2_runs, tmp_path):
    """checkpoint.async_save writes the optimizer's own tensors (no gathered copies) while the next steps change
    them: the checkpoint of iteration 2, written while iteration 3 trained, resumes the uninterrupted curve."""
    full, _ = dp2_runs
    stopped = tmp_path / "stopped"
    run_pretrain_in_ranks(2, base + PARALLEL + [f"output_dir={stopped}", "checkpoint.save_interval=1",
                                                "checkpoint.async_save=true", f"train.exit_interval={STOP}"])
    shutil.rmtree(iteration_dir(stopped / CHECKPOINTS_DIR, STOP))
    (stopped / CHECKPOINTS_DIR / LATEST_FILE).write_text(f"{STOP - 1}\n")
    run_pretrain_in_ranks(2, base + PARALLEL + [f"output_dir={stopped}"])
    assert losses(stopped) == losses(full)  # iterations STOP.. trained again from the background save


@pytest.mark.slow
def test_a_parallel_checkpoint_into_another_tensor_layout_is_refused_before_any_work(base, dp2_runs, tmp_path):
    _, stopped = dp2_runs
    rerun = tmp_path / "rerun"
    shutil.copytree(stopped, rerun)
    refused = run_pretrain_in_ranks(2, base + PARALLEL + ["parallel.tensor=2", f"output_dir={rerun}"], expect=2)
    assert re.search(r"checkpoint.optimizer_format: the optimizer state of .* was saved in the parallel format, "
                     r"which loads only into the layout that saved it \(tensor=1, .*\); this run has tensor=2, .*"
                     r"checkpoint.optimizer_format=reshardable.* checkpoint.load_optimizer=false", refused.stderr), \
        refused.stderr[-3000:]
    assert "resumed from" not in refused.stdout
    assert read_metrics(rerun) == read_metrics(stopped)  # no step ran


DP3_BUCKETS = (["parallel.overlap_grad_reduce=true", "train.global_batch_size=12"], 5000)  # buckets padded to 384


def _with_buckets_of(bucket_numel: int | None) -> None:
    """Gradient buckets of `bucket_numel` elements under parallel.overlap_grad_reduce (several a buffer)."""
    from megadiff.training import engine

    if bucket_numel is not None:
        engine.gradient_bucket_numel = lambda parallel, world: bucket_numel if parallel.overlap_grad_reduce else None


def _round_trip_worker(rank: int, world_size: int, checkpoints: str, out: str, overrides: list[str],
                       bucket_numel: int | None) -> None:
    """A parallel checkpoint of a few steps loaded by a fresh engine: its weights, Adam state and next loss.
    `bucket_numel`: gradient buckets that small (several a buffer, each padded to lcm(DP, 128))."""
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter, load_training_checkpoint
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training import engine as engine_module

    _with_buckets_of(bucket_numel)
    cfg = build_config({}, MODEL + PARALLEL + overrides, world_size)
    initialize(cfg.parallel, seed=0)
    uninterrupted = engine_module.build_engine(cfg)
    for _ in range(STEPS):
        _step_all_chunks(uninterrupted, cfg)
    writer = CheckpointWriter(checkpoints, cfg)
    writer.save(STEPS, uninterrupted.unwrapped(), uninterrupted.optimizer, {"iteration": STEPS})
    writer.close()
    resumed = engine_module.build_engine(cfg)
    load_training_checkpoint(iteration_dir(checkpoints, STEPS), resumed.unwrapped(), resumed.optimizer,
                             restore_rng=False, optimizer_format="parallel")
    steps = [state["step"] for inner in resumed.optimizer.chained_optimizers
             for state in inner.optimizer.state.values()]
    report = {"padding": _padding_between_buckets(resumed),
              "buckets": [len(buffer.buckets) for chunk in resumed.model for buffer in chunk.buffers],
              "weights_differ": [name for chunks in zip(uninterrupted.unwrapped(), resumed.unwrapped(), strict=True)
                                 for (name, expected), (_, loaded) in zip(*(c.named_parameters() for c in chunks))
                                 if not torch.equal(loaded, expected)],
              "adam_states_equal": all(torch.equal(a, b) for a, b in zip(_adam_states(uninterrupted),
                                                                          _adam_states(resumed), strict=True)),
              "steps": sorted({float(step) for step in steps}), "step_tensors": len({id(s) for s in steps}),
              "params": len(steps),
              "next_losses": [[_step_all_chunks(engine, cfg) for _ in range(2)] for engine in (uninterrupted, resumed)]}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


@pytest.mark.parametrize("world_size, overrides, bucket_numel", [
    (3, *DP3_BUCKETS),
    (4, ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.tie_embeddings=true"], None),  # (e)'s layout
])
def test_a_parallel_checkpoint_of_padded_buckets_holds_each_rank_state(tmp_path, world_size, overrides, bucket_numel):
    """(b)-(e) in the parallel format: a fresh optimizer loads it, one step counter a parameter, and each rank's
    state where buckets end in padding between others is its own, not its neighbours'."""
    out = tmp_path / "report.json"
    run_ranks(world_size, _round_trip_worker, str(tmp_path / "checkpoints"), str(out), overrides, bucket_numel)
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]
    assert any(report["padding"] for report in reports), "no padding between buckets: the layout goes unexercised"
    for rank, report in enumerate(reports):
        assert report["weights_differ"] == [] and report["adam_states_equal"], rank
        assert report["steps"] == [STEPS] and report["step_tensors"] == report["params"], rank
        uninterrupted, resumed = report["next_losses"]
        assert resumed == uninterrupted, rank


def _own_state_bytes(optimizer) -> int:
    """The bytes of this rank's part of the distributed optimizer's state: fp32 main weights and Adam's moments."""
    return sum(main.nbytes + state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
               for inner in optimizer.chained_optimizers for group in inner.optimizer.param_groups
               for main in group["params"] for state in [inner.optimizer.state[main]])


def _bytes_written_worker(rank: int, world_size: int, root: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    from megadiff.checkpoint.format import model_sharded_state
    from megadiff.checkpoint.optimizer_state import optimizer_sharded_state
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + PARALLEL, world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    for _ in range(STEPS):
        _step_all_chunks(engine, cfg)
    for name in ("model", "reshardable", "parallel"):
        state = model_sharded_state(engine.unwrapped())
        if name != "model":
            state["optimizer"] = optimizer_sharded_state(engine.optimizer, state, is_loading=False,
                                                         optimizer_format=name)
        (Path(root) / name).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(state, str(Path(root) / name))
    own = _own_state_bytes(engine.optimizer)
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(own, handle)


def _written_by(directory: Path, rank: int) -> int:
    """The bytes torch's checkpoint writer wrote for global rank `rank` (its files __RANK_*.distcp)."""
    return sum(path.stat().st_size for path in directory.glob(f"__{rank}_*.distcp"))


def test_a_parallel_save_has_each_rank_write_its_own_optimizer_state_only(tmp_path):
    """The optimizer state a rank writes (its files' bytes beyond those of the model alone) is its own part, not the
    others': the reshardable format's rank 0 writes every rank's, the others none (the negative control)."""
    world_size, out = 2, tmp_path / "own.json"
    run_ranks(world_size, _bytes_written_worker, str(tmp_path), str(out))
    own = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]

    def optimizer_bytes(name: str) -> list[int]:
        return [_written_by(tmp_path / name, rank) - _written_by(tmp_path / "model", rank)
                for rank in range(world_size)]

    parallel, reshardable = optimizer_bytes("parallel"), optimizer_bytes("reshardable")
    for rank in range(world_size):  # its own state (and the padding of its part), less than another rank's besides
        assert own[rank] <= parallel[rank] < own[rank] + min(own[:rank] + own[rank + 1:]), (rank, parallel, own)
    assert reshardable[1] < own[1] and reshardable[0] >= sum(own), (reshardable, own)


def _save_both_formats_worker(rank: int, world_size: int, root: str) -> None:
    """The padded buckets of DP=3 trained a few steps, saved in both formats."""
    from megatron.core import dist_checkpointing

    from megadiff.checkpoint.format import model_sharded_state
    from megadiff.checkpoint.optimizer_state import optimizer_sharded_state
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    overrides, bucket_numel = DP3_BUCKETS
    _with_buckets_of(bucket_numel)
    cfg = build_config({}, MODEL + PARALLEL + overrides, world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    for _ in range(STEPS):
        _step_all_chunks(engine, cfg)
    for optimizer_format in ("reshardable", "parallel"):
        state = model_sharded_state(engine.unwrapped())
        state["optimizer"] = optimizer_sharded_state(engine.optimizer, state, is_loading=False,
                                                     optimizer_format=optimizer_format)
        (Path(root) / optimizer_format).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(state, str(Path(root) / optimizer_format))
    shutdown()


def _load_both_formats_worker(rank: int, world_size: int, root: str, out: str) -> None:
    """Both checkpoints loaded at another data-parallel size: the reshardable one (the reference) and the parallel."""
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    overrides, bucket_numel = DP3_BUCKETS
    _with_buckets_of(bucket_numel)
    cfg = build_config({}, MODEL + PARALLEL + overrides, world_size)
    initialize(cfg.parallel, seed=0)
    engines = {}
    for optimizer_format in ("reshardable", "parallel"):
        engines[optimizer_format] = build_engine(cfg)
        load_training_checkpoint(Path(root) / optimizer_format, engines[optimizer_format].unwrapped(),
                                 engines[optimizer_format].optimizer, restore_rng=False,
                                 optimizer_format=optimizer_format)
    reference, parallel = engines["reshardable"], engines["parallel"]
    report = {"padding": _padding_between_buckets(parallel),
              "adam_states_equal": all(torch.equal(a, b) for a, b in zip(_adam_states(reference),
                                                                          _adam_states(parallel), strict=True)),
              "main_params_equal": all(torch.equal(a, b) for a, b in zip(
                  *([main for inner in engine.optimizer.chained_optimizers for group in inner.optimizer.param_groups
                     for main in group["params"]] for engine in (reference, parallel)), strict=True)),
              "next_losses": [_step_all_chunks(engine, cfg) for engine in (reference, parallel)]}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def test_a_parallel_checkpoint_of_padded_buckets_loads_at_another_data_parallel_size(tmp_path):
    """Saved at DP=3 (buckets padded to lcm(3, 128)), loaded at DP=2 (padded to 128): each rank's state is what the
    reshardable checkpoint of the same state gives it."""
    out = tmp_path / "report.json"
    run_ranks(3, _save_both_formats_worker, str(tmp_path))
    run_ranks(2, _load_both_formats_worker, str(tmp_path), str(out))
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert any(report["padding"] for report in reports), "no padding between buckets: the layout goes unexercised"
    for rank, report in enumerate(reports):
        assert report["adam_states_equal"] and report["main_params_equal"], rank
        reference, parallel = report["next_losses"]
        assert parallel == reference, rank
