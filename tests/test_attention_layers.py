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


def projections_softmax(p: dict, x: torch.Tensor):
    """Rows of megatron's fused QKV weight: KV_HEADS groups of [q heads of the group | k | v]."""
    per_group = HEADS // KV_HEADS
    rows = p["linear_qkv.weight"].view(KV_HEADS, per_group + 2, HEAD_DIM, D_MODEL)
    q_heads = rows[:, :per_group].reshape(HEADS, HEAD_DIM, D_MODEL)
    return [x @ w.T for w in q_heads], [x @ w.T for w in rows[:, per_group]], [x @ w.T for w in rows[:, per_group + 1]]


def differential_heads(p: dict, xb: torch.Tensor, variant: str, lambda_init: float) -> list[torch.Tensor]:
    lam = (torch.exp((p["core_attention.lambda_q1"] * p["core_attention.lambda_k1"]).sum())
           - torch.exp((p["core_attention.lambda_q2"] * p["core_attention.lambda_k2"]).sum()) + lambda_init)
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
        heads.append(head)
    return heads


def softmax_heads(p: dict, xb: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = projections_softmax(p, xb)
    return [causal_softmax(rope(q[i]), rope(k[i // (HEADS // KV_HEADS)])) @ v[i // (HEADS // KV_HEADS)]
            for i in range(HEADS)]


def head_norm(head: torch.Tensor, p: dict, scale: float) -> torch.Tensor:
    """The paper's GroupNorm: RMSNorm of one head's output, times a fixed scale."""
    rms = torch.sqrt((head ** 2).mean(-1, keepdim=True) + 1e-5)
    return scale * head / rms * p["core_attention.head_norm_weight"]


def naive_layer(p: dict, x: torch.Tensor, variant: str, lambda_init: float, normed: bool = True) -> torch.Tensor:
    """x: [seq, batch, D] -> [seq, batch, D] for one batch element at a time. `normed`: the head-wise norm,
    with DIFF's (1 - lambda_init) multiplier on the differential variants (none on softmax)."""
    scale = 1.0 if variant == "softmax" else 1 - lambda_init
    outputs = []
    for b in range(x.shape[1]):
        xb = x[:, b]
        heads = softmax_heads(p, xb) if variant == "softmax" else differential_heads(p, xb, variant, lambda_init)
        heads = [head_norm(head, p, scale) if normed else head for head in heads]
        outputs.append(torch.cat(heads, -1) @ p["linear_proj.weight"].T)
    return torch.stack(outputs, dim=1)


# layer_worker's models: (the formula's variant, lambda_init if not the depth schedule's, head-wise norm)
FORMULAS = {"diff": ("diff", None, True), "dint": ("dint", None, True), "shared_diff": ("shared_diff", None, True),
            "diff_constant_lambda": ("diff", 0.5, True), "diff_no_head_norm": ("diff", None, False),
            "softmax_head_norm": ("softmax", None, True)}


@pytest.mark.parametrize("variant", FORMULAS)
def test_layer_matches_paper_formula(layer_results, variant):
    res = layer_results[variant]
    formula, constant, normed = FORMULAS[variant]
    lambda_init = constant if constant is not None else 0.8 - 0.6 * math.exp(-0.3 * (LAYER_NUMBER - 1))
    params = {k: v.double().requires_grad_() for k, v in res["params"].items()}
    x = res["x"].double().requires_grad_()
    expected = naive_layer(params, x, formula, lambda_init, normed)
    torch.testing.assert_close(res["out"].double(), expected.detach(), rtol=1e-4, atol=1e-5)
    expected.backward(res["grad_out"].double())
    torch.testing.assert_close(res["grad_x"].double(), x.grad, rtol=1e-4, atol=1e-5)
    assert set(res["grads"]) == set(params)
    for name, grad in res["grads"].items():
        assert params[name].grad is not None, name
        torch.testing.assert_close(grad.double(), params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_shapes(layer_results):
    assert layer_results["diff"]["out"].shape == (SEQ, BATCH, D_MODEL)


def _build_attention(overrides: list[str]):
    """megadiff's attention layer for layer_worker's small model plus `overrides`, as training builds it."""
    from megatron.core.transformer.spec_utils import build_module

    from megadiff.config import build_config
    from megadiff.models.specs import layer_spec
    from megadiff.models.transformer_config import to_transformer_config
    from megadiff.parallel import initialize
    from tests.layer_worker import MODEL

    cfg = build_config({}, MODEL + overrides, 1)
    initialize(cfg.parallel, seed=7)
    config = to_transformer_config(cfg)
    return cfg, build_module(layer_spec(config).submodules.self_attention, config=config, layer_number=LAYER_NUMBER)


def _zero_init_worker(rank: int, world_size: int, out_path: str) -> None:
    from megadiff.parallel import shutdown

    cfg, attention = _build_attention(["model.variant=shared_diff", "model.lowrank_rank=3"])
    x = torch.randn(SEQ, BATCH, D_MODEL)
    with torch.no_grad():
        qkv, _ = attention.linear_qkv(x)
    torch.save(dict(zero_init=cfg.model.lowrank_zero_init, x=x, qkv=qkv,
                    params={k: p.detach().clone() for k, p in attention.linear_qkv.named_parameters()}), out_path)
    shutdown()


def test_shared_diff_starts_as_attention_with_shared_projections(tmp_path):
    """SPEC section 2: by default one factor of each low-rank update starts at zero, so at initialisation the two
    maps of every head share their projections, Q1 = Q2 = X W_Q and K1 = K2 = X W_K, exactly (every other test
    turns lowrank_zero_init off so that each factor gets a gradient). The other factor is random, LoRA style: the
    zero one's gradient flows through it."""
    run_ranks(1, _zero_init_worker, str(tmp_path / "qkv.pt"))
    res = torch.load(tmp_path / "qkv.pt")
    assert res["zero_init"]  # the default config
    params = res["params"]
    assert params["lowrank_down"].abs().min() > 0
    # the layer's QKV output in megatron's DIFF layout (as projections_diff reads the fused weight's rows)
    per_group = HEADS // KV_HEADS
    rows = res["qkv"].view(SEQ, BATCH, 2 * KV_HEADS, per_group + 2, HEAD_DIM)
    q_heads = rows[..., :per_group, :].reshape(SEQ, BATCH, 2 * HEADS, HEAD_DIM)
    q1, q2 = q_heads[..., 0::2, :], q_heads[..., 1::2, :]
    k1, k2 = rows[..., 0::2, per_group, :], rows[..., 1::2, per_group, :]
    v = rows[..., per_group + 1, :].reshape(SEQ, BATCH, KV_HEADS, 2 * HEAD_DIM)
    assert torch.equal(q1, q2), "Q1 != Q2 at initialisation"
    assert torch.equal(k1, k2), "K1 != K2 at initialisation"
    # the plain shared projection X W, in float64, split as projections_shared splits W
    plain = (res["x"].double() @ params["shared.weight"].double().T).view(SEQ, BATCH, KV_HEADS, -1)
    w_q, w_k, w_v = plain.split([per_group * HEAD_DIM, HEAD_DIM, 2 * HEAD_DIM], dim=-1)
    torch.testing.assert_close(q1.double(), w_q.reshape(SEQ, BATCH, HEADS, HEAD_DIM), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k1.double(), w_k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), w_v, rtol=1e-5, atol=1e-6)


LAMBDA_HEAD_DIM = 128  # the lambda vectors' length: samples enough for their std


def _lambda_init_worker(rank: int, world_size: int, out_path: str) -> None:
    from megadiff.parallel import shutdown

    vectors = {}
    for overrides in ([], ["model.lambda_std=0.3"]):
        cfg, attention = _build_attention(["model.variant=diff", f"model.head_dim={LAMBDA_HEAD_DIM}", *overrides])
        core = attention.core_attention
        vectors[cfg.model.lambda_std] = [getattr(core, f"lambda_{name}").detach().clone()
                                         for name in ("q1", "k1", "q2", "k2")]
    torch.save(vectors, out_path)
    shutdown()


def test_lambda_vectors_start_normal_with_the_configured_std(tmp_path):
    """DIFF eq. 2's lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init starts near lambda_init only because the
    vectors start small: each of the four is drawn from N(0, model.lambda_std^2) (the default and another value),
    independently. Bounds: 5 standard errors of a normal sample's std (sigma / sqrt(2 (n - 1))) and mean."""
    run_ranks(1, _lambda_init_worker, str(tmp_path / "lambda.pt"))
    vectors = torch.load(tmp_path / "lambda.pt")
    assert len(vectors) == 2
    n = LAMBDA_HEAD_DIM
    for std, drawn in vectors.items():
        for index, vector in enumerate(drawn):
            assert vector.shape == (n,) and vector.dtype == torch.float32
            assert abs(vector.std().item() - std) < 5 * std / math.sqrt(2 * (n - 1)), (std, index, vector.std())
            assert abs(vector.mean().item()) < 5 * std / math.sqrt(n), (std, index, vector.mean())
            assert not any(torch.equal(vector, other) for other in drawn[index + 1:])


# on a CPU torch tries its flash kernel before math whatever the order (the order is CUDA's): a list leaving
# flash out is what makes it run math here
SDPA_ORDERS = ([], ["model.sdpa_kernels=[math]"], ["model.sdpa_kernels=[flash,math]"])
SDPA_LAYERS = {"softmax": ["model.variant=softmax"], "diff-sdpa": ["model.attention_backend=sdpa"],
               "dint-sdpa_split_v": ["model.variant=dint", "model.attention_backend=sdpa_split_v"]}


def _sdpa_order_worker(rank: int, world_size: int, out_path: str) -> None:
    """Each layer's forward and backward under each SDPA kernel order, with the kernel torch chose for every
    SDPA call (its own dispatcher's answer, asked at the call)."""
    import torch.nn.functional as F

    from megadiff.parallel import shutdown

    sdpa = F.scaled_dot_product_attention
    chosen = []

    def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        chosen.append(int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = recording_sdpa
    results = {}
    for layer, layer_overrides in SDPA_LAYERS.items():
        for order in SDPA_ORDERS:
            _, attention = _build_attention(layer_overrides + order)
            x = torch.randn(SEQ, BATCH, D_MODEL, generator=torch.Generator().manual_seed(3), requires_grad=True)
            chosen.clear()
            out, _ = attention(x, attention_mask=None)
            out.sum().backward()
            results[layer, tuple(order)] = dict(kernels=list(chosen), out=out.detach(), grad_x=x.grad,
                                                priority_after=torch._C._get_sdp_priority_order(),
                                                flash_enabled=torch.backends.cuda.flash_sdp_enabled())
    torch.save(dict(results=results, priority_before=torch._C._get_sdp_priority_order()), out_path)
    shutdown()


def test_model_sdpa_kernels_sets_the_kernel_every_sdpa_call_runs(tmp_path):
    """model.sdpa_kernels reaches each SDPA call of the softmax baseline and of both SDPA differential backends
    (the chosen kernel is one listed), leaves torch's settings as they were, and changes the kernel, not the
    result."""
    from torch.nn.attention import SDPBackend

    run_ranks(1, _sdpa_order_worker, str(tmp_path / "orders.pt"))
    saved = torch.load(tmp_path / "orders.pt")
    flash, math_ = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.MATH)
    # SDPA calls per forward, and the kernel torch picks by default: CPU flash needs V as wide as Q and K
    defaults = {"softmax": [flash], "diff-sdpa": [math_] * 2, "dint-sdpa_split_v": [flash] * 4}
    results = saved["results"]
    for layer, default_kernels in defaults.items():
        default, math_only, flash_first = (results[layer, tuple(order)] for order in SDPA_ORDERS)
        assert default["kernels"] == default_kernels, (layer, default["kernels"])
        assert math_only["kernels"] == [math_] * len(default_kernels), (layer, math_only["kernels"])
        assert flash_first["kernels"] == default_kernels, (layer, flash_first["kernels"])
        for run_ in (math_only, flash_first):
            assert run_["priority_after"] == saved["priority_before"] and run_["flash_enabled"]
            torch.testing.assert_close(run_["out"], default["out"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(run_["grad_x"], default["grad_x"], rtol=1e-4, atol=1e-5)
