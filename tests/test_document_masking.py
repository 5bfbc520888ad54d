"""Document masking (data.document_masking): attention never crosses an EOD.

The op against the paper formula with an explicit document mask (every backend, DINT's running
mean restarting per document, gradients); the batch's boundaries from its tokens; a model
whose later document gives the same logits as that document alone; training and evaluation with
it. Parallel layouts with it (CP included) against one process: tests/test_parallel_parity.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from megadiff.convert.to_hf import convert_to_hf
from megadiff.inference.evaluate import evaluate
from megadiff.models.documents import document_cu_seqlens, document_packing
from megadiff.observability.metrics import read_metrics
from megadiff.ops import differential_attention, softmax_attention
from megadiff.ops.documents import document_bounds, document_spans, prefix_cu_seqlens
from tests.convert_worker import reference_model, variant_config
from tests.pretrain_runs import losses, run_pretrain, tiny_overrides
from tests.test_ops import assert_matches_paper_formula, make_inputs

N = 9
CU_SEQLENS = [0, 3, 4, 9, 11, 18]  # sample 0: documents of 3, 1 and 5 tokens; sample 1: 2 and 7


def visible_keys(cu_seqlens: list[int], batch: int, n: int) -> torch.Tensor:
    """[B, N, N]: query i sees key j when j <= i and no boundary lies in (j, i]."""
    document = torch.zeros(batch * n, dtype=torch.long)
    for boundary in cu_seqlens[1:-1]:
        document[boundary:] += 1
    document = document.view(batch, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal & (document[:, :, None] == document[:, None, :])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split_v"])
@pytest.mark.parametrize("integral", [False, True])
def test_op_matches_the_paper_formula_with_a_document_mask(backend, integral):
    inputs = make_inputs(n=N, per_head=True)
    out = differential_attention(*inputs, causal=True, integral=integral, backend=backend,
                                 cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32))
    assert_matches_paper_formula(out, inputs, True, integral, visible=visible_keys(CU_SEQLENS, 2, N))


def test_dints_running_mean_of_a_short_document_late_in_a_long_sequence_keeps_fp32_precision():
    """A1 V rows share a mean direction: as the difference of whole-sequence prefix sums, the last
    3-token document's running mean at 64K was 1.5% off in fp32; autograd keeps no [B, N, H, e] prefix."""
    from megadiff.ops.common import running_mean

    n = 65536
    x = 1.0 + 0.3 * torch.randn(1, n, 1, 8, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    starts = torch.zeros(1, n, dtype=torch.long)
    starts[0, n - 3:] = n - 3
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        late = running_mean(x, True, starts)[0, n - 3:]
    exact = x[0, n - 3:].double().cumsum(0) / torch.arange(1, 4, dtype=torch.float64).view(3, 1, 1)
    torch.testing.assert_close(late.double(), exact, rtol=1e-5, atol=0)
    assert max(saved) < x.numel()
    late.sum().backward()  # each of the last 3 positions is in 1, 2 or 3 of their running means' sums
    torch.testing.assert_close(x.grad[0, n - 3:, 0, 0], torch.tensor([1 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 3, 1 / 3]))
    assert x.grad[0, :n - 3].abs().max() < 1e-6  # none but rounding


def test_the_running_means_adjoint_of_a_short_document_early_in_a_long_sequence_keeps_fp32_precision():
    """The Triton path's backward of DINT's running mean sums each document's suffix: as the difference of
    whole-sequence suffix sums it cancelled as the forward's prefix sums did."""
    from megadiff.ops.common import sum_until

    n = 65536
    x = 1.0 + 0.3 * torch.randn(1, n, 1, 8, generator=torch.Generator().manual_seed(0))
    ends = torch.full((1, n), n)
    ends[0, :3] = 3
    exact = torch.stack([x[0, i:3].double().sum(0) for i in range(3)])
    torch.testing.assert_close(sum_until(x, ends)[0, :3].double(), exact, rtol=1e-5, atol=0)


def test_softmax_attention_matches_sdpa_with_a_document_mask():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, N, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = softmax_attention(q, k, v, cu_seqlens=CU_SEQLENS)
    mask = visible_keys(CU_SEQLENS, 2, N)[:, None]  # [B, 1, N, N]
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    torch.testing.assert_close(out, want.transpose(1, 2))


def test_one_document_per_sample_is_plain_causal_attention():
    inputs = make_inputs(n=N)
    whole = differential_attention(*inputs, backend="sdpa", cu_seqlens=[0, N, 2 * N])
    torch.testing.assert_close(whole, differential_attention(*inputs, backend="sdpa"), rtol=0, atol=0)


@pytest.mark.parametrize("cu_seqlens, message", [
    ([0, 4, 12, 18], "every sample boundary"),  # a document running from sample 0 into sample 1
    ([0, 4, 4, 9, 18], "strictly increasing"),
    ([0, 9, 17], "from 0 to"),
    ([1, 9, 18], "from 0 to"),
])
def test_bad_boundaries_are_refused(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        document_spans(cu_seqlens, 2, N)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split_v"])
def test_queries_that_are_the_last_keys_see_their_documents(backend):
    """A context-parallel chunk: queries [4, 9) of each sample, keys [0, 9), documents over the keys."""
    inputs = make_inputs(n=5, n_k=N, per_head=True)
    out = differential_attention(*inputs, backend=backend, cu_seqlens=CU_SEQLENS)
    assert_matches_paper_formula(out, inputs, True, False, visible=visible_keys(CU_SEQLENS, 2, N)[:, N - 5:])


def test_prefix_cu_seqlens_cuts_documents_at_the_prefix():
    spans = document_spans(CU_SEQLENS, 2, N)
    assert prefix_cu_seqlens(spans, 4) == [0, 3, 4, 6, 8]  # sample 1's second document starts inside it
    assert prefix_cu_seqlens(spans, 2) == [0, 2, 4]
    assert prefix_cu_seqlens(spans, N) == CU_SEQLENS


def test_needs_causal_attention_of_one_batch():
    with pytest.raises(ValueError, match="needs causal attention"):
        differential_attention(*make_inputs(n=N), causal=False, cu_seqlens=[0, N, 2 * N])
    q1, k1, q2, k2, v, lam = make_inputs(n=N)
    with pytest.raises(ValueError, match="needs causal attention"):
        softmax_attention(q1[:1], k1, v, cu_seqlens=[0, N, 2 * N])


def test_boundaries_follow_eod_tokens():
    eod = 0
    tokens = torch.tensor([[5, 6, eod, 7, eod, 8],     # documents end after each EOD
                           [eod, 1, 2, 3, 4, eod]])    # an EOD first; one last, at the sample's end
    assert document_cu_seqlens(tokens, eod).tolist() == [0, 3, 5, 6, 7, 12]
    assert document_cu_seqlens(torch.ones(2, 6, dtype=torch.long), eod).tolist() == [0, 6, 12]
    spans = document_spans(document_cu_seqlens(tokens, eod), 2, 6)
    assert spans == [[(0, 3), (3, 5), (5, 6)], [(0, 1), (1, 6)]]
    starts, ends = document_bounds(spans)
    assert starts.tolist() == [[0, 0, 0, 3, 3, 5], [0, 1, 1, 1, 1, 1]]
    assert ends.tolist() == [[3, 3, 3, 5, 5, 6], [1, 6, 6, 6, 6, 6]]


@pytest.mark.parametrize("variant", ["softmax", "diff", "dint", "shared_diff"])
def test_a_later_document_gets_the_logits_it_gets_alone(variant, tmp_path):
    """Through megatron's GPTModel: the document after an EOD is computed as if it were alone
    (RoPE is relative, so its shifted positions do not matter); without masking it is not."""
    cfg = variant_config(variant, "single", str(tmp_path))
    model = reference_model(cfg).gpt
    seq, eod = cfg.model.seq_length, 0
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.model.vocab_size, (2, seq), generator=gen)
    tokens[0, 10] = eod  # sample 0: 11 tokens, then a document of 21; sample 1: one document
    positions = torch.arange(seq).expand(2, seq)
    documents = document_packing(document_cu_seqlens(tokens, eod), seq)
    with torch.no_grad():
        masked = model(tokens, positions, None, packed_seq_params=documents)
        unmasked = model(tokens, positions, None)
        alone = model(tokens[:1, 11:], positions[:1, :seq - 11], None)
    torch.testing.assert_close(masked[0, 11:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[:, :11], unmasked[:, :11], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked[1], unmasked[1], rtol=1e-6, atol=1e-6)
    assert (unmasked[0, 11:] - alone[0]).abs().max() > 1e-3  # without masking the first document leaks in


@pytest.mark.slow
def test_pretraining_and_evaluation_mask_the_corpus_documents(small_tokenizer_dir, tmp_path, capsys):
    """`data.document_masking=true` from the loader (boundaries at the KJV chapters' EODs, collated
    in a worker process) to every layer: the first iteration, same weights and samples, gives
    another loss than without masking, and `megadiff evaluate` scores the validation samples as
    the run's validation did (its checkpoint's config masks; an override turns it off)."""
    base = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + ["model.seq_length=512", "train.iters=2"]
    masked, plain = tmp_path / "masked", tmp_path / "plain"
    # three validation batches: the valid split's first EOD comes in its 14th sample
    run_pretrain(1, base + [f"output_dir={masked}", "data.document_masking=true", "train.dataloader_workers=1",
                            "train.eval_interval=2", "train.eval_iters=3", "checkpoint.save_interval=2"])
    run_pretrain(1, base + [f"output_dir={plain}"])
    with_masking, without = losses(masked), losses(plain)
    assert len(with_masking) == 2 and all(math.isfinite(x) for x in with_masking)
    assert abs(with_masking[0] - without[0]) > 1e-4

    (validation,) = [record["valid_loss"] for record in read_metrics(masked) if "valid_loss" in record]
    scores = {}
    for setting in ("true", "false"):
        report = tmp_path / f"eval-{setting}.json"
        assert evaluate(str(masked), sequences=24, batch_size=4, output=str(report),
                        overrides=[f"data.document_masking={setting}"]) == 0
        scores[setting] = json.loads(report.read_text())
        assert scores[setting]["document_masking"] == (setting == "true")
    assert scores["true"]["loss"] == pytest.approx(validation, rel=1e-5)
    assert abs(scores["false"]["loss"] - validation) > 1e-4

    # its export attends across documents, as transformers does: to-hf says so (a run without masking: nothing)
    for run in (masked, plain):
        convert_to_hf(run, tmp_path / "hf" / run.name, check=False)
    said = capsys.readouterr().out
    assert said.count("trained with data.document_masking") == 1 and f"{masked / 'checkpoints'}" in said


def test_what_documents_give_is_derived_once_per_tensor_for_a_few_tensors():
    """A context-parallel layer's two query chunks bring a cu_seqlens each, layer after layer: both keep
    what was derived from them (the fused kernel's bounds, the chunks' documents), up to four tensors."""
    from megadiff.ops.documents import DerivedPerTensor

    derived, made = DerivedPerTensor(tensors=4), []
    tensors = [torch.tensor([0, 3, 8]) for _ in range(5)]

    def value(index: int, key: str):
        return derived(tensors[index], key, lambda: made.append((index, key)) or (index, key))

    for _ in range(3):  # layers
        assert value(0, "bounds") == (0, "bounds") and value(1, "bounds") == (1, "bounds")
    assert value(0, "starts") == (0, "starts")
    assert made == [(0, "bounds"), (1, "bounds"), (0, "starts")]
    for index in (2, 3, 4):  # a fifth tensor: the least recently added goes
        value(index, "bounds")
    value(1, "bounds")
    assert made[-1] == (4, "bounds")
    value(0, "bounds")
    assert made[-1] == (0, "bounds")
    tensors[1][1] = 4  # modified in place: derived anew
    value(1, "bounds")
    assert made[-1] == (1, "bounds") and len(made) == 8


class _FakeGpuCopies:
    """torch.Tensor.to and pin_memory where a CPU-only torch cannot copy to a GPU: a copy to CUDA returns the
    tensor itself and records (its source was pinned, non_blocking)."""

    def __init__(self, monkeypatch):
        self.copies: list[tuple[bool, bool]] = []
        to = torch.Tensor.to

        def fake_to(tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, torch.device) and target.type == "cuda":
                self.copies.append((getattr(tensor, "pinned_here", False), kwargs.get("non_blocking", False)))
                return tensor
            return to(tensor, *args, **kwargs)

        def fake_pin_memory(tensor):
            pinned = tensor.clone()
            pinned.pinned_here = True
            return pinned

        monkeypatch.setattr(torch.Tensor, "to", fake_to)
        monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin_memory)


class _OnGpu:
    """A [B, N, H, d] stand-in for a CUDA tensor: what the kernel's document bounds read of q and k."""

    def __init__(self, *shape):
        self.shape, self.device = torch.Size(shape), torch.device("cuda", 0)


def test_the_kernels_document_bounds_reach_the_gpu_without_waiting_for_it(monkeypatch):
    """torch copies pageable host memory to a GPU and then synchronises the stream: the bounds, copied in each
    micro-batch's first layer, stalled the host until the GPU had run everything queued before them."""
    pytest.importorskip("triton")
    from megadiff.ops.triton_kernel import _documents

    fake = _FakeGpuCopies(monkeypatch)
    _documents(torch.tensor(CU_SEQLENS), True, _OnGpu(2, N, 2, 4), _OnGpu(2, N, 1, 4))
    assert fake.copies == [(True, True), (True, True)]  # starts and ends: pinned, queued


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_document_masked_kernel_step_never_synchronises_with_the_gpu():
    pytest.importorskip("triton")
    from megadiff.ops.triton_kernel import paired_differential_attention_triton

    torch.manual_seed(0)
    q, k = (torch.randn(2, N, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(2, N, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lam = torch.tensor(0.3, device="cuda", requires_grad=True)

    def step():  # a new cu_seqlens each time, as each micro-batch brings
        out = paired_differential_attention_triton(q, k, v, lam, cu_seqlens=torch.tensor(CU_SEQLENS))
        out.float().square().sum().backward()

    step()  # the autotuner measures (and synchronises) once per shape
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
