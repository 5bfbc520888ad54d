"""Where the model lives when megatron does not initialise it on the CPU, checked without a GPU.

On a GPU, megatron's layers allocate on `torch.cuda.current_device()` and its RoPE moves there
at the first forward, whatever else the model holds; a parameter or tensor megadiff creates on
the CPU then breaks the first step, and only on a GPU. Here the meta device stands in for the
current CUDA device: the model is built as on a GPU (`use_cpu_initialization=False`), then
every parameter and buffer must be on the stand-in, and a forward and backward must run there,
which fails on any CPU tensor mixed into the computation (as it fails on a GPU).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.distributed import run_ranks

STAND_IN = "meta"
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=256",
         "model.make_vocab_size_divisible_by=64", "model.seq_length=32", "train.precision=bf16"]
CASES = {
    "softmax": ["model.variant=softmax"],
    "diff": ["model.variant=diff", "model.tie_embeddings=true"],
    "dint": ["model.variant=dint", "model.attention_backend=reference"],
    "shared_diff": ["model.variant=shared_diff", "model.lowrank_rank=4"],
    "diff_full_recompute": ["model.variant=diff", "train.recompute=full"],
}
if importlib.util.find_spec("torchao"):  # float8 linear layers (emulated off CUDA)
    CASES["diff_fp8_torchao"] = ["model.variant=diff", "model.hidden_size=128", "train.precision=fp8",
                                 "train.fp8_backend=torchao"]


def _placement(chunk) -> dict:
    tensors = list(chunk.named_parameters()) + list(chunk.named_buffers())
    rope = chunk.rotary_pos_emb.inv_freq
    return {"off_device": [name for name, t in tensors if t.device.type != STAND_IN],
            "tensors": len(tensors), "rope": rope.device.type}


def _forward_backward(chunk, seq: int) -> dict:
    tokens = torch.zeros(2, seq, dtype=torch.long, device=STAND_IN)
    positions = torch.arange(seq, device=STAND_IN).expand(2, seq)
    try:
        per_token_loss = chunk(tokens, positions, None, labels=tokens)
        per_token_loss.float().sum().backward()
    except RuntimeError as err:  # a CPU tensor met the stand-in device
        return {"error": str(err).splitlines()[0]}
    return {"loss_device": per_token_loss.device.type,
            "grads_off_device": [name for name, p in chunk.named_parameters()
                                 if p.grad is None or p.grad.device.type != STAND_IN]}


def worker(rank: int, world_size: int, out_path: str) -> None:
    from megadiff.config import build_config
    from megadiff.models import build_model, to_transformer_config
    from megadiff.parallel import initialize, shutdown

    results = {}
    for name, overrides in CASES.items():
        cfg = build_config({}, MODEL + overrides, world_size)
        initialize(cfg.parallel, seed=3)
        cpu_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: STAND_IN
        try:
            config = to_transformer_config(cfg)
            config.use_cpu_initialization = False  # as on a GPU
            (chunk,) = build_model(cfg, config)
            results[name] = {**_placement(chunk), **_forward_backward(chunk, cfg.model.seq_length)}
        finally:
            torch.cuda.current_device = cpu_device
        shutdown()
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement") / "placement.json"
    run_ranks(1, worker, str(path))
    return json.loads(path.read_text())


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_and_buffer_is_on_the_compute_device(placements, case):
    result = placements[case]
    assert result["tensors"] > 0
    assert result["off_device"] == [], f"left off the compute device: {result['off_device']}"
    assert result["rope"] == STAND_IN


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_stay_on_the_compute_device(placements, case):
    result = placements[case]
    assert "error" not in result, result.get("error")
    assert result["loss_device"] == STAND_IN
    assert result["grads_off_device"] == []
