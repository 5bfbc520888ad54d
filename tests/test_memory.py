"""Model-state memory per GPU (`megadiff params`) against what real gloo ranks hold after a
training step: the most loaded rank's parameters exactly, and its tensors' bytes."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from megadiff.cli import main
from megadiff.config import ConfigError, build_config, load_config
from megadiff.models.memory import GIB, check_fits, model_state_memory
from tests.distributed import run_ranks
from tests.memory_worker import MODEL, measure

LAYOUTS = {
    "fp32": (1, ["train.precision=fp32"]),
    "bf16 dp2 distributed optimizer": (2, ["train.precision=bf16", "parallel.distributed_optimizer=true"]),
    "bf16 pp2": (2, ["train.precision=bf16", "parallel.pipeline=2"]),
    "shared diff tp2": (2, ["parallel.tensor=2", "model.variant=shared_diff", "model.lowrank_rank=8"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_estimate_matches_what_the_ranks_hold(layout):
    world_size, overrides = LAYOUTS[layout]
    results = multiprocessing.get_context("spawn").Queue()
    run_ranks(world_size, measure, overrides, results)
    rows = results.get()
    estimate = model_state_memory(build_config({}, MODEL + overrides, world_size), world_size)
    assert max(parameters for parameters, _ in rows) == estimate.parameters
    # weights, fp32 gradient buffers, optimizer state (+ megatron's bucket padding, a batch, RoPE tables)
    assert max(held for _, held in rows) == pytest.approx(estimate.total, rel=0.01)


def test_params_prints_the_memory_of_a_layout(capsys):
    config = str(Path(__file__).resolve().parents[1] / "configs" / "scaling" / "diff-13.1b.yaml")
    overrides = ["train.precision=bf16", "parallel.tensor=2", "parallel.pipeline=2",
                 "parallel.distributed_optimizer=true"]
    assert main(["params", "--world-size", "64", config, *overrides]) == 0
    out = capsys.readouterr().out
    memory = model_state_memory(load_config(config, overrides, world_size=64), 64)
    assert "per GPU on 64 ranks (TP 2, PP 2, CP 1, DP 16; bf16, distributed optimizer)" in out
    assert f"parameters         {memory.parameters:,}" in out
    # bf16 weights, fp32 gradients, fp32 main weights + two moments split over the 16 data-parallel ranks
    assert memory.total == pytest.approx(memory.parameters * (2 + 4 + 12 / 16), abs=1)
    assert f"model states       {memory.total / GIB:.2f} GiB, before activations" in out


def test_a_layout_whose_model_states_exceed_the_gpu_is_refused():
    config = Path(__file__).resolve().parents[1] / "configs" / "scaling" / "diff-13.1b.yaml"
    on_8_gpus = model_state_memory(load_config(config, ["train.precision=bf16"], world_size=8), 8)
    assert on_8_gpus.total > 80 * GIB
    with pytest.raises(ConfigError, match=rf"parallel: the most loaded GPU needs {on_8_gpus.total / GIB:.1f} GiB "
                                          r".* than its 80\.0 GiB; raise parallel.tensor"):
        check_fits(on_8_gpus, 80 * GIB)
    split = ["train.precision=bf16", "parallel.tensor=4", "parallel.pipeline=2", "parallel.distributed_optimizer=true"]
    check_fits(model_state_memory(load_config(config, split, world_size=64), 64), 80 * GIB)
