"""Memory per GPU (`megadiff params`) against real gloo ranks: the model states against what the
ranks hold after a training step (the most loaded rank's parameters exactly, and its tensors'
bytes), the activations against the storages autograd keeps for backward during one."""
from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import pytest
import torch

from megadiff.cli import main
from megadiff.config import ConfigError, build_config, load_config
from megadiff.models.activation_memory import activation_memory
from megadiff.models.memory import (
    GIB, activations_warning, check_fits, describe_activations, estimate_activations, model_state_memory,
)
from tests.distributed import run_ranks
from tests.memory_worker import MODEL, measure, measure_activations

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
    assert ("per GPU on 64 ranks (TP 2, PP 2, CP 1, DP 16; bf16, distributed optimizer; micro-batch 8 x 2048 tokens, "
            "recompute none), the most loaded rank:") in out
    assert f"parameters         {memory.parameters:,}" in out
    # bf16 weights, fp32 gradients, fp32 main weights + two moments split over the 16 data-parallel ranks
    assert memory.total == pytest.approx(memory.parameters * (2 + 4 + 12 / 16), abs=1)
    assert f"model states       {memory.total / GIB:.2f} GiB, before activations" in out
    activations = activation_memory(load_config(config, overrides, world_size=64), 64)
    assert f"activations        {describe_activations(activations)}" in out
    assert f"peak estimate      {(memory.total + activations.total) / GIB:.2f} GiB" in out


LAYOUT_ROW = re.compile(r"^ +(\d+) +(\d+)  (none|selective|full) +([\d.]+) GiB +([\d.]+) GiB +([\d.]+) GiB$", re.M)


def test_params_lists_the_layouts_that_fit(capsys):
    config = Path(__file__).resolve().parents[1] / "configs" / "diff-3b.yaml"
    assert main(["params", "--world-size", "8", "--fit", "80", str(config)]) == 0
    rows = LAYOUT_ROW.findall(capsys.readouterr().out)
    assert rows

    def peak(tensor, pipeline, recompute) -> tuple[float, float]:
        cfg = load_config(config, [f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}",
                                   f"parallel.sequence_parallel={str(tensor > 1).lower()}",
                                   f"train.recompute={recompute}"], world_size=8)
        return model_state_memory(cfg, 8).total / GIB, activation_memory(cfg, 8).total / GIB

    for tensor, pipeline, recompute, states, activations, total in rows:
        expected_states, expected_activations = peak(int(tensor), int(pipeline), recompute)
        assert (float(states), float(activations)) == pytest.approx((expected_states, expected_activations), abs=0.01)
        assert float(total) <= 80
    # one 8-GPU node without model parallelism fits only by recomputing whole layers
    assert sum(peak(1, 1, "selective")) > 80 and rows[0][:3] == ("1", "1", "full")
    splits = [int(tensor) * int(pipeline) for tensor, pipeline, *_ in rows]
    assert splits == sorted(splits)  # the fewest model-parallel ranks first
    assert len({(tensor, pipeline) for tensor, pipeline, *_ in rows}) == len(rows)  # the least recompute of each


def test_params_checks_the_batch_sizes_of_its_default_world(capsys):
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo" / "diff-tiny.yaml")
    assert main(["params", config, "train.micro_batch_size=3"]) == 2
    assert "config error: train.global_batch_size: 4 is not divisible by train.micro_batch_size x data-parallel " \
           "size (3 x 1)" in capsys.readouterr().err


def test_a_layout_whose_model_states_exceed_the_gpu_is_refused():
    config = Path(__file__).resolve().parents[1] / "configs" / "scaling" / "diff-13.1b.yaml"
    on_8_gpus = model_state_memory(load_config(config, ["train.precision=bf16"], world_size=8), 8)
    assert on_8_gpus.total > 80 * GIB
    with pytest.raises(ConfigError, match=rf"parallel: the most loaded GPU needs {on_8_gpus.total / GIB:.1f} GiB "
                                          r".* than its 80\.0 GiB; raise parallel.tensor"):
        check_fits(on_8_gpus, 80 * GIB)
    split = ["train.precision=bf16", "parallel.tensor=4", "parallel.pipeline=2", "parallel.distributed_optimizer=true"]
    check_fits(model_state_memory(load_config(config, split, world_size=64), 64), 80 * GIB)


# SDPA-composed attention with split V: CPU SDPA runs its flash kernel only for equal Q/K/V widths
ACTIVATION_BASE = ["model.attention_backend=sdpa_split_v", "model.seq_length=64"]
ACTIVATION_LAYOUTS = {
    "diff fp32": (1, []),
    "dint bf16 selective recompute": (1, ["model.variant=dint", "train.precision=bf16", "train.recompute=selective"]),
    "softmax full recompute, 2 sequences": (1, ["model.variant=softmax", "train.recompute=full",
                                                "train.micro_batch_size=2", "train.global_batch_size=2"]),
    "shared diff tp2 sequence parallel": (2, ["model.variant=shared_diff", "model.lowrank_rank=8",
                                              "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "interleaved pp2": (2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.global_batch_size=4"]),
    "cp2": (2, ["parallel.context=2"]),
    "dint bf16 cp2": (2, ["model.variant=dint", "train.precision=bf16", "parallel.context=2"]),
    # at 2 ranks the gathered K and V are as large as what CP=1 keeps: 4 tell them apart
    "softmax cp4": (4, ["model.variant=softmax", "parallel.context=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ACTIVATION_LAYOUTS)
def test_activation_estimate_matches_what_autograd_keeps(layout):
    world_size, overrides = ACTIVATION_LAYOUTS[layout]
    results = multiprocessing.get_context("spawn").Queue()
    run_ranks(world_size, measure_activations, ACTIVATION_BASE + overrides, results)
    peaks = results.get()
    estimate = activation_memory(build_config({}, MODEL + ACTIVATION_BASE + overrides, world_size), world_size,
                                 device="cpu")
    # context parallelism: CPU SDPA falls back to its math kernel (and keeps the maps) for the
    # chunks whose queries see more keys than they are, where the fused kernel keeps none (more of them at 4)
    tolerance = {"cp2": 0.03, "dint bf16 cp2": 0.03, "softmax cp4": 0.05}.get(layout, 0.01)
    assert max(peaks) == pytest.approx(estimate.total, rel=tolerance)


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_activation_estimate_on_cuda runs the compiled kernel")
def test_dint_keeps_no_more_than_diff_with_the_fused_kernel(monkeypatch):
    """The kernel's autograd Function takes DINT's integral in and saves what it saves for DIFF: the estimate
    counted the integral's fp32 tensors as the SDPA path keeps them (9% more for DINT-3B, and --fit then
    recomputed where nothing had to be). Run under the Triton interpreter, which the ranks read at import."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    overrides = ["model.attention_backend=triton", "model.seq_length=64", "model.variant=dint"]
    results = multiprocessing.get_context("spawn").Queue()
    run_ranks(1, measure_activations, overrides, results, fresh=True)
    estimate = activation_memory(build_config({}, MODEL + overrides, 1), 1, device="cpu")
    assert results.get()[0] == pytest.approx(estimate.total, rel=0.01)


def test_what_is_not_estimated_and_what_is_only_warned_about():
    config = Path(__file__).resolve().parents[1] / "configs" / "diff-3b.yaml"
    assert estimate_activations(load_config(config, ["model.attention_backend=reference"]), 1) == (
        "not estimated: attention backend 'reference' on cuda keeps the N x N maps")
    cfg = load_config(config, ["parallel.distributed_optimizer=true", "train.micro_batch_size=8"], world_size=64)
    states, activations = model_state_memory(cfg, 64), activation_memory(cfg, 64)
    assert states.total < 80 * GIB < states.total + activations.total
    assert activations_warning(states, activations, 80 * GIB).startswith(
        f"warning: the most loaded GPU is estimated to need {(states.total + activations.total) / GIB:.1f} GiB")
    assert activations_warning(states, activations, 141 * GIB) is None
    # on CUDA `auto` is the fused kernel where its tile holds the heads (d = 128: V 256 wide), else SDPA
    for head_dim, chosen in ((128, "triton"), (160, "sdpa")):
        shape = ["model.hidden_size=3840", "model.num_attention_heads=12", f"model.head_dim={head_dim}"]
        assert activation_memory(load_config(config, shape + ["model.attention_backend=auto"]), 1) == \
            activation_memory(load_config(config, shape + [f"model.attention_backend={chosen}"]), 1)
    # the 64K recipe recomputes whole layers: each keeps its input, the loss's logits dominate
    long = load_config(Path(config).with_name("diff-3b-64k.yaml"), [], world_size=64)
    assert activations_warning(model_state_memory(long, 64), activation_memory(long, 64), 80 * GIB) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["diff", "dint"])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "sdpa_split_v"])
def test_activation_estimate_on_cuda(backend, variant):
    """torch's fused rms_norm, megatron's fused SwiGLU, the Triton kernel and the SDPA backends' compiled
    combination (with DINT's running mean) save what the CUDA accounting says."""
    # auto: the fused kernel at d = 128, dv = 256, whose compiled variants the kernel tests leave cached
    overrides = ["train.precision=bf16", "model.seq_length=256", f"model.attention_backend={backend}",
                 "model.hidden_size=512", "model.num_attention_heads=2", f"model.variant={variant}"]
    results = multiprocessing.get_context("spawn").Queue()
    run_ranks(1, measure_activations, overrides, results)
    estimate = activation_memory(build_config({}, MODEL + overrides, 1), 1, device="cuda")
    assert results.get()[0] == pytest.approx(estimate.total, rel=0.01)
