"""Float8 linear layers (train.fp8_backend=torchao) against a naive float8 emulation written here.

Tensorwise dynamic scaling: scale = fmax / amax(t), t8 = cast(clamp(t * scale)), t ~ t8 / scale.
Forward Y = X W^T uses e4m3 for X and W; backward dX = dY W and dW = dY^T X use e5m2 for dY.
On CPU the layers run torchao's emulation (float8 casts, fp32 matmuls), so they must match the
naive emulation up to summation order, and the exact result within the float8 error bound below.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="torchao is not installed")

from megadiff.config import ConfigError, build_config  # noqa: E402
from megadiff.models.float8 import float8_matmul  # noqa: E402
from megadiff.models.transformer_config import to_transformer_config  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# unit roundoff (half the relative spacing: 3 and 2 mantissa bits) and half the subnormal spacing
UNIT_ROUNDOFF = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
HALF_SUBNORMAL_STEP = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}


def fake_quant(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as float8 with one scale for the whole tensor, back in fp32."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / t.abs().max().double().clamp(min=1e-12)).float()
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def float8_matmul_naive(a: torch.Tensor, b: torch.Tensor, fmt_a, fmt_b) -> torch.Tensor:
    return fake_quant(a, fmt_a) @ fake_quant(b, fmt_b)


def float8_error_bound(a: torch.Tensor, b: torch.Tensor, fmt_a, fmt_b) -> torch.Tensor:
    """Elementwise bound on |fp8(a) @ fp8(b) - a @ b|.

    Casting t to float8 with scale s errs by at most u|t| + h/s per element (u: unit roundoff,
    h: half the subnormal step, for values that land among the subnormals), so with
    da = u_a|a| + h_a/s_a and db likewise: |error| <= da|b| + |a|db + da db.
    """
    def per_element(t, fmt):
        scale = torch.finfo(fmt).max / t.abs().max()
        return UNIT_ROUNDOFF[fmt] * t.abs() + HALF_SUBNORMAL_STEP[fmt] / scale

    a, b = a.double(), b.double()
    da, db = per_element(a, fmt_a), per_element(b, fmt_b)
    return da @ b.abs() + a.abs() @ db + da @ db


def _layer_inputs(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=gen).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(48, 64, generator=gen)).to(dtype).requires_grad_()
    grad = torch.randn(5, 7, 48, generator=gen).to(dtype)
    return x, w, grad


def test_matmul_matches_naive_float8_emulation():
    x, w, grad = _layer_inputs()
    out = float8_matmul(x, w)
    out.backward(grad)
    x2, g2 = x.detach().reshape(-1, 64), grad.reshape(-1, 48)
    want = {"out": float8_matmul_naive(x2, w.detach().T, E4M3, E4M3).view_as(out),
            "grad_x": float8_matmul_naive(g2, w.detach(), E5M2, E4M3).view_as(x),
            "grad_w": float8_matmul_naive(g2.T, x2, E5M2, E4M3)}
    got = {"out": out.detach(), "grad_x": x.grad, "grad_w": w.grad}
    for name in want:  # both rounded to bf16 (the input dtype); they may differ in that last rounding
        assert got[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(got[name], want[name].to(torch.bfloat16), msg=lambda m: f"{name}: {m}")


def test_matmul_error_within_float8_bound():
    """Against the exact fp64 products of the same bf16 inputs; the result's own bf16 rounding
    (2^-8 relative) and fp32 accumulation (2^-24 per product, far smaller) are added to the bound."""
    x, w, grad = _layer_inputs()
    out = float8_matmul(x, w)
    out.backward(grad)
    x2, g2, w2 = x.detach().reshape(-1, 64).double(), grad.reshape(-1, 48).double(), w.detach().double()
    cases = {"out": (out.detach().reshape(-1, 48), x2, w2.T, E4M3, E4M3),
             "grad_x": (x.grad.reshape(-1, 64), g2, w2, E5M2, E4M3),
             "grad_w": (w.grad, g2.T, x2, E5M2, E4M3)}
    for name, (got, a, b, fmt_a, fmt_b) in cases.items():
        exact = a @ b
        bound = 1.001 * float8_error_bound(a, b, fmt_a, fmt_b)
        allowed = bound + 2.0 ** -8 * (exact.abs() + bound)
        error = (got.double() - exact).abs()
        assert (error <= allowed).all(), f"{name}: error {(error - allowed).max():.3e} above the float8 bound"
        # float8 is really in use: its error is far above what bf16 alone would give
        assert error.max() > 4 * 2.0 ** -8 * exact.abs().max(), f"{name}: error too small for float8"


# ---- tensor parallelism and a tiny model, on 2 gloo ranks --------------------------------------

SEQ, BATCH, IN, OUT = 8, 2, 32, 64
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=256",
         "model.make_vocab_size_divisible_by=64", "model.seq_length=32", "model.attention_backend=sdpa",
         "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2",
         "train.global_batch_size=2", "train.lr=0.003"]
FLOAT8 = ["train.precision=fp8", "train.fp8_backend=torchao"]


def _global_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"x_col": torch.randn(SEQ, BATCH, IN, generator=gen), "w_col": 0.2 * torch.randn(OUT, IN, generator=gen),
            "g_col": torch.randn(SEQ, BATCH, OUT, generator=gen), "x_row": torch.randn(SEQ, BATCH, OUT, generator=gen),
            "w_row": 0.2 * torch.randn(IN, OUT, generator=gen), "g_row": torch.randn(SEQ, BATCH, IN, generator=gen)}


def _run_parallel_layers(rank: int, sequence_parallel: bool) -> dict:
    """One float8 column- and row-parallel layer with this rank's shards of the global tensors (fp32)."""
    from megadiff.models.float8 import Float8ColumnParallelLinear, Float8RowParallelLinear

    cfg = build_config({}, ["parallel.tensor=2", f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
                            "model.seq_length=8"], world_size=2)
    config = to_transformer_config(cfg)
    t = _global_tensors()
    half_out, half_seq = slice(rank * OUT // 2, (rank + 1) * OUT // 2), slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    init = torch.nn.init.zeros_
    column = Float8ColumnParallelLinear(IN, OUT, config=config, init_method=init, bias=False, gather_output=False)
    row = Float8RowParallelLinear(OUT, IN, config=config, init_method=init, bias=False, input_is_parallel=True,
                                  skip_bias_add=True)
    with torch.no_grad():
        column.weight.copy_(t["w_col"][half_out])
        row.weight.copy_(t["w_row"][:, half_out])
    x_col = (t["x_col"][half_seq] if sequence_parallel else t["x_col"]).clone().requires_grad_()
    x_row = t["x_row"][..., half_out].clone().requires_grad_()
    out_col, _ = column(x_col)
    out_col.backward(t["g_col"][..., half_out])
    out_row, _ = row(x_row)
    out_row.backward(t["g_row"][half_seq] if sequence_parallel else t["g_row"])
    return {"out_col": out_col.detach(), "grad_x_col": x_col.grad, "grad_w_col": column.weight.grad,
            "out_row": out_row.detach(), "grad_x_row": x_row.grad, "grad_w_row": row.weight.grad}


def _train_losses(overrides: list[str], steps: int) -> tuple[list[float], list[str]]:
    from megadiff.parallel.initialize import set_seed
    from megadiff.training.engine import build_engine
    from megadiff.training.step import train_step

    cfg = build_config({}, MODEL + overrides, world_size=2)
    set_seed(5)  # the same initial weights for every precision
    engine = build_engine(cfg)
    (model,) = engine.unwrapped()
    layer = model.decoder.layers[0]
    kinds = [type(m).__name__ for m in (layer.self_attention.linear_qkv, layer.mlp.linear_fc2, model.output_layer)]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=torch.arange(32).expand(2, -1),
                 loss_mask=torch.ones(2, 32))
    return [train_step(engine, iter([batch]), 1).loss for _ in range(steps)], kinds


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    from megadiff.parallel import initialize, shutdown

    initialize(build_config({}, MODEL, world_size=2).parallel, seed=5)
    results = {f"sp={sp}": _run_parallel_layers(rank, sp) for sp in (False, True)}
    results["fp8"] = _train_losses(FLOAT8, steps=6)
    results["bf16"] = _train_losses(["train.precision=bf16"], steps=1)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("float8")
    run_ranks(2, _worker, str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_layers_match_per_shard_emulation(two_ranks, sequence_parallel):
    """Each rank scales its own shards; the input gradient of the column layer is summed over ranks
    (all-reduce, or reduce-scatter under SP) and the row layer's output likewise."""
    t = _global_tensors()
    ranks = [r[f"sp={sequence_parallel}"] for r in two_ranks]
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in t.items()}
    halves = [slice(0, OUT // 2), slice(OUT // 2, OUT)]
    fq = float8_matmul_naive
    want_col_out = [fq(flat["x_col"], t["w_col"][h].T, E4M3, E4M3) for h in halves]
    want_col_dx = sum(fq(flat["g_col"][:, h], t["w_col"][h], E5M2, E4M3) for h in halves)
    want_col_dw = [fq(flat["g_col"][:, h].T, flat["x_col"], E5M2, E4M3) for h in halves]
    want_row_out = sum(fq(flat["x_row"][:, h], t["w_row"][:, h].T, E4M3, E4M3) for h in halves)
    want_row_dx = [fq(flat["g_row"], t["w_row"][:, h], E5M2, E4M3) for h in halves]
    want_row_dw = [fq(flat["g_row"].T, flat["x_row"][:, h], E5M2, E4M3) for h in halves]

    def joined(key, dim=0):  # per-rank sequence shards (SP) back into one [SEQ*BATCH, width] tensor
        return torch.cat([r[key] for r in ranks], dim).reshape(-1, ranks[0][key].shape[-1])

    close = dict(rtol=1e-4, atol=1e-5)
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["out_col"].reshape(-1, OUT // 2), want_col_out[rank], **close)
        torch.testing.assert_close(result["grad_w_col"], want_col_dw[rank], **close)
        torch.testing.assert_close(result["grad_x_row"].reshape(-1, OUT // 2), want_row_dx[rank], **close)
        torch.testing.assert_close(result["grad_w_row"], want_row_dw[rank], **close)
        if not sequence_parallel:  # all-reduced: every rank holds the whole result
            torch.testing.assert_close(result["grad_x_col"].reshape(-1, IN), want_col_dx, **close)
            torch.testing.assert_close(result["out_row"].reshape(-1, IN), want_row_out, **close)
    if sequence_parallel:  # reduce-scattered along the sequence
        torch.testing.assert_close(joined("grad_x_col"), want_col_dx, **close)
        torch.testing.assert_close(joined("out_row"), want_row_out, **close)


def test_tiny_model_trains_in_float8_with_tensor_and_sequence_parallelism(two_ranks):
    (fp8_losses, kinds), (bf16_losses, _) = two_ranks[0]["fp8"], two_ranks[0]["bf16"]
    assert kinds == ["Float8ColumnParallelLinear", "Float8RowParallelLinear", "ColumnParallelLinear"]
    assert fp8_losses == two_ranks[1]["fp8"][0], "tensor-parallel ranks disagree on the loss"
    # same initial weights: the first loss is the bf16 model's up to float8 rounding
    assert fp8_losses[0] == pytest.approx(bf16_losses[0], rel=2e-2)
    assert fp8_losses[-1] < fp8_losses[0] - 0.3, f"the loss does not fall: {fp8_losses}"


# ---- config --------------------------------------------------------------------------------------

def _pretend_installed(monkeypatch, present: dict[str, bool]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if present[name] else None) if name in present else real(name, *a))


def test_config_selects_float8_linears_only_for_torchao():
    config = to_transformer_config(build_config({}, FLOAT8))
    assert config.float8_linears and config.fp8 is None and config.bf16  # no TransformerEngine context
    assert not to_transformer_config(build_config({}, ["train.precision=bf16"])).float8_linears


@pytest.mark.parametrize("overrides,present,key", [
    (FLOAT8 + ["model.transformer_impl=te"], {"transformer_engine": True}, "train.fp8_backend"),
    (["train.precision=fp8", "train.fp8_backend=te"], {}, "train.precision"),
    (FLOAT8, {"torchao": False}, "train.fp8_backend"),
])
def test_config_errors(monkeypatch, overrides, present, key):
    _pretend_installed(monkeypatch, present)
    with pytest.raises(ConfigError, match=key):
        build_config({}, overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with float8 tensor cores")
def test_scaled_mm_matches_emulation_on_gpu():
    """torch._scaled_mm (compiled casts) against the same recipe emulated: same scales, same casts;
    only the forward's fast accumulation and the bf16 output rounding differ."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = (0.05 * torch.randn(384, 512, generator=gen)).to("cuda", torch.bfloat16).requires_grad_()
    grad = torch.randn(256, 384, generator=gen).to("cuda", torch.bfloat16)
    out = float8_matmul(x, w)
    out.backward(grad)
    x_cpu, w_cpu = (t.detach().cpu().requires_grad_() for t in (x, w))
    want = float8_matmul(x_cpu, w_cpu)
    want.backward(grad.cpu())
    for got, ref in ((out, want), (x.grad, x_cpu.grad), (w.grad, w_cpu.grad)):
        rel = float((got.detach().cpu().float() - ref.detach().float()).norm() / ref.detach().float().norm())
        assert rel < 1e-2, rel
