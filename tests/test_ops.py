"""The differential-attention op: every implementation against a per-head loop of the
paper formula written here, in several dtypes, with gradients for all six inputs."""
from __future__ import annotations

import importlib.util
import math
import random
from types import SimpleNamespace

import pytest
import torch

from torch.nn.attention import SDPBackend

from megadiff.ops import (
    IntegralCarry, depth_lambda_init, differential_attention, differential_attention_reference,
    differential_attention_sdpa, paired_differential_attention, reparameterized_lambda, resolve_backend,
    sdpa_kernel_order, softmax_attention,
)
from megadiff.ops.reference import softmax_attention_reference
from megadiff.ops.sdpa import recording_sdpa_kernels

IMPLEMENTATIONS = {
    "reference": differential_attention_reference,
    "sdpa": differential_attention_sdpa,
    "sdpa_split_v": lambda *a, **k: differential_attention_sdpa(*a, split_v=True, **k),
}


def quantized_rows(s: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row's visible scores rounded to multiples of max|visible score| / (2^(bits-1) - 1)."""
    rows = []
    for row in s:
        visible = row.isfinite()
        step = row[visible].abs().max() / (2 ** (bits - 1) - 1)
        rows.append(torch.where(visible, torch.round(row / step) * step, row))
    return torch.stack(rows)


def paper_formula(q1, k1, q2, k2, v, lam, causal, integral, visible=None, logit_bits=None):
    """Loops over batch and heads; A = softmax(QK^T/sqrt(d) + M); (A1 - lam A2) V [+ lam A3 V].

    visible: [B, Nq, Nk] booleans, the keys each query sees (replaces the causal mask); A3's row i
    averages A1's rows over the positions query i sees. logit_bits: the scores QK^T/sqrt(d) of each
    query quantized (absmax over the keys it sees) before the softmax.
    """
    batch, n_q, heads, d = q1.shape
    n_k, kv_heads = k1.shape[1], k1.shape[2]
    lam = lam.expand(heads) if lam.dim() == 0 else lam
    out = torch.zeros(batch, n_q, heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            maps = []
            for q, k in ((q1, k1), (q2, k2)):
                s = q[b, :, h].double() @ k[b, :, g].double().T / math.sqrt(d)
                if visible is not None:
                    s = s.masked_fill(~visible[b], float("-inf"))
                elif causal:
                    for i in range(n_q):
                        s[i, n_k - n_q + i + 1:] = float("-inf")
                if logit_bits is not None:
                    s = quantized_rows(s, logit_bits)
                maps.append(torch.softmax(s, -1))
            vb = v[b, :, g].double()
            out[b, :, h] = (maps[0] - lam[h].double() * maps[1]) @ vb
            if integral:
                if visible is not None:
                    a3 = torch.stack([maps[0][visible[b, i]].mean(0) for i in range(n_q)])
                else:
                    a3 = torch.stack([maps[0][:i + 1].mean(0) if causal else maps[0].mean(0) for i in range(n_q)])
                out[b, :, h] += lam[h].double() * (a3 @ vb)
    return out


def make_inputs(batch=2, n=9, heads=4, kv_heads=2, d=8, dv=16, n_k=None, per_head=False, dtype=torch.float64,
                seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_k = n_k or n
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    lam = torch.rand(heads if per_head else (), generator=gen, dtype=torch.float64).to(torch.float32)
    return (rand(batch, n, heads, d), rand(batch, n_k, kv_heads, d), rand(batch, n, heads, d),
            rand(batch, n_k, kv_heads, d), rand(batch, n_k, kv_heads, dv), lam.requires_grad_())


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("integral", [False, True])
@pytest.mark.parametrize("shape", ["gqa", "mha", "dv_eq_d", "per_head_lambda"])
def test_matches_paper_formula_with_gradients(impl, causal, integral, shape):
    kwargs = dict(gqa={}, mha=dict(kv_heads=4), dv_eq_d=dict(dv=8), per_head_lambda=dict(per_head=True))[shape]
    inputs = make_inputs(**kwargs)
    out = IMPLEMENTATIONS[impl](*inputs, causal=causal, integral=integral)
    assert_matches_paper_formula(out, inputs, causal, integral)


def assert_matches_paper_formula(out, inputs, causal, integral, visible=None) -> None:
    """`out`, computed from `inputs`, and its gradients for all six inputs against the formula's.
    The formula's inputs are fp64 copies: its fp32 lambda would sum each use's gradient in fp32
    (the formula uses it per batch, head and term), off by up to half the tolerance, sometimes more."""
    leaves = [t.detach().to(torch.float64, copy=True).requires_grad_() for t in inputs]
    expected = paper_formula(*leaves, causal, integral, visible=visible)
    torch.testing.assert_close(out.double(), expected, rtol=1e-9, atol=1e-9)
    grad_out = torch.randn_like(expected)
    got = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    want = torch.autograd.grad(expected, leaves, grad_out)
    for name, g, w in zip(("q1", "k1", "q2", "k2", "v", "lam"), got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-6, msg=f"grad of {name}")


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("integral", [False, True])
def test_an_fp64_lambda_passes_a_gradient_check(impl, integral):
    """Finite differences of every input, lambda too: an fp64 lambda rounded to fp32 hides the check's
    perturbations of it (DINT's numerical gradient came out zero)."""
    inputs = make_inputs(n=5, heads=2, kv_heads=1, d=4, dv=4, per_head=True)
    inputs = (*inputs[:5], inputs[5].detach().double().requires_grad_())
    assert torch.autograd.gradcheck(lambda *a: IMPLEMENTATIONS[impl](*a, causal=True, integral=integral), inputs)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_a_softmax_scale_scales_the_scores(impl):
    """softmax_scale s on q is the default 1/sqrt(d) on q * s * sqrt(d), for both maps."""
    q1, k1, q2, k2, v, lam = make_inputs()
    scale = 0.3
    boost = scale * math.sqrt(q1.shape[-1])
    torch.testing.assert_close(IMPLEMENTATIONS[impl](q1, k1, q2, k2, v, lam, softmax_scale=scale),
                               IMPLEMENTATIONS[impl](q1 * boost, k1, q2 * boost, k2, v, lam), rtol=1e-9, atol=1e-9)


def test_sdpa_kernel_order_sets_torchs_priority_and_restores_it():
    before = torch._C._get_sdp_priority_order()
    with sdpa_kernel_order(["math", "flash"]):
        assert torch._C._get_sdp_priority_order()[:2] == [int(SDPBackend.MATH), int(SDPBackend.FLASH_ATTENTION)]
    assert torch._C._get_sdp_priority_order() == before


def test_a_kernel_recording_ends_with_its_block_even_when_it_raises():
    from megadiff.ops import sdpa

    q1, k1, q2, k2, v, lam = make_inputs()
    with recording_sdpa_kernels() as kernels:
        differential_attention_sdpa(q1, k1, q2, k2, v, lam)
    assert len(kernels) == 2  # one call a map
    with pytest.raises(RuntimeError, match="stop"), recording_sdpa_kernels():
        raise RuntimeError("stop")
    assert sdpa._kernel_records == []  # later calls ask torch's dispatcher nothing, and nothing is kept
    differential_attention_sdpa(q1, k1, q2, k2, v, lam)
    assert len(kernels) == 2


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("integral", [False, True])
def test_first_map_output_with_gradients(impl, integral):
    """return_first_map adds A1 V (the paper formula with lam = 0); gradients flow through both outputs."""
    inputs = make_inputs(per_head=True)
    out, first_map = IMPLEMENTATIONS[impl](*inputs, causal=True, integral=integral, return_first_map=True)
    leaves = [t.detach().to(torch.float64, copy=True).requires_grad_() for t in inputs]
    expected_out = paper_formula(*leaves, True, integral)
    expected_first = paper_formula(*leaves[:5], torch.zeros_like(leaves[5]), True, False)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(first_map.double(), expected_first, rtol=1e-9, atol=1e-9)
    grad_out, grad_first = torch.randn_like(expected_out), torch.randn_like(expected_first)
    got = torch.autograd.grad((out, first_map), inputs, (grad_out, grad_first))
    want = torch.autograd.grad((expected_out, expected_first), leaves, (grad_out, grad_first))
    for name, g, w in zip(("q1", "k1", "q2", "k2", "v", "lam"), got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-6, msg=f"grad of {name}")


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_fewer_queries_than_keys_is_bottom_right_causal(impl):
    inputs = make_inputs(n=3, n_k=7)
    expected = paper_formula(*inputs, causal=True, integral=False)
    torch.testing.assert_close(IMPLEMENTATIONS[impl](*inputs, causal=True).double(), expected.detach())


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split_v"])
@pytest.mark.parametrize("integral", [False, True])
def test_incremental_calls_continue_the_whole_sequence(backend, integral):
    """A prompt of 5 positions, then one position a call, then 3 (KV-cache decoding): each call's
    queries with every key so far, the DINT integral carried, give the whole sequence's rows."""
    inputs = [t.detach() for t in make_inputs(n=10, per_head=True)]
    expected = paper_formula(*inputs, causal=True, integral=integral)
    carry = IntegralCarry()
    rows = attended_in_calls(inputs, [5, 6, 7, 10], carry, integral=integral, backend=backend)
    torch.testing.assert_close(rows.double(), expected, rtol=1e-9, atol=1e-9)
    assert carry.count == (10 if integral else 0)


@pytest.mark.parametrize("op", ["softmax", "differential"])
def test_a_decoding_step_attends_every_cached_key_without_a_mask(op, monkeypatch):
    """One query after 8 cached keys (a decoding step), grouped queries: SDPA is given no mask, which on CUDA keeps
    a call off the flash kernel, the only fused one that runs grouped queries (torch's SDPA notes): the math kernel
    then repeats every cached key and value for each query head, at every step. The rows are the paper's."""
    masks, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: masks.append(kwargs["attn_mask"]) or real(*args, **kwargs))
    q1, k1, q2, k2, v, lam = (t.detach() for t in make_inputs(n=1, n_k=9, dv=8))
    if op == "softmax":
        got, expected = softmax_attention(q1, k1, v), softmax_attention_reference(q1, k1, v)
    else:
        got = differential_attention(q1, k1, q2, k2, v, lam, backend="sdpa")
        expected = paper_formula(q1, k1, q2, k2, v, lam, causal=True, integral=False)
    torch.testing.assert_close(got.double(), expected.double())
    assert masks and all(mask is None for mask in masks)


def attended_in_calls(inputs, stops: list[int], carry: IntegralCarry, **kwargs) -> torch.Tensor:
    """The rows of differential_attention called once per span of queries ending at each of `stops`, each with
    every key so far and the DINT integral carried (KV-cache decoding), concatenated."""
    q1, k1, q2, k2, v, lam = inputs
    rows = [differential_attention(q1[:, start:stop], k1[:, :stop], q2[:, start:stop], k2[:, :stop], v[:, :stop],
                                   lam, integral_carry=carry, **kwargs)
            for start, stop in zip([0] + stops[:-1], stops)]
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split_v"])
def test_bf16_decoding_of_dint_strays_from_fp32_no_more_than_diffs(backend):
    """In bf16 a prompt then one position a call gives rows as close to the fp32 result as the whole sequence's,
    for DINT as for DIFF: the carried mean joins O1 - lam O2 in fp32 and the sum is rounded once, as in the whole
    sequence's forward (rounding O1 - lam O2 first took DINT's decoded rows 13-28% further off)."""
    inputs = [t.detach() for t in make_inputs(batch=4, n=48, heads=8, kv_heads=4, d=32, dv=64, per_head=True)]
    low = [t.to(torch.bfloat16) if t.dim() == 4 else t for t in inputs]
    stray = {}
    for integral in (False, True):
        exact = differential_attention(*(t.float() for t in low), integral=integral, backend="reference")
        whole = differential_attention(*low, integral=integral, backend=backend)
        decoded = attended_in_calls(low, list(range(16, 49)), IntegralCarry(), integral=integral, backend=backend)
        stray[integral] = (decoded.float() - exact).abs().mean() / (whole.float() - exact).abs().mean()
    assert stray[True] <= stray[False] * 1.01, stray


def test_integral_carry_takes_no_documents():
    with pytest.raises(ValueError, match="no document boundaries"):
        differential_attention(*make_inputs(), integral=True, integral_carry=IntegralCarry(),
                               cu_seqlens=torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_low_precision_accumulates_in_fp32(impl, dtype):
    """bf16/fp16 inputs, fp32 maps, sums and running mean: over 256 keys the output is within twice the
    error of rounding the exact result once (accumulating in bf16/fp16 is 3-4 times it), the reference's
    within one unit of the last place of that rounding."""
    inputs = make_inputs(dtype=dtype, n=256, batch=1)
    out = IMPLEMENTATIONS[impl](*inputs, causal=True, integral=True)
    assert out.dtype == dtype
    expected = paper_formula(*inputs, causal=True, integral=True).detach()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        return
    rounding = (expected.to(dtype).double() - expected).abs().max().item()
    assert (out.double() - expected).abs().max().item() <= 2 * rounding
    if impl == "reference":
        torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("integral", [False, True])
def test_quantized_logits_match_paper_formula(bits, integral):
    """The DIFF paper's Figure 8: logits quantized before each softmax, whatever backend was asked
    for (only the materialised maps can be quantized); the softmax baseline's single map too."""
    inputs = make_inputs(per_head=True, n=12)
    expected = paper_formula(*inputs, causal=True, integral=integral, logit_bits=bits).detach()
    for backend in ("reference", "sdpa", "auto"):
        out = differential_attention(*inputs, causal=True, integral=integral, backend=backend, logit_bits=bits)
        torch.testing.assert_close(out.double(), expected, rtol=1e-9, atol=1e-9, msg=backend)
    assert not torch.allclose(expected, paper_formula(*inputs, causal=True, integral=integral), atol=1e-4)
    q, k, v = inputs[0], inputs[1], inputs[4]
    first_map = paper_formula(*inputs[:5], torch.zeros(()), True, False, logit_bits=bits).detach()
    torch.testing.assert_close(softmax_attention(q, k, v, causal=True, logit_bits=bits).double(), first_map,
                               rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="logit_bits"):
        differential_attention(*inputs, logit_bits=1)


@pytest.mark.parametrize("backend,runs", [("auto", ("sdpa", False)), ("sdpa", ("sdpa", False)),
                                          ("sdpa_split_v", ("sdpa", True)), ("reference", ("reference", False))])
def test_dispatcher_picks_sdpa_on_cpu_and_can_be_forced(backend, runs, monkeypatch):
    """What runs is what was asked for (`auto`: SDPA for CPU tensors), with the same results."""
    from megadiff.ops import dispatch

    calls = []
    for name, implementation in (("sdpa", dispatch.differential_attention_sdpa),
                                 ("reference", dispatch.differential_attention_reference)):
        monkeypatch.setattr(dispatch, f"differential_attention_{name}", lambda *args, _name=name, _impl=implementation,
                            **kwargs: calls.append((_name, kwargs.get("split_v", False))) or _impl(*args, **kwargs))
    inputs = make_inputs()
    out = differential_attention(*inputs, backend=backend)
    assert calls == [runs]
    torch.testing.assert_close(out, differential_attention_reference(*inputs))
    with pytest.raises(ValueError, match="unknown attention backend"):
        differential_attention(*inputs, backend="flash9")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the kernel needs triton")
def test_dispatcher_gives_cuda_tensors_the_kernel_only_where_it_runs():
    """On CUDA, `auto` is the fused kernel unless a head is wider than its tile or the dtype is one it
    lacks: then SDPA (a DIFF head of d = 160 has V 320 wide). The choice reads q's device, dtype and
    width only: stand-ins for CUDA tensors, no GPU needed."""
    def q(dtype, head_dim):
        return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 4, 2, head_dim))

    assert resolve_backend("auto", q(torch.bfloat16, 128), 256) == "triton"
    assert resolve_backend("auto", q(torch.float16, 64)) == "triton"
    assert resolve_backend("auto", q(torch.bfloat16, 160), 320) == "sdpa"
    assert resolve_backend("auto", q(torch.float64, 64), 128) == "sdpa"
    assert resolve_backend("triton", q(torch.bfloat16, 160), 320) == "triton"  # forced: the kernel says why not


@pytest.mark.parametrize("bad,match", [
    (dict(heads=3, kv_heads=2), "multiple of key/value heads"),
    (dict(n=4, n_k=3), "more queries"),  # one query more than the keys: the boundary
])
def test_shape_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        differential_attention_reference(*make_inputs(**bad))


@pytest.mark.parametrize("q_heads,k_heads", [(5, 4), (4, 3)])
def test_paired_maps_need_two_heads_each(q_heads, k_heads):
    """An odd head count in megatron's paired layout is named as such, not as two views' unequal shapes."""
    q, k, v = torch.zeros(1, 3, q_heads, 8), torch.zeros(1, 3, k_heads, 8), torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match=r"must be \[B, N, 2H, d\], two maps a differential head"):
        paired_differential_attention(q, k, v, torch.tensor(0.5))


def test_lambda_shape_error():
    q1, k1, q2, k2, v, _ = make_inputs()
    with pytest.raises(ValueError, match="one value per query head"):
        differential_attention_reference(q1, k1, q2, k2, v, torch.ones(3))


def test_integral_needs_square_attention():
    with pytest.raises(ValueError, match="as many queries as keys"):
        differential_attention_reference(*make_inputs(n=3, n_k=7), integral=True)


def test_the_compiled_lambda_is_the_eager_one_in_value_and_gradients():
    """CUDA runs lambda's compiled form (one kernel each way): the same graph, compiled here for the CPU,
    gives the eager values and gradients, in bf16 (training's weights) and fp32."""
    from megadiff.ops.lambdas import fused_lambda_difference, lambda_difference

    draw = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for _ in range(3):
            vecs = [(0.3 * torch.randn(16, generator=draw)).to(dtype).requires_grad_() for _ in range(4)]
            eager = lambda_difference(*vecs)
            compiled = fused_lambda_difference()(*vecs)
            assert compiled.dtype == eager.dtype == torch.float32
            torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
            for got, want in zip(torch.autograd.grad(compiled, vecs), torch.autograd.grad(eager, vecs)):
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_the_compiled_sdpa_combination_is_the_eager_one_in_value_and_gradients():
    """CUDA combines the SDPA backends' two maps through the compiled form: compiled here for the CPU, it gives
    the eager values and gradients over more variants than torch compiles (its limit is 8): bf16 and fp32,
    with and without grad, the maps as wide-V's SDPA returns them ([B, H, N, e] in memory) and as split-V
    concatenates them, and lengths and batches of 1 (a decoding step, a one-token document); then DINT's
    causal and non-causal running means, each compiled afresh."""
    from megadiff.ops.common import compiled
    from megadiff.ops.sdpa import differential_combination

    draw = torch.Generator().manual_seed(2)

    def compare(batch, n, dtype, transposed, grad_mode, *modes):
        shape = (batch, 3, n, 8) if transposed else (batch, n, 3, 8)
        maps = [torch.randn(*shape, generator=draw).to(dtype) for _ in range(2)]
        maps = [(m.transpose(1, 2) if transposed else m).requires_grad_(grad_mode) for m in maps]
        lam = (0.5 + 0.1 * torch.randn(3, generator=draw)).requires_grad_(grad_mode)
        with torch.set_grad_enabled(grad_mode):
            eager = differential_combination(*maps, lam, *modes)
            fused = compiled(differential_combination)(*maps, lam, *modes)
        assert fused.dtype == eager.dtype == dtype and fused.shape == (batch, n, 3, 8)
        # the running mean's sums may add in another order
        exact = dict(rtol=0, atol=0) if not modes else dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
        torch.testing.assert_close(fused, eager, **exact)
        if grad_mode:
            grad = torch.randn(batch, n, 3, 8, generator=draw).to(dtype)
            for got, want in zip(torch.autograd.grad(fused, [*maps, lam], grad),
                                 torch.autograd.grad(eager, [*maps, lam], grad)):
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    variants = 0
    for dtype in (torch.bfloat16, torch.float32):
        for batch, n in ((2, 5), (1, 9), (2, 1)):
            for transposed in (False, True):
                for grad_mode in (True, False):
                    compare(batch, n, dtype, transposed, grad_mode)
                    variants += 1
    assert variants > 8
    torch._dynamo.reset()  # DINT's variants get compiled rather than run eagerly past the limit
    for causal in (True, False):
        for dtype in (torch.bfloat16, torch.float32):
            compare(2, 7, dtype, False, True, True, causal)


def test_a_function_whose_compile_fails_warns_once_and_runs_eagerly(monkeypatch):
    """The compiled paths run on CUDA only, and a torch or Triton version whose compile fails must cost speed,
    not the run."""
    from megadiff.ops import common

    compiles = []

    def failing_compile(function):
        def run(*args):
            compiles.append(function)
            raise torch._dynamo.exc.BackendCompilerFailed(None, RuntimeError("no such instruction"), None)
        return run

    def double(x):
        return 2 * x

    monkeypatch.setattr(common, "compiled", failing_compile)
    monkeypatch.setattr(common, "_failed_to_compile", set())
    x = torch.arange(3.0)
    assert common.compiled_on(torch.device("cpu"), double) is double and not compiles
    with pytest.warns(UserWarning, match=r"torch.compile of .*double failed \(.*no such instruction.*\); it runs "
                                         "eagerly from now on"):
        assert torch.equal(common.compiled_on(torch.device("cuda"), double)(x), 2 * x)
    assert common.compiled_on(torch.device("cuda"), double) is double and compiles == [double]


def _document_bounds_of(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N] int64 starts and (exclusive) ends of each position's document, from each sample's lengths."""
    starts, ends = [], []
    for sample in lengths:
        bounds = torch.tensor([0, *sample]).cumsum(0)
        sizes = torch.tensor(sample)
        starts.append(bounds[:-1].repeat_interleave(sizes))
        ends.append(bounds[1:].repeat_interleave(sizes))
    return torch.stack(starts), torch.stack(ends)


def test_the_compiled_integral_around_the_kernel_is_the_eager_one(monkeypatch):
    """CUDA runs DINT's integral around the fused kernel (forward: out + lam R(O1); backward: dO1, dO2, delta1 and
    lam's gradient) as compiled functions: compiled here for the CPU, they give the eager results, for causal,
    non-causal and document-masked means, with and without O1's own gradient, in bf16 and fp32, and keep a
    sequence-major output sequence-major (megatron's layout, which its output projection reads as it is)."""
    from megadiff.ops.common import compiled
    from megadiff.ops.integral import first_map_gradients, integral_added

    draw = torch.Generator().manual_seed(3)
    batch, n, heads, width = 2, 9, 3, 8
    documents = _document_bounds_of([[3, 1, 5], [2, 7]])
    torch._dynamo.reset()
    # each variant compiled: past the limit torch would run it eagerly, and compare the eager form with itself
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 32)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    for dtype in (torch.bfloat16, torch.float32):
        close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
        for causal, (starts, ends) in ((True, (None, None)), (False, (None, None)), (True, documents)):
            # [N, B, H, e] in memory, as the kernel lays out megatron's outputs
            out, o1, g = (torch.randn(n, batch, heads, width, generator=draw).to(dtype).transpose(0, 1)
                          for _ in range(3))
            lam_h = 0.5 + 0.1 * torch.randn(heads, generator=draw)
            eager = integral_added(out, o1, lam_h, causal, starts)
            fused = compiled(integral_added)(out, o1, lam_h, causal, starts)
            assert fused.dtype == dtype and fused.stride() == out.stride()
            torch.testing.assert_close(fused, eager, **close)
            for integral, grad_first_map in ((True, None), (True, torch.randn_like(g)), (False, torch.randn_like(g))):
                args = (g, o1, lam_h, causal, integral, starts, ends, grad_first_map)
                eager, fused = first_map_gradients(*args), compiled(first_map_gradients)(*args)
                assert [t.dtype for t in fused] == [dtype, dtype, torch.float32, torch.float32]
                assert fused[2].shape == (batch, heads, n) and fused[2].is_contiguous()
                for got, want in zip(fused, eager):
                    torch.testing.assert_close(got, want, **close)
                assert fused[3].abs().sum() > 0 if integral else not fused[3].any()


def test_lambda_reparameterisation_and_depth_init():
    assert depth_lambda_init(0) == pytest.approx(0.2)
    assert depth_lambda_init(10) == pytest.approx(0.8 - 0.6 * math.exp(-3.0))
    with pytest.raises(ValueError):
        depth_lambda_init(-1)
    draw = torch.Generator().manual_seed(0)
    for _ in range(100):
        vecs = [torch.randn(8, generator=draw).to(torch.bfloat16) for _ in range(4)]
        lam = reparameterized_lambda(*vecs, 0.3)
        first, second = (math.exp(float((q.double() * k.double()).sum())) for q, k in (vecs[:2], vecs[2:]))
        # fp32 rounds each exponential: their difference may cancel to a far smaller lambda
        assert lam.dtype == torch.float32 and float(lam) == pytest.approx(first - second + 0.3,
                                                                          abs=1e-6 * (first + second + 0.3))


def random_case(seed: int) -> tuple[list[torch.Tensor], bool, bool]:
    """Inputs of a random small shape (GQA groups, dv = d or 2d, fewer queries than keys, per-head or one lambda),
    every tensor a non-contiguous view half the time, and whether the attention is causal and has the integral."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    heads, d, n_k = kv_heads * rng.choice([1, 2, 3]), rng.choice([8, 16, 24]), rng.choice([1, 2, 5, 7, 13])
    causal = rng.random() < 0.75
    n = rng.randint(1, n_k) if causal and rng.random() < 0.3 else n_k
    integral = n == n_k and rng.random() < 0.5  # a query block alone has its integral from a carry
    inputs = make_inputs(batch=rng.choice([1, 2]), n=n, heads=heads, kv_heads=kv_heads, d=d, dv=rng.choice([d, 2 * d]),
                         n_k=n_k, per_head=rng.random() < 0.5, seed=seed)
    if rng.random() < 0.5:  # [B, H, N, d] storage seen as [B, N, H, d], as megatron's layouts hand them over
        inputs = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() if t.dim() == 4 else t
                  for t in inputs]
    return inputs, causal, integral


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("seed", range(12))
def test_random_shapes_match_the_paper_formula_with_gradients(impl, seed):
    inputs, causal, integral = random_case(seed)
    out = IMPLEMENTATIONS[impl](*inputs, causal=causal, integral=integral)
    assert_matches_paper_formula(out, inputs, causal, integral)
