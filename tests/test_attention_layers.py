"""The megatron attention layers of each variant against a naive, head-by-head
implementation of the papers' formulas (DIFF eq. 1-3, Shared DIFF eq. 3-4, DINT),
written here independently: outputs and every gradient."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_ranks
from tests.layer_worker import BATCH, LAYER_NUMBER, SEQ, run

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, THETA = 48, 4, 2, 8, 500.0


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("layers") / "layers.pt"
    run_ranks(1, run, str(path))
    return torch.load(path)


def rope(x: torch.Tensor) -> torch.Tensor:
    """x: [seq, d]; rotate pairs (i, i + d/2) by position * theta^(-2i/d)."""
    seq, d = x.shape
    inv_freq = THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[:, d // 2:], x[:, :d // 2]], dim=-1)
    return x * cos + rotated * sin


def causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    scores = q @ k.T / math.sqrt(HEAD_DIM)
    mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def projections_diff(p: dict, x: torch.Tensor):
    """Rows of megatron's fused QKV weight: 2*KV_HEADS groups of [q heads of the group | k | v]."""
    w = p["linear_qkv.weight"]
    per_group = HEADS // KV_HEADS  # megatron query heads per megatron group (2H heads, 2KV groups)
    rows = w.view(2 * KV_HEADS, per_group + 2, HEAD_DIM, D_MODEL)
    q_heads = rows[:, :per_group].reshape(2 * HEADS, HEAD_DIM, D_MODEL)
    k_heads, v_heads = rows[:, per_group], rows[:, per_group + 1]
    q1 = [x @ q_heads[2 * i].T for i in range(HEADS)]
    q2 = [x @ q_heads[2 * i + 1].T for i in range(HEADS)]
    k1 = [x @ k_heads[2 * j].T for j in range(KV_HEADS)]
    k2 = [x @ k_heads[2 * j + 1].T for j in range(KV_HEADS)]
    v = [torch.cat([x @ v_heads[2 * j].T, x @ v_heads[2 * j + 1].T], -1) for j in range(KV_HEADS)]
    return q1, q2, k1, k2, v


def projections_shared(p: dict, x: torch.Tensor, rank: int = 3):
    """W_Q1 = W_Q + A_q1 B_q1^T etc., W_Q/W_K shared, per SPEC section 2."""
    per_group = HEADS // KV_HEADS
    rows = p["linear_qkv.shared.weight"].view(KV_HEADS, per_group * HEAD_DIM + 3 * HEAD_DIM, D_MODEL)
    w_q = rows[:, :per_group * HEAD_DIM].reshape(HEADS, HEAD_DIM, D_MODEL)
    w_k = rows[:, per_group * HEAD_DIM:(per_group + 1) * HEAD_DIM]
    w_v = rows[:, (per_group + 1) * HEAD_DIM:]
    a = dict(zip(("q1", "q2", "k1", "k2"), p["linear_qkv.lowrank_down"].view(4, rank, D_MODEL)))
    b = {n: p[f"linear_qkv.lowrank_up_{n}.weight"] for n in ("q1", "q2", "k1", "k2")}
    full = {n: (b[n] @ a[n]).view(-1, HEAD_DIM, D_MODEL) for n in b}  # (A B^T)^T, head by head
    q1 = [x @ (w_q[i] + full["q1"][i]).T for i in range(HEADS)]
    q2 = [x @ (w_q[i] + full["q2"][i]).T for i in range(HEADS)]
    k1 = [x @ (w_k[j] + full["k1"][j]).T for j in range(KV_HEADS)]
    k2 = [x @ (w_k[j] + full["k2"][j]).T for j in range(KV_HEADS)]
    v = [x @ w_v[j].T for j in range(KV_HEADS)]
    return q1, q2, k1, k2, v


def naive_layer(p: dict, x: torch.Tensor, variant: str, lambda_init: float) -> torch.Tensor:
    """x: [seq, batch, D] -> [seq, batch, D] for one batch element at a time."""
    lam = (torch.exp((p["core_attention.lambda_q1"] * p["core_attention.lambda_k1"]).sum())
           - torch.exp((p["core_attention.lambda_q2"] * p["core_attention.lambda_k2"]).sum()) + lambda_init)
    outputs = []
    for b in range(x.shape[1]):
        xb = x[:, b]
        q1, q2, k1, k2, v = (projections_shared if variant == "shared_diff" else projections_diff)(p, xb)
        heads = []
        for i in range(HEADS):
            j = i // (HEADS // KV_HEADS)
            a1 = causal_softmax(rope(q1[i]), rope(k1[j]))
            a2 = causal_softmax(rope(q2[i]), rope(k2[j]))
            head = (a1 - lam * a2) @ v[j]
            if variant == "dint":  # A3: row i is the mean of rows 1..i of A1
                a3 = torch.cumsum(a1, 0) / torch.arange(1, SEQ + 1, dtype=a1.dtype)[:, None]
                head = head + lam * (a3 @ v[j])
            rms = torch.sqrt((head ** 2).mean(-1, keepdim=True) + 1e-5)
            heads.append((1 - lambda_init) * head / rms * p["core_attention.head_norm_weight"])
        outputs.append(torch.cat(heads, -1) @ p["linear_proj.weight"].T)
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("variant", ["diff", "dint", "shared_diff", "diff_constant_lambda"])
def test_layer_matches_paper_formula(layer_results, variant):
    res = layer_results[variant]
    lambda_init = 0.5 if variant == "diff_constant_lambda" else 0.8 - 0.6 * math.exp(-0.3 * (LAYER_NUMBER - 1))
    params = {k: v.double().requires_grad_() for k, v in res["params"].items()}
    x = res["x"].double().requires_grad_()
    expected = naive_layer(params, x, variant.replace("_constant_lambda", ""), lambda_init)
    torch.testing.assert_close(res["out"].double(), expected.detach(), rtol=1e-4, atol=1e-5)
    expected.backward(res["grad_out"].double())
    torch.testing.assert_close(res["grad_x"].double(), x.grad, rtol=1e-4, atol=1e-5)
    assert set(res["grads"]) == set(params)
    for name, grad in res["grads"].items():
        assert params[name].grad is not None, name
        torch.testing.assert_close(grad.double(), params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_shapes(layer_results):
    assert layer_results["diff"]["out"].shape == (SEQ, BATCH, D_MODEL)
