"""The fused Triton kernel against the naive reference: outputs and every gradient.

On CPU the kernel runs under the Triton interpreter. TRITON_INTERPRET must be
set before triton is imported and must not leak into this process (the GPU
tests below run compiled kernels), so one subprocess -- this file run as a
script -- computes every case's kernel results; the tests compare them with
the fp64 reference computed here.
"""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch

from megadiff.ops import differential_attention
from megadiff.ops.common import TRITON_CANDIDATES_ENV

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    causal: bool = True
    integral: bool = False
    gqa: bool = True  # Hq=4 over Hkv=2, else 2 heads of each
    per_head_lam: bool = False
    d: int = 16
    dv: int = 32
    n_q: int = 37
    n_k: int = 37
    batch: int = 2
    dtype: torch.dtype = torch.float32
    blocks: tuple | None = (16, 32)  # KernelConfig's arguments (block_m, block_n, ...); None: the default config
    autotuned: bool = False  # the CUDA path: the autotuner measures every candidate (timed on CPU here)
    first_map: bool = False  # also return A1 V, with an upstream gradient of its own
    strided: bool = False  # q1/q2, k1/k2 as views of fused projections, v a slice of a wider tensor
    sequence_major: bool = False  # megatron's [s, b, ...] layout: q, k, v and the upstream gradient transposed views
    paired: bool = False  # megatron's heads: q [B, N, 2Hq, d], k alike, each head's maps adjacent (sequence-major)
    pairs_past_int32: bool = False  # paired, as if the pairs' gradients were too long for int32 offsets
    documents: tuple[int, ...] | None = None  # cu_seqlens: document masking, through the dispatcher

    @property
    def heads(self) -> tuple[int, int]:
        return (4, 2) if self.gqa else (2, 2)


def _grid() -> dict[str, Case]:
    cases = {}
    for causal in (True, False):
        for integral in (False, True):
            for gqa in (True, False):
                for per_head in (False, True):
                    dv = 16 if gqa != per_head else 32  # dv = d for half the grid, 2d for the other half
                    name = (f"{'causal' if causal else 'full'}-{'dint' if integral else 'diff'}-"
                            f"{'gqa' if gqa else 'mha'}-{'lamh' if per_head else 'lam'}-dv{dv}")
                    cases[name] = Case(causal=causal, integral=integral, gqa=gqa, per_head_lam=per_head, dv=dv)
    cases.update({
        "blocks32x16": Case(blocks=(32, 16), integral=True, per_head_lam=True),
        "fewer-queries-causal": Case(n_q=20, n_k=45, per_head_lam=True),
        "fewer-queries-full": Case(causal=False, n_q=20, n_k=45),
        # a KV-cached decoding step: one query after 44 cached keys (the DINT carry needs A1 V too)
        "decode-one-query-first-map": Case(n_q=1, n_k=45, first_map=True, per_head_lam=True),
        "odd-head-dims": Case(d=24, dv=40, n_q=29, n_k=29, integral=True),
        "strided-inputs": Case(strided=True, per_head_lam=True),
        "sequence-major": Case(sequence_major=True, per_head_lam=True),
        "sequence-major-dint-first-map": Case(sequence_major=True, integral=True, first_map=True),
        "paired": Case(paired=True, sequence_major=True, per_head_lam=True),
        "paired-dint-first-map-dispatcher": Case(paired=True, sequence_major=True, integral=True, first_map=True,
                                                 blocks=None),
        "paired-decode-one-query-first-map": Case(paired=True, sequence_major=True, n_q=1, n_k=45, first_map=True),
        "paired-past-int32-offsets": Case(paired=True, sequence_major=True, pairs_past_int32=True, per_head_lam=True),
        "paired-documents-fewer-queries": Case(paired=True, sequence_major=True, n_q=20, n_k=45, per_head_lam=True,
                                               documents=(0, 12, 30, 33, 45, 50, 90)),
        # dK/dV in two programs per key tile (KernelConfig.split), tied and not, with documents, over pairs
        "split-dkdv-gqa": Case(blocks=(16, 32, 4, 1, True), per_head_lam=True),
        "split-dkdv-dint-mha": Case(blocks=(16, 16, 4, 1, True), integral=True, gqa=False),
        "split-dkdv-documents-fewer-queries": Case(blocks=(16, 32, 4, 1, True), n_q=20, n_k=45, per_head_lam=True,
                                                   documents=(0, 12, 30, 33, 45, 50, 90)),
        "split-dkdv-paired-first-map": Case(paired=True, sequence_major=True, first_map=True,
                                            blocks=(32, 16, 4, 1, True)),
        "first-map-diff": Case(first_map=True, per_head_lam=True),
        "first-map-dint": Case(first_map=True, integral=True, causal=False),
        "dispatcher-default-config": Case(blocks=None, n_q=50, n_k=50, batch=1),
        "autotuned-dint": Case(blocks=None, autotuned=True, integral=True, per_head_lam=True, batch=1),
        "autotuned-full-diff": Case(blocks=None, autotuned=True, causal=False, n_q=20, n_k=45, batch=1),
        "autotuned-full-diff-shorter-keys": Case(blocks=None, autotuned=True, causal=False, n_q=20, n_k=20, batch=1),
        "bf16": Case(dtype=torch.bfloat16, per_head_lam=True, n_q=64, n_k=64, d=32, dv=64, batch=1),
        "fp16-dint": Case(dtype=torch.float16, integral=True, n_q=40, n_k=40, d=32, dv=64, batch=1),
        # documents (masked in the kernels' tiles) shorter and longer than a tile, starting inside tiles
        "documents-dint": Case(blocks=None, integral=True, per_head_lam=True, documents=(0, 5, 20, 37, 40, 74)),
        "documents-diff-tiles16x32": Case(blocks=(16, 32), per_head_lam=True, documents=(0, 5, 20, 37, 40, 74)),
        "documents-dint-first-map-tiles32x16": Case(blocks=(32, 16), integral=True, first_map=True,
                                                    documents=(0, 17, 18, 37, 70, 74)),
        "documents-bf16-one-token": Case(dtype=torch.bfloat16, n_q=64, n_k=64, d=32, dv=64, batch=1,
                                         blocks=(16, 16), documents=(0, 10, 11, 40, 64)),
        # documents over several tiles: whole tiles inside them run unmasked (forward, dq and dk/dv)
        "documents-long-dint-tiles16x16": Case(n_q=96, n_k=96, blocks=(16, 16), integral=True, per_head_lam=True,
                                               documents=(0, 7, 70, 96, 101, 192)),
        "documents-long-fewer-queries-tiles16x16": Case(n_q=40, n_k=96, blocks=(16, 16), per_head_lam=True,
                                                        documents=(0, 7, 70, 96, 101, 192)),
        # a context-parallel chunk: queries the last 20 of 45 keys, documents over the keys
        "documents-fewer-queries-tiles16x32": Case(n_q=20, n_k=45, blocks=(16, 32), per_head_lam=True,
                                                   documents=(0, 12, 30, 33, 45, 50, 90)),
        # its first key tile lies in a document that ends before the first query: no query sees those keys
        "documents-ending-before-the-queries-tiles32x32": Case(n_q=20, n_k=64, blocks=(32, 32), per_head_lam=True,
                                                               documents=(0, 33, 64, 97, 128)),
        "documents-fewer-queries-first-map-tiles32x16": Case(n_q=20, n_k=45, blocks=(32, 16), first_map=True,
                                                             documents=(0, 27, 45, 70, 90)),
    })
    return cases


CASES = _grid()
NAMES = ("out", "q1", "k1", "q2", "k2", "v", "lam")


def make_inputs(name: str, case: Case, device="cpu"):
    """(q1, k1, q2, k2, v, lam) needing grad, in case.dtype (lam fp32), and the upstream gradient."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    h_q, h_kv = case.heads
    b, d, dv = case.batch, case.d, case.dv

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=case.dtype)

    if case.strided:
        q = rand(b, case.n_q, h_q, 2, d).requires_grad_()
        k = rand(b, case.n_k, h_kv, 2, d).requires_grad_()
        v_wide = rand(b, case.n_k, h_kv, dv + 8).requires_grad_()
        q1, q2, k1, k2, v = q[..., 0, :], q[..., 1, :], k[..., 0, :], k[..., 1, :], v_wide[..., :dv]
    elif case.paired:  # as DifferentialCoreAttention passes megatron's tensors
        q = rand(case.n_q, b, 2 * h_q, d).requires_grad_()
        k = rand(case.n_k, b, 2 * h_kv, d).requires_grad_()
        v = rand(case.n_k, b, h_kv, dv).requires_grad_()
        q1, k1, v = (t.transpose(0, 1) for t in (q, k, v))  # here q1, k1 stand for the pairs
        q2 = k2 = None
    elif case.sequence_major:  # as the per-map entry point gets megatron's tensors
        q = rand(case.n_q, b, h_q, 2, d).requires_grad_()
        k = rand(case.n_k, b, h_kv, 2, d).requires_grad_()
        v = rand(case.n_k, b, h_kv, dv).requires_grad_()
        q1, q2, k1, k2 = (t.transpose(0, 1) for t in (q[..., 0, :], q[..., 1, :], k[..., 0, :], k[..., 1, :]))
        v = v.transpose(0, 1)
    else:
        q1, q2 = (rand(b, case.n_q, h_q, d).requires_grad_() for _ in range(2))
        k1, k2 = (rand(b, case.n_k, h_kv, d).requires_grad_() for _ in range(2))
        v = rand(b, case.n_k, h_kv, dv).requires_grad_()
    lam_shape = (h_q,) if case.per_head_lam else ()
    lam = (0.2 + 0.6 * torch.rand(lam_shape, generator=gen)).to(device).requires_grad_()
    grad_out = rand(case.n_q, b, h_q, dv).transpose(0, 1) if case.sequence_major else rand(b, case.n_q, h_q, dv)
    return ((q1, k1, v, lam) if case.paired else (q1, k1, q2, k2, v, lam)), grad_out


def _unpaired(attention):
    """`attention` over per-map views of q [B, N, 2Hq, d] and k, as paired_differential_attention takes them."""
    def paired(q, k, v, lam, **kwargs):
        (q1, q2), (k1, k2) = (t.unflatten(2, (-1, 2)).unbind(3) for t in (q, k))
        return attention(q1, k1, q2, k2, v, lam, **kwargs)
    return paired


def outputs_and_grads(fn, inputs, grad_out, case: Case) -> dict[str, torch.Tensor]:
    documents = {"cu_seqlens": case.documents} if case.documents else {}
    result = fn(*inputs, causal=case.causal, integral=case.integral, return_first_map=case.first_map, **documents)
    outputs = result if case.first_map else (result,)
    grads = torch.autograd.grad(outputs, inputs, (grad_out, grad_out.flip(1))[:len(outputs)])
    names = ("out", "q", "k", "v", "lam") if case.paired else NAMES
    names = names + ("first_map",) if case.first_map else names
    return {name: t.detach() for name, t in zip(names, (outputs[0], *grads, *outputs[1:]))}


def reference_results(name: str, case: Case) -> dict[str, torch.Tensor]:
    inputs, grad_out = make_inputs(name, case)
    inputs = tuple(t.detach().double().requires_grad_() for t in inputs)
    reference = partial(differential_attention, backend="reference")
    return outputs_and_grads(_unpaired(reference) if case.paired else reference, inputs, grad_out.double(), case)


def kernel_attention(case: Case):
    """The case's kernel: explicit tiles through the kernel's API; blocks=None goes through the dispatcher instead."""
    from megadiff.ops import paired_differential_attention
    from megadiff.ops.triton_kernel import (
        KernelConfig, differential_attention_triton, paired_differential_attention_triton,
    )

    def fn(*args, **kwargs):
        if case.blocks is None:
            dispatcher = paired_differential_attention if case.paired else differential_attention
            return dispatcher(*args, **kwargs, backend="triton")
        kernel = paired_differential_attention_triton if case.paired else differential_attention_triton
        return kernel(*args, **kwargs, config=KernelConfig(*case.blocks))
    return fn


def kernel_results(name: str, case: Case) -> dict[str, torch.Tensor]:
    fn = kernel_attention(case)
    inputs, grad_out = make_inputs(name, case)
    with contextlib.ExitStack() as stack:
        if case.pairs_past_int32:
            import megadiff.ops.triton_kernel as kernel
            stack.enter_context(mock.patch.object(kernel, "row_offsets_fit_int32", lambda t: False))
        return outputs_and_grads(fn, inputs, grad_out, case)


def assert_matches(got: dict, want: dict, dtype: torch.dtype, label: str) -> None:
    assert want.keys() <= got.keys(), f"{label}: the kernel returned no {sorted(want.keys() - got.keys())}"
    for key in want:
        a, b = got[key].double().cpu(), want[key].double().cpu()
        assert a.shape == b.shape, f"{label}: {key} shape {tuple(a.shape)} != {tuple(b.shape)}"
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"{label}: {key}: {m}")
        else:  # bf16 rounding of inputs to the matmuls: compare relative to the tensor's size
            rel = float((a - b).norm() / b.norm().clamp(min=1e-12))
            assert rel < 2e-2, f"{label}: {key} relative error {rel:.2e}"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    results = tmp_path_factory.mktemp("triton-interpreter") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, str(results)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return torch.load(results)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(interpreted, name):
    got = interpreted[name]
    if isinstance(got, str):
        pytest.fail(f"kernel raised:\n{got}")
    assert_matches(got, reference_results(name, CASES[name]), CASES[name].dtype, name)
    if CASES[name].autotuned:
        assert all(choice != "None" for choice in got["tuned"].values()), f"not every kernel was tuned: {got['tuned']}"


def test_the_output_follows_the_queries_layout(interpreted):
    """megatron's [s, b, ...] queries get an output laid out [s, b, ...] in memory, which the layer's
    output projection reads without a copy; [b, s, ...] queries a [b, s, ...] one."""
    for name in ("sequence-major", "sequence-major-dint-first-map", "causal-diff-gqa-lam-dv16"):
        got = interpreted[name]
        assert not isinstance(got, str), f"{name} raised:\n{got}"
        out = got["out"] if name != "sequence-major-dint-first-map" else got["first_map"]
        assert out.transpose(0, 1).is_contiguous() is CASES[name].sequence_major, (name, out.stride())


def test_paired_maps_gradients_come_back_in_megatron_s_layout(interpreted):
    """megatron's q and k (each head's maps adjacent, [s, b, ...] in memory) get their gradients as one
    tensor each in that layout: what autograd hands megatron's QKV split without a stack."""
    for name in ("paired", "paired-dint-first-map-dispatcher"):
        got = interpreted[name]
        assert not isinstance(got, str), f"{name} raised:\n{got}"
        for key in ("q", "k"):
            assert got[key].transpose(0, 1).is_contiguous(), (name, key, got[key].stride())


def test_autotuning_per_length_class(interpreted):
    """Shapes alike but for their keys' length class (64 against 32) get tiles tuned for each: every
    kernel's autotuner holds one choice more after the second."""
    first, second = (interpreted[name] for name in ("autotuned-full-diff", "autotuned-full-diff-shorter-keys"))
    assert not isinstance(first, str) and not isinstance(second, str), "an autotuned case raised"
    assert {kind: n + 1 for kind, n in first["tunings"].items()} == second["tunings"]
    assert {kind: len(tiles) for kind, tiles in second["tiles"].items()} == second["tunings"]
    assert all("BLOCK_M" in tile for tiles in second["tiles"].values() for tile in tiles.values())


MAPS_CASE = Case(n_q=21, n_k=40)


def test_maps_and_log_sum_exps(interpreted):
    """The partial-result API: each map's output A_j V and log-sum-exp, from first principles."""
    got = interpreted["maps"]
    if isinstance(got, str):
        pytest.fail(f"kernel raised:\n{got}")
    (q1, k1, q2, k2, v, _), _ = make_inputs("maps", MAPS_CASE)
    group = q1.shape[2] // k1.shape[2]
    for j, (q, k) in enumerate(((q1, k1), (q2, k2)), start=1):
        q, k, vv = q.detach().double(), k.detach().double().repeat_interleave(group, 2), v.detach().double()
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = scores.logsumexp(-1)
        o = torch.einsum("bhqk,bkhe->bqhe", (scores - lse[..., None]).exp(), vv.repeat_interleave(group, 2))
        torch.testing.assert_close(got[f"lse{j}"].double(), lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[f"o{j}"].double(), o, atol=1e-5, rtol=1e-5)


# DINT's KV-cache decoding through megatron's paired layout: a prompt of 5 positions, then one, one and 3
CARRY_CASE = Case(paired=True, sequence_major=True, integral=True, per_head_lam=True, n_q=10, n_k=10, blocks=None)
CARRY_STEPS = ((0, 5), (5, 6), (6, 7), (7, 10))


def carried_paired_rows(name: str, case: Case) -> dict:
    """Each step's queries with every key so far through `paired_differential_attention(backend='triton')`,
    the DINT integral carried by one IntegralCarry: the rows concatenated, and the carry's count."""
    from megadiff.ops import IntegralCarry, paired_differential_attention

    (q, k, v, lam), _ = make_inputs(name, case)
    q, k, v, lam = (t.detach() for t in (q, k, v, lam))
    carry, rows = IntegralCarry(), []
    for start, stop in CARRY_STEPS:
        rows.append(paired_differential_attention(q[:, start:stop], k[:, :stop], v[:, :stop], lam, causal=True,
                                                  integral=True, backend="triton", integral_carry=carry))
    return {"out": torch.cat(rows, dim=1), "count": carry.count}


def test_paired_dint_decoding_carries_the_integral(interpreted):
    """With an integral_carry the paired Triton path must hand over to the per-map path, which adds the
    carried running mean: the paired kernel knows no carry (it would average within each call, and refuses
    a decode step's fewer queries than keys), and no whole-sequence case notices if the dispatcher takes it
    anyway. The steps' rows must be the whole sequence's (reference.py's formula, fp64), the count 10."""
    from megadiff.ops import differential_attention_reference

    got = interpreted["paired-dint-kv-cache-carry"]
    if isinstance(got, str):
        pytest.fail(f"kernel raised:\n{got}")
    (q, k, v, lam), _ = make_inputs("paired-dint-kv-cache-carry", CARRY_CASE)
    q, k, v, lam = (t.detach().double() for t in (q, k, v, lam))
    want = _unpaired(differential_attention_reference)(q, k, v, lam, causal=True, integral=True)
    assert_matches({"out": got["out"]}, {"out": want}, CARRY_CASE.dtype, "paired-dint-kv-cache-carry")
    assert got["count"] == CARRY_STEPS[-1][1], f"the carry counted {got['count']} positions, not 10"


def test_double_backward_is_refused(interpreted):
    """The kernels' gradients carry no graph: a gradient penalty through them must raise, not run with its own
    gradient silently left out (as autograd does, even with once_differentiable, when the upstream gradient
    needs none)."""
    for name, error in interpreted["double-backward"].items():
        assert "cannot differentiate twice" in error, f"{name}: a double backward gave {error or 'no error'!r}"


def test_refusals():
    triton_kernel = pytest.importorskip("megadiff.ops.triton_kernel")
    (q1, k1, q2, k2, v, lam), _ = make_inputs("refusals", Case())
    with pytest.raises(TypeError, match="dtype"):
        triton_kernel.differential_attention_triton(q1.double(), k1, q2, k2, v, lam)
    wide_v = v.new_zeros(*v.shape[:3], 512)
    with pytest.raises(ValueError, match="head dims up to"):
        triton_kernel.differential_attention_triton(q1, k1, q2, k2, wide_v, lam)
    # 1M positions of 12 heads of 256: past the kernels' int32 offsets within one sequence
    huge = [torch.empty(1, 2 ** 20, heads, width, dtype=torch.bfloat16, device="meta") for heads, width in
            ((12, 128), (12, 128), (12, 128), (12, 128), (12, 256))]
    with pytest.raises(ValueError, match="int32"):
        triton_kernel.differential_attention_triton(*huge, lam)
    if not triton_kernel.INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            triton_kernel.differential_attention_triton(q1, k1, q2, k2, v, lam)


def test_document_bounds_read_once_per_tensor(monkeypatch):
    """Every layer of a micro-batch masks the same documents: their bounds are read (a host sync on
    CUDA) once per cu_seqlens tensor and shape, and read anew for another or a modified tensor."""
    triton_kernel = pytest.importorskip("megadiff.ops.triton_kernel")
    reads, read_spans = [], triton_kernel.document_spans
    monkeypatch.setattr(triton_kernel, "document_spans", lambda *args: reads.append(args) or read_spans(*args))
    q, k = torch.zeros(2, 37, 4, 16), torch.zeros(2, 37, 2, 16)
    cu_seqlens = torch.tensor([0, 5, 20, 37, 40, 74])
    first = triton_kernel._documents(cu_seqlens, True, q, k)
    assert triton_kernel._documents(cu_seqlens, True, q, k) is first and len(reads) == 1
    last_queries = triton_kernel._documents(cu_seqlens, True, q[:, 17:], k)  # another shape: read for it
    assert torch.equal(last_queries.starts, first.starts[:, 17:]) and len(reads) == 2
    assert triton_kernel._documents(cu_seqlens, True, q, k) is first and len(reads) == 2
    cu_seqlens[1] = 6
    modified = triton_kernel._documents(cu_seqlens, True, q, k)
    assert len(reads) == 3 and modified.starts[0, 5].item() == 0
    assert triton_kernel._documents(cu_seqlens.clone(), True, q, k) is not modified and len(reads) == 4
    with torch.inference_mode():  # inference tensors keep no version: read each time
        inference = torch.tensor([0, 5, 20, 37, 40, 74])
        assert torch.equal(triton_kernel._documents(inference, True, q, k).starts, first.starts)
        triton_kernel._documents(inference, True, q, k)
    assert len(reads) == 6


def test_candidates_limit_bounds_what_the_autotuner_compiles(monkeypatch):
    """$MEGADIFF_TRITON_CANDIDATES keeps the first N of the candidates that fit, in CANDIDATES' order."""
    triton_fwd = pytest.importorskip("megadiff.ops.triton_fwd")

    configs = [triton_fwd.tile_config(tile) for tile in triton_fwd.CANDIDATES["dkdv"]]
    prune = triton_fwd._prune("dkdv")

    def kept(**meta):  # on CPU: no shared-memory limit
        return [triton_fwd.config_tile(c) for c in prune(configs, {"Q1": torch.empty(0)}, **meta)]
    fitting = triton_fwd.fitting_candidates("dkdv", 128, 256)
    monkeypatch.delenv(TRITON_CANDIDATES_ENV, raising=False)
    assert kept(BLOCK_D=128, BLOCK_DV=256) == fitting and len(fitting) > 2
    monkeypatch.setenv(TRITON_CANDIDATES_ENV, "2")
    assert kept(BLOCK_D=128, BLOCK_DV=256) == fitting[:2]
    monkeypatch.setenv(TRITON_CANDIDATES_ENV, "0")
    with pytest.raises(ValueError, match="MEGADIFF_TRITON_CANDIDATES must be a positive integer"):
        kept(BLOCK_D=128, BLOCK_DV=256)


def test_long_sequence_views_get_int32_safe_layouts():
    """Row offsets are int32 in the kernels: a view whose sequence stride would overflow them
    (N = 64K rows of a [N, B, 3 x hidden] projection, B = 4) is made dense; a small one is kept."""
    triton_fwd = pytest.importorskip("megadiff.ops.triton_fwd")
    n, batch, width = 65536, 4, 3 * 3072
    fused = torch.empty(n, batch, width, device="meta")
    q = fused[..., :1536].view(n, batch, 12, 128).transpose(0, 1)  # [B, N, H, d], sequence stride B x width
    (dense,) = triton_fwd.shared_layout(q)
    assert q.stride(1) * (n - 1) >= 2 ** 31 and dense.is_contiguous()
    small = fused[:1024, ..., :1536].view(1024, batch, 12, 128).transpose(0, 1)
    assert triton_fwd.shared_layout(small)[0] is small


def _needs_the_cuda_compiler() -> None:
    """Compiling for sm_90 needs no GPU, but Triton's CUDA backend, and TRITON_INTERPRET unset."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 replaces the compiler")
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend")


@pytest.mark.parametrize("kind,causal,flags", [("fwd", True, {}), ("dkdv", True, {"TIED": False}),
                                               ("dq", False, {}), ("fwd", True, {"DOCUMENTS": True}),
                                               ("dkdv", True, {"DOCUMENTS": True}),
                                               ("dq", True, {"DOCUMENTS": True, "TIED": False})])
def test_compiles_for_hopper(kind, causal, flags):
    """The interpreter forgives what the compiler refuses (types, tile shapes): compile for sm_90 (no GPU
    needed) at a small head shape, in modes the interpreter cases above exercise."""
    _needs_the_cuda_compiler()
    from bench.kernel_resources import compile_candidate

    compiled = compile_candidate(kind, 32, 32, 4, 2, d=32, dv=64, arch=90, causal=causal, **flags)
    assert compiled.asm["cubin"] and compiled.metadata.shared > 0


def test_row_dots_compile_for_hopper_without_spilling(tmp_path):
    """The backward's preprocessing kernel at the 3B head shape (rows of 2d = 256), for sm_90."""
    _needs_the_cuda_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.kernel_resources import resource_usage, signature
    from megadiff.ops.triton_bwd import ROW_DOTS_ROWS, _row_dots_kernel

    constexprs = dict(BLOCK_ROWS=ROW_DOTS_ROWS, BLOCK_E=256)
    source = ASTSource(_row_dots_kernel, {**signature(_row_dots_kernel, constexprs, "bf16"), "OUT": "*fp32"},
                       constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert resource_usage(compiled, tmp_path)["stack_bytes"] == 0


H100_SHARED_MEMORY = 232_448  # 227 KiB: the most a program may opt in to on sm_90


def _tiles_kept_on_hopper(monkeypatch, kind: str, dtype: str, d: int, dv: int, limit: int = H100_SHARED_MEMORY
                          ) -> list[tuple]:
    """The candidates the autotuner's pruning keeps, in their order, on a GPU with `limit` bytes of shared memory
    (an H100's)."""
    from bench.kernel_resources import DTYPES
    from megadiff.ops import triton_fwd

    monkeypatch.setattr(triton_fwd, "shared_memory_budget", lambda device: (limit, 90))
    configs = [triton_fwd.tile_config(tile) for tile in triton_fwd.CANDIDATES[kind]]
    kept = triton_fwd._prune(kind)(configs, {"Q1": torch.empty(0, dtype=DTYPES[dtype])},
                                   BLOCK_D=triton_fwd.padded_dim(d), BLOCK_DV=triton_fwd.padded_dim(dv))
    return [triton_fwd.config_tile(c) for c in kept]


@pytest.mark.parametrize("kind,tied", [("fwd", True), ("dkdv", True), ("dkdv", False), ("dq", True), ("dq", False)])
@pytest.mark.parametrize("dtype,block_m,block_n,arch", [
    ("bf16", 32, 32, 90), ("bf16", 64, 32, 90), ("bf16", 32, 64, 90), ("bf16", 64, 32, 80), ("fp32", 64, 32, 90),
    ("bf16", 64, 64, 100)])
def test_the_shared_memory_estimate_bounds_the_compiled_kernel(kind, tied, dtype, block_m, block_n, arch):
    """What the pruning goes by, against what Triton allocates for sm_90, sm_80 and sm_100 at an aligned launch
    (small tiles: seconds to compile), with the loop's three buffers: 64 rows in 16 bits are Hopper's warp-group
    MMA, which buffers each stage (the estimate was a buffer short, and the H200 refused a dQ tile it kept);
    an estimate is no bound if it is far above."""
    _needs_the_cuda_compiler()
    from bench.kernel_resources import DTYPES, compile_candidate
    from megadiff.ops.triton_fwd import shared_memory_estimate

    flags = {} if kind == "fwd" else {"TIED": tied}  # the forward reads no dO
    compiled = compile_candidate(kind, block_m, block_n, 4, 3, d=32, dv=64, arch=arch, dtype=dtype,
                                 **flags).metadata.shared
    estimate = shared_memory_estimate(kind, block_m, block_n, 3, 32, 64, DTYPES[dtype].itemsize, tied, arch)
    assert compiled <= estimate <= 2 * compiled


def test_the_dk_dv_estimate_bounds_dint_s_64_key_tile_at_the_3b_shape():
    """DINT's dK/dV (dO1 and dO2 read) over 64 keys, a warp-group MMA on Hopper: Triton allocates 267264 bytes
    for sm_90, over an H100's 232448, where the estimate said 231424 and kept the tile."""
    _needs_the_cuda_compiler()
    from bench.kernel_resources import compile_candidate
    from megadiff.ops.triton_fwd import shared_memory_estimate

    compiled = compile_candidate("dkdv", 64, 64, 8, 2, d=128, dv=256, arch=90, TIED=False).metadata.shared
    assert compiled <= shared_memory_estimate("dkdv", 64, 64, 2, 128, 256, 2, False, 90)


def test_tiles_over_the_gpus_shared_memory_are_pruned_before_the_candidates_limit(monkeypatch):
    """fp32 dQ at the 3B head shape on an H100: the first listed tile, (64, 64, 4, 2), needs 288 KiB and failed
    at launch when MEGADIFF_TRITON_CANDIDATES=1 left it the one candidate. The pruning keeps, in order, the
    tiles the estimate fits; none fitting, the least needing (its launch error says how much)."""
    from megadiff.ops import triton_fwd

    def estimate(tile, dtype):
        return triton_fwd.shared_memory_estimate("dq", tile[0], tile[1], tile[3], 128, 256, DTYPE_SIZES[dtype])

    monkeypatch.delenv(TRITON_CANDIDATES_ENV, raising=False)
    fp32 = _tiles_kept_on_hopper(monkeypatch, "dq", "fp32", 128, 256)
    fitting = [tile for tile in triton_fwd.fitting_candidates("dq", 128, 256)
               if estimate(tile, "fp32") <= H100_SHARED_MEMORY]
    assert triton_fwd.CANDIDATES["dq"][0] not in fp32 and fp32 == fitting[:len(fp32)] and fp32
    assert _tiles_kept_on_hopper(monkeypatch, "dq", "bf16", 128, 256)[0] == triton_fwd.CANDIDATES["dq"][0]
    monkeypatch.setenv(TRITON_CANDIDATES_ENV, "1")
    assert _tiles_kept_on_hopper(monkeypatch, "dq", "fp32", 128, 256, limit=1) == \
        [min(triton_fwd.CANDIDATES["dq"], key=lambda tile: estimate(tile, "fp32"))]


DTYPE_SIZES = {"bf16": 2, "fp32": 4}


@pytest.mark.skipif(os.environ.get("MEGADIFF_COMPILE_3B_TILES") != "1",
                    reason="compiling fp32 tiles at the 3B head shape takes minutes on a CPU: set "
                           "MEGADIFF_COMPILE_3B_TILES=1 after changing a kernel or its candidates")
@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_the_first_kept_3b_tile_fits_hopper_shared_memory(monkeypatch, kind):
    """With MEGADIFF_TRITON_CANDIDATES=1 the autotuner launches its first candidate untried: compiled for sm_90
    in fp32 (the most shared memory), it fits an H100's and needs no more than the estimate."""
    _needs_the_cuda_compiler()
    from bench.kernel_resources import compile_candidate
    from megadiff.ops.triton_fwd import shared_memory_estimate

    block_m, block_n, num_warps, num_stages = _tiles_kept_on_hopper(monkeypatch, kind, "fp32", 128, 256)[0]
    compiled = compile_candidate(kind, block_m, block_n, num_warps, num_stages, d=128, dv=256, arch=90,
                                 dtype="fp32").metadata.shared
    assert compiled <= min(shared_memory_estimate(kind, block_m, block_n, num_stages, 128, 256, 4),
                           H100_SHARED_MEMORY)


def test_a_decoding_step_runs_the_prefills_compiled_forward(monkeypatch):
    """A decoding step (one query, a key more) is tuned apart, but must find the forward the prompt
    compiled for each tile: Triton's launch specializes an int equal to 1 or divisible by 16, so a
    single query compiled every candidate again at the first token. Compared here as Triton's
    launch computes it for an sm_90 target (no GPU needed)."""
    triton_fwd = pytest.importorskip("megadiff.ops.triton_fwd")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 replaces the compiler")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = triton_fwd._fwd_kernel
    bind = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    launched = []
    monkeypatch.setattr(triton_fwd, "launch", lambda kernel, kind, n, programs, args, meta, config:
                        launched.append(bind(*args, **meta, BLOCK_M=64, BLOCK_N=64)[1]))
    for n_q, n_k in ((64, 64), (1, 65), (1, 97)):
        q = torch.randn(1, n_q, 4, 32, dtype=torch.bfloat16)
        k = torch.randn(1, n_k, 2, 32, dtype=torch.bfloat16)
        v = torch.randn(1, n_k, 2, 64, dtype=torch.bfloat16)
        triton_fwd.attention_maps_forward(q, k, q, k, v, torch.ones(4), causal=True, scale=0.1,
                                          o_dtype=torch.bfloat16)
    assert launched[0] == launched[1] == launched[2]


def _upcast_bf16_dots_in_interpreter() -> None:
    """triton 3.9's interpreter feeds bf16 tl.dot operands to numpy as their raw uint16 bits.

    Multiply them in fp32 instead, which is what the GPU's bf16 MMA computes (exact products,
    fp32 sums), so the bf16 case tests the kernel rather than that bug.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def upcast(builder, x):
        return builder.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x

    def create_dot_in_fp32(self, a, b, *args, **kwargs):
        return create_dot(self, upcast(self, a), upcast(self, b), *args, **kwargs)

    InterpreterBuilder.create_dot = create_dot_in_fp32


def _scalar_loop_bounds_in_old_interpreters() -> None:
    """triton < 3.9's interpreter converts a scalar tensor used as a loop bound with int() on a
    1-element array, which NumPy 2 refuses: convert its single element instead (as 3.9 does)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_with_scalar_index


@contextlib.contextmanager
def _autotuning_on_cpu():
    """Take the CUDA launch path (triton.autotune over the pruned candidates) in the interpreter,
    timing each candidate with a wall clock where Triton's benchmarker needs a GPU driver."""
    from triton.runtime.autotuner import Autotuner

    from megadiff.ops import triton_bwd, triton_fwd

    def wall_clock(kernel_call, quantiles):
        start = time.perf_counter()
        kernel_call()
        return [time.perf_counter() - start] * len(quantiles)

    kernels = {"fwd": triton_fwd._fwd_kernel, "dkdv": triton_bwd._dkdv_kernel, "dq": triton_bwd._dq_kernel}

    def tuned() -> dict:
        """The tiles the autotuner last chose for each kernel (none if it never ran), how many
        choices (one per tuning key) each kernel's autotuner holds, and the benchmarks' record of them."""
        from megadiff.ops.triton_kernel import tuned_tiles

        tuners = {kind: triton_fwd._autotuned(kernel, kind) for kind, kernel in kernels.items()}
        return {"tuned": {kind: str(getattr(tuner, "best_config", None)) for kind, tuner in tuners.items()},
                "tunings": {kind: len(tuner.cache) for kind, tuner in tuners.items()}, "tiles": tuned_tiles()}

    saved = Autotuner.__dict__["do_bench"]
    Autotuner.do_bench = property(lambda self: wall_clock)
    triton_fwd.INTERPRETED = False
    try:
        yield tuned
    finally:
        triton_fwd.INTERPRETED = True
        Autotuner.do_bench = saved


DOUBLE_BACKWARD_CASES = ("causal-diff-gqa-lam-dv16", "paired")


def double_backward_refusal(name: str, case: Case) -> str:
    """A gradient penalty through the kernel (whose gradients have no graph of their own) beside a plain loss on
    the inputs, taken to the inputs: the error it raises, or '' where it ran (dropping the penalty's gradient)."""
    inputs, grad_out = make_inputs(name, case)
    out = kernel_attention(case)(*inputs, causal=case.causal)
    try:
        grads = torch.autograd.grad((out * grad_out).sum(), inputs, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        (penalty + sum(t.sum() for t in inputs)).backward()
    except RuntimeError as error:
        return str(error)
    return ""


def _interpreter_main(path: str) -> None:
    """Child process: every case through the interpreted kernel; errors are recorded per case."""
    from megadiff.ops.triton_kernel import KernelConfig, differential_attention_triton_maps

    assert os.environ.get("TRITON_INTERPRET") == "1"
    _upcast_bf16_dots_in_interpreter()
    _scalar_loop_bounds_in_old_interpreters()
    results = {}
    for name, case in CASES.items():
        try:
            if case.autotuned:
                with _autotuning_on_cpu() as tuned:
                    results[name] = {**kernel_results(name, case), **tuned()}
            else:
                results[name] = kernel_results(name, case)
        except Exception:  # noqa: BLE001 -- reported by the matching test
            results[name] = traceback.format_exc()
    try:
        (q1, k1, q2, k2, v, _), _ = make_inputs("maps", MAPS_CASE)
        maps = differential_attention_triton_maps(q1.detach(), k1.detach(), q2.detach(), k2.detach(), v.detach(),
                                                  config=KernelConfig(16, 16))
        results["maps"] = dict(zip(("o1", "o2", "lse1", "lse2"), maps))
    except Exception:  # noqa: BLE001
        results["maps"] = traceback.format_exc()
    results["double-backward"] = {name: double_backward_refusal(name, CASES[name]) for name in DOUBLE_BACKWARD_CASES}
    try:
        results["paired-dint-kv-cache-carry"] = carried_paired_rows("paired-dint-kv-cache-carry", CARRY_CASE)
    except Exception:  # noqa: BLE001
        results["paired-dint-kv-cache-carry"] = traceback.format_exc()
    torch.save(results, path)


GPU_CASES = {
    "causal-gqa-diff-n4096": Case(n_q=4096, n_k=4096, batch=1),
    "causal-gqa-dint-n1000": Case(n_q=1000, n_k=1000, integral=True, per_head_lam=True),
    "full-gqa-diff-n2048": Case(causal=False, n_q=2048, n_k=2048, batch=1),
    "causal-mha-diff-n3000": Case(gqa=False, n_q=3000, n_k=3000, batch=1, per_head_lam=True),
    "causal-gqa-first-map-n2000": Case(n_q=2000, n_k=2000, batch=1, first_map=True),
    "decode-one-query-of-4096-first-map": Case(n_q=1, n_k=4096, batch=2, first_map=True),
    "causal-gqa-dint-documents-n3000": Case(n_q=3000, n_k=3000, integral=True,
                                            documents=(0, 700, 3000, 3001, 4500, 6000)),
    # context parallelism's chunk: the last 1000 queries of 3000 keys, documents across them
    "causal-gqa-first-map-documents-n1000-of-3000": Case(n_q=1000, n_k=3000, first_map=True,
                                                         documents=(0, 700, 2100, 3000, 3001, 6000)),
    # megatron's layout, as the layers pass it: maps paired in q and k, [s, b, ...] in memory
    "paired-sequence-major-n2048": Case(paired=True, sequence_major=True, n_q=2048, n_k=2048, per_head_lam=True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestOnGPU:
    """Compiled kernels at the 3B head shape (d=128, dv=256, bf16), autotuned tiles.

    The bound: twice SDPA's error on the same inputs, plus a few bf16 ulps (1e-2) of the largest
    value. SDPA alone is no floor here: with GQA and dv = 2d it falls back to its math backend,
    which computes in fp32 and matches the oracle almost exactly, while a bf16 kernel that rounds
    dS before its matmuls (FlashAttention's scheme) is 4-8e-3 of the scale off in dq and dk
    (emulated on CPU). A wrong kernel is off by the scale itself.
    """

    @staticmethod
    def _results(name, case, backend):
        from megadiff.ops import paired_differential_attention

        inputs, grad_out = make_inputs(name, case, device="cuda")
        attention = paired_differential_attention if case.paired else differential_attention
        return outputs_and_grads(lambda *a, **kw: attention(*a, **kw, backend=backend), inputs, grad_out, case)

    def _assert_matches(self, name, case, got):
        want = self._results(name, case, "reference")
        sdpa = self._results(name, case, "sdpa")
        for key in want:
            err = (got[key].float() - want[key].float()).abs().max().item()
            sdpa_err = (sdpa[key].float() - want[key].float()).abs().max().item()
            scale = want[key].float().abs().max().item()
            assert err <= 2 * sdpa_err + 1e-2 * scale, f"{name}: {key} error {err:.3e} vs SDPA's {sdpa_err:.3e}"

    @pytest.mark.parametrize("name", list(GPU_CASES))
    def test_matches_reference(self, name):
        case = replace(GPU_CASES[name], d=128, dv=256, dtype=torch.bfloat16, blocks=None)
        self._assert_matches(name, case, self._results(name, case, "triton"))

    def test_split_dk_dv_tiles_match_reference(self):
        """The split dK/dV programs (a candidate the autotuner weighs, so not always chosen), compiled."""
        from megadiff.ops.triton_kernel import KernelConfig, differential_attention_triton

        name, case = "split-dkdv-n2048", Case(n_q=2048, n_k=2048, d=128, dv=256, dtype=torch.bfloat16,
                                              per_head_lam=True, blocks=None)
        inputs, grad_out = make_inputs(name, case, device="cuda")
        split = partial(differential_attention_triton, config=KernelConfig(32, 128, 8, 2, split=True))
        self._assert_matches(name, case, outputs_and_grads(split, inputs, grad_out, case))

    @pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
    @pytest.mark.parametrize("backend", ["sdpa", "sdpa_split_v"])
    def test_sdpa_backends_match_reference_under_each_sdpa_kernel(self, backend, kernel):
        """What model.sdpa_kernels may choose, at the 3B head shape: whether cuDNN takes V 256 wide with Q and K
        128 on Hopper depends on torch's and cuDNN's versions (current torch: the forward only, so training's
        calls skip it here), and split-V's calls it takes. The bound: 5e-2 of the
        largest value; bf16 kernels that round P and dS before their matmuls are up to 2e-2 of it off (CPU's
        flash kernel in split-V's dV at N=512), a wrong one the value itself. A kernel that does not take the
        call skips, naming it."""
        from megadiff.ops import sdpa_kernel_order

        name = "sdpa-kernels-n2048"
        case = Case(gqa=False, n_q=2048, n_k=2048, d=128, dv=256, dtype=torch.bfloat16, per_head_lam=True,
                    blocks=None)
        inputs, grad_out = make_inputs(name, case, device="cuda")

        def attention(*args, **kwargs):
            with sdpa_kernel_order([kernel]):
                return differential_attention(*args, **kwargs, backend=backend)

        try:
            got = outputs_and_grads(attention, inputs, grad_out, case)
        except RuntimeError as error:
            if "No viable backend" not in str(error) and "No available kernel" not in str(error):
                raise
            pytest.skip(f"SDPA's {kernel} kernel does not take {backend}'s calls here")
        want = self._results(name, case, "reference")
        for key in want:
            err = (got[key].float() - want[key].float()).abs().max().item()
            scale = want[key].float().abs().max().item()
            assert err <= 5e-2 * scale, f"{backend} on {kernel}: {key} error {err:.3e} of {scale:.3e}"

    def test_deterministic_backward(self):
        case = Case(n_q=1024, n_k=1024, d=128, dv=256, dtype=torch.bfloat16, blocks=None)
        first, second = (self._results("determinism", case, "triton") for _ in range(2))
        for key in NAMES:
            assert torch.equal(first[key], second[key]), f"{key} differs between two identical runs"


if __name__ == "__main__":
    _interpreter_main(sys.argv[1])
