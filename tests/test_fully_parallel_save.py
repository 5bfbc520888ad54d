"""checkpoint.fully_parallel_save: the weights that data-parallel ranks hold alike are written by all of them, each
about its share, into the files a save by data-parallel rank 0 alone writes (any layout loads them alike).

The exact resume of the loss curve, and a load into another layout, run with it in tests/test_pretrain_resume.py
(it is the default)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megadiff.checkpoint.format import iteration_dir
from tests.distributed import run_ranks
from tests.parity_worker import MODEL
from tests.test_optimizer_checkpoint import STEPS, _step_all_chunks

# the optimizer's state replicated over data-parallel ranks too, as the weights are: all of a save spreads
SAVES = {"serial": ["checkpoint.fully_parallel_save=false"], "fully_parallel": [],
         "fully_parallel_async": ["checkpoint.async_save=true"]}


def _model(tokenizer_dir: str) -> list[str]:
    """A DIFF model of the tokenizer's vocabulary, which to-hf checks."""
    return MODEL + ["model.variant=diff", "model.vocab_size=512", f"data.tokenizer={tokenizer_dir}"]


def _config(world_size: int, model: list[str], overrides: list[str]):
    from megadiff.config import build_config

    return build_config({}, model + overrides, world_size)


def _save_worker(rank: int, world_size: int, root: str, model: list[str]) -> None:
    """One DP2 run trained STEPS steps, saved as each of SAVES."""
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    initialize(_config(world_size, model, []).parallel, seed=0)
    engine = build_engine(_config(world_size, model, []))
    for _ in range(STEPS):
        _step_all_chunks(engine, _config(world_size, model, []))
    for name, overrides in SAVES.items():
        cfg = _config(world_size, model, overrides)
        writer = CheckpointWriter(Path(root) / name, cfg, async_save=cfg.checkpoint.async_save)
        writer.save(STEPS, engine.unwrapped(), engine.optimizer, {"iteration": STEPS})
        writer.close()
    shutdown()


def _state(engine) -> list[torch.Tensor]:
    """Every weight and Adam moment of `engine`, in a fixed order."""
    weights = [tensor for chunk in engine.unwrapped() for _, tensor in sorted(chunk.state_dict().items())
               if isinstance(tensor, torch.Tensor)]
    moments = [tensor for state in engine.optimizer.optimizer.state.values() for key, tensor in sorted(state.items())]
    return weights + moments


def _load_worker(rank: int, world_size: int, root: str, out: str, model: list[str], overrides: list[str]) -> None:
    """Each save loaded into a fresh engine of this layout: whether each holds what the serial save gives."""
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    cfg = _config(world_size, model, overrides)
    initialize(cfg.parallel, seed=0)
    loaded = {}
    for name in SAVES:
        engine = build_engine(cfg)
        load_training_checkpoint(iteration_dir(Path(root) / name, STEPS), engine.unwrapped(), engine.optimizer,
                                 restore_rng=False)
        loaded[name] = _state(engine)
    report = {name: all(torch.equal(a, b) for a, b in zip(loaded["serial"], state, strict=True))
              for name, state in loaded.items()}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def _written_by(directory: Path, rank: int) -> int:
    """The bytes torch's checkpoint writer wrote for global rank `rank` (its files __RANK_*.distcp)."""
    return sum(path.stat().st_size for path in directory.glob(f"__{rank}_*.distcp"))


@pytest.fixture(scope="module")
def model(small_tokenizer_dir) -> list[str]:
    return _model(str(small_tokenizer_dir))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model) -> Path:
    root = tmp_path_factory.mktemp("saves")
    run_ranks(2, _save_worker, str(root), model)
    return root


@pytest.mark.parametrize("name", ["fully_parallel", "fully_parallel_async"])
def test_a_fully_parallel_save_has_each_data_parallel_rank_write_about_half(saved, name):
    """DP2: each rank writes about half of the checkpoint's tensors; the serial save (the control) has rank 0
    write them all, rank 1 only its own RNG state."""
    def shares(save: str) -> list[float]:
        written = [_written_by(iteration_dir(saved / save, STEPS), rank) for rank in range(2)]
        return [part / sum(written) for part in written]

    assert all(0.4 < share < 0.6 for share in shares(name)), shares(name)
    assert shares("serial")[1] < 0.05, shares("serial")


@pytest.mark.parametrize("world_size, overrides", [(1, []), (2, ["parallel.tensor=2"])], ids=["one_process", "tp2"])
def test_a_fully_parallel_save_loads_in_another_layout_as_the_serial_one(saved, model, tmp_path, world_size,
                                                                         overrides):
    out = tmp_path / "report.json"
    run_ranks(world_size, _load_worker, str(saved), str(out), model, overrides)
    for rank in range(world_size):
        report = json.loads(Path(f"{out}.{rank}").read_text())
        assert all(report.values()), (rank, report)


def _hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for path in sorted(directory.glob("*.safetensors"))
            for name, tensor in load_file(path).items()}


def test_a_fully_parallel_save_converts_to_hf_as_the_serial_one(saved, tmp_path):
    from megadiff.convert import convert_to_hf

    converted = {name: _hf_weights(convert_to_hf(iteration_dir(saved / name, STEPS), tmp_path / name, check=False))
                 for name in ("serial", "fully_parallel")}
    assert converted["serial"].keys() == converted["fully_parallel"].keys()
    assert all(torch.equal(tensor, converted["fully_parallel"][name]) for name, tensor in converted["serial"].items())
