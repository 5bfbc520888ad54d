"""`megadiff outliers` (the DIFF paper's Table 5): its statistics against a naive computation over
every value, and its attention logits against the maps the layer itself combines."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

from megadiff.cli import main
from megadiff.inference import load_checkpoint
from megadiff.inference.evaluate import evaluation_config, held_out_dataset, sample_batches
from megadiff.inference.hf_model import load_model
from megadiff.inference import outliers
from megadiff.inference.outliers import TOP, AbsStatistics, attention_maps, causal_scores
from tests.held_out_runs import held_out_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{variant: run directory} of DIFF and softmax checkpoints (4 heads over 2 key/value heads)."""
    root = tmp_path_factory.mktemp("outliers")
    runs = {variant: held_out_run(root, variant)[0] for variant in ("diff", "softmax")}
    masked = tmp_path_factory.mktemp("outliers-documents")
    runs["diff-documents"] = held_out_run(masked, "diff", overrides=("data.document_masking=true",))[0]
    # a 64K run's checkpoint: its config's context parallelism cannot split every length read in one process
    runs["diff-context-parallel"] = held_out_run(tmp_path_factory.mktemp("outliers-cp"), "diff",
                                                 overrides=("parallel.context=2",))[0]
    return runs


def test_streamed_statistics_equal_those_of_all_values_at_once():
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randn(n, generator=generator) * scale for n, scale in ((1000, 1.0), (37, 50.0), (5000, 0.01))]
    pieces.append(torch.zeros(10))
    stats = AbsStatistics()
    for piece in pieces:
        stats.add(piece)
    everything = torch.cat(pieces).abs()
    summary = stats.summary()
    assert summary["values"] == everything.numel()
    for k in TOP:
        assert summary[f"top_{k}"] == pytest.approx(torch.topk(everything, k).values[-1].item())
    assert summary["median"] == pytest.approx(everything.median().item(), rel=2e-3)


@pytest.mark.parametrize("values", [1, 500, 10_000])
def test_scores_are_formed_within_a_budget_of_values_whatever_the_heads_and_length(values):
    """Each block of scores holds at most `values` (a whole query row at least): a fixed number of rows
    would form some 10 GB of them at once for a 64K context's heads, and more for a batch."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 4, generator=generator) for _ in range(2))
    full = q @ k.transpose(-1, -2) * 0.5
    blocks = list(causal_scores(q, k, 0.5, values=values))
    assert max(block.numel() for block in blocks) <= max(values, 2 * 3 * 40)
    torch.testing.assert_close(torch.cat([block.flatten() for block in blocks]).sort().values,
                               full[:, :, torch.ones(40, 40, dtype=torch.bool).tril()].flatten().sort().values)


def test_values_are_binned_a_slice_at_a_time(monkeypatch):
    """The histogram's fp64 copy and bin indices (16 bytes a value) are formed HISTOGRAM_VALUES at a time."""
    binned, bucketize = [], torch.bucketize
    monkeypatch.setattr(torch, "bucketize", lambda values, edges: binned.append(values.numel()) or bucketize(values,
                                                                                                              edges))
    stats = AbsStatistics()
    stats.add(torch.randn(outliers.HISTOGRAM_VALUES + 100, generator=torch.Generator().manual_seed(0)))
    assert binned == [outliers.HISTOGRAM_VALUES, 100] and int(stats.counts.sum()) == stats.count


def _naive_statistics(model, dataset, sequences: int, eod: int | None = None) -> dict[str, torch.Tensor]:
    """Every attention logit (full score matrices, causal entries: within documents with `eod`) and every
    layer output, kept."""
    captured = {"attention_logits": [], "hidden_states": []}
    checked = []
    batch_tokens = []

    def before_attention(module, args):
        query, key, value = args[:3]
        maps = attention_maps(module, query, key)
        scale = module.softmax_scale or query.shape[-1] ** -0.5
        seq = query.shape[0]
        visible = torch.ones(seq, seq, dtype=torch.bool).tril().expand(query.shape[1], 1, seq, seq)
        if eod is not None:  # pairs within one document, which ends with its EOD
            ends = (batch_tokens[-1] == eod).long()
            documents = ends.cumsum(1) - ends
            visible = visible & (documents[:, None, :, None] == documents[:, None, None, :])
        scores = [q.float() @ k.float().transpose(-1, -2) * scale for q, k in maps]
        for full in scores:
            captured["attention_logits"].append(full.permute(0, 2, 3, 1)[visible[:, 0]].flatten())
        # the maps recombined as the paper's formula: the layer's own output, so the pairing and masks are right
        probabilities = [torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) for s in scores]
        checked.append((module, value, probabilities))

    def after_attention(module, args, output):
        _, value, probabilities = checked[-1]
        d = args[0].shape[-1]
        seq, batch = value.shape[:2]
        heads = probabilities[0].shape[1]
        if len(probabilities) == 2:  # differential: (A1 - lambda A2) V, head-wise RMSNorm, (1 - lambda_init)
            v = value.reshape(seq, batch, -1, 2 * d).permute(1, 2, 0, 3).repeat_interleave(
                heads // (value.shape[2] // 2), dim=1).float()
            lam = module.current_lambda().float()
            combined = probabilities[0] @ v - lam * (probabilities[1] @ v)
            combined = F.rms_norm(combined, (2 * d,), module.head_norm_weight.float(), module.head_norm_eps)
            combined = combined * (1.0 - module.lambda_init)
        else:
            v = value.permute(1, 2, 0, 3).repeat_interleave(heads // value.shape[2], dim=1).float()
            combined = probabilities[0] @ v
        expected = combined.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        torch.testing.assert_close(output.float(), expected, rtol=1e-4, atol=1e-5)

    def after_layer(module, args, output):
        captured["hidden_states"].append(output[0].flatten())

    handles = []
    for layer in model.gpt.decoder.layers:
        handles += [layer.self_attention.core_attention.register_forward_pre_hook(before_attention),
                    layer.self_attention.core_attention.register_forward_hook(after_attention),
                    layer.register_forward_hook(after_layer)]
    with torch.no_grad():
        for tokens, _ in sample_batches(dataset, range(sequences), 2):
            batch_tokens.append(tokens)
            model.hidden_states(tokens, eod)
    for handle in handles:
        handle.remove()
    assert len(checked) == 2 * len(model.gpt.decoder.layers)  # two batches
    return {name: torch.cat(values).abs() for name, values in captured.items()}


def test_scores_within_the_pairs_a_mask_allows_are_those_of_the_whole_matrix():
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, 11, 4, generator=generator) for _ in range(2))
    allowed = torch.rand(2, 11, 11, generator=generator) < 0.6
    full = (q @ k.transpose(-1, -2) * 0.5).permute(0, 2, 3, 1)[allowed & torch.ones(11, 11, dtype=torch.bool).tril()]
    blocks = causal_scores(q, k, 0.5, values=2 * 3 * 11 * 3, attends=lambda rows: allowed[:, rows])
    streamed = torch.cat([block.flatten() for block in blocks])
    torch.testing.assert_close(streamed.sort().values, full.flatten().sort().values)


@pytest.mark.parametrize("variant", ["diff", "softmax", "diff-documents", "diff-context-parallel"])
def test_cli_report_equals_naive_statistics(runs, tmp_path, variant):
    """A checkpoint trained with data.document_masking is measured as it runs: within its documents."""
    out = tmp_path / "outliers.json"
    # documents: longer than one (some 600 tokens); context parallel: a length its 2 x 2 chunks cannot split
    seq_length = {"diff-documents": 1024, "diff-context-parallel": 34}.get(variant)
    window = ["--seq-length", str(seq_length)] if seq_length else []
    assert main(["outliers", "--load", str(runs[variant]), "--sequences", "3", "--batch-size", "2", *window,
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    model = load_checkpoint(runs[variant])
    cfg = evaluation_config(model.cfg, seq_length, [])
    dataset = held_out_dataset(cfg, model.tokenizer, "valid", 3, None)
    eod = model.tokenizer.eod if cfg.data.document_masking else None
    if eod is not None:  # an EOD inside a sample: its documents are attended apart
        assert any(eod in dataset[i]["tokens"][:-1] for i in range(3))
    naive = _naive_statistics(model, dataset, 3, eod)
    assert report["variant"] == variant.split("-")[0] and report["sequences"] == 3
    for name, values in naive.items():
        assert report[name]["values"] == values.numel()
        for k in TOP:
            assert report[name][f"top_{k}"] == pytest.approx(torch.topk(values, k).values[-1].item(), rel=1e-5)
        assert report[name]["median"] == pytest.approx(values.median().item(), rel=2e-3)


@pytest.mark.parametrize("variant", ["diff", "softmax"])
def test_an_exported_model_reports_the_checkpoints_statistics(runs, tmp_path, variant):
    """--hf on the run's export (stock DiffLlama or Llama, run by transformers), the held-out text
    named by data.* overrides: every map's logits (DiffLlama's second call, the same maps with the
    other half of V, counted once) and every layer's output, as the checkpoint reports them."""
    assert main(["convert", "to-hf", "--load", str(runs[variant]), "--save", str(tmp_path / "hf")]) == 0
    options = ["--sequences", "3", "--batch-size", "2"]
    assert main(["outliers", "--load", str(runs[variant]), *options, "--output", str(tmp_path / "run.json")]) == 0
    data = load_checkpoint(runs[variant]).cfg.data
    assert main(["outliers", "--hf", str(tmp_path / "hf"), "--dtype", "fp32", "--seq-length", "32", *options,
                 f"data.prefix={data.prefix}", f"data.split={data.split}", f"data.cache_dir={data.cache_dir}",
                 "--output", str(tmp_path / "hf.json")]) == 0
    ours, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("run", "hf"))
    assert theirs["variant"] == ("DiffLlamaForCausalLM" if variant == "diff" else "LlamaForCausalLM")
    for name in ("attention_logits", "hidden_states"):
        assert theirs[name]["values"] == ours[name]["values"]
        for key, value in ours[name].items():
            assert theirs[name][key] == pytest.approx(value, rel=1e-4), (name, key)
    _recorded_queries_and_keys_are_freed(tmp_path / "hf")


def _recorded_queries_and_keys_are_freed(hf_dir):
    """Once a batch ran, no layer's queries or keys stay alive (54 GB for a 13B model at 64K tokens)."""
    recorder = outliers.HFActivationRecorder(load_model(None, str(hf_dir), "fp32"))
    seen, record = [], recorder._attention
    recorder._attention = lambda module, query, key, *rest: seen.extend(map(weakref.ref, (query, key))) or \
        record(module, query, key, *rest)
    with torch.no_grad():
        recorder.run(torch.randint(0, 100, (1, 16)))
    recorder.close()
    gc.collect()
    assert seen and all(ref() is None for ref in seen)


@pytest.mark.parametrize("variant", ["dint", "shared_diff"])
def test_exports_of_megadiffs_own_code_are_refused_by_the_commands_reading_attention_before_any_work(
        tmp_path, monkeypatch, capsys, variant):
    """A DINT or Shared DIFF export runs megadiff's modeling code, which calls SDPA itself: `outliers --hf` and
    `needles --attention --hf` read no layer's attention there. They said so only once the data was prepared
    and the weights read, and without naming the checkpoint's command that reads it."""
    from megadiff.inference import needles

    run_dir, _ = held_out_run(tmp_path, variant)
    assert main(["convert", "to-hf", "--load", str(run_dir), "--save", str(tmp_path / "hf")]) == 0
    for module in (outliers, needles):
        monkeypatch.setattr(module, "load_model", lambda *args: pytest.fail("the weights were read"))
        monkeypatch.setattr(module, "ensure_prepared", lambda *args: pytest.fail("the data was prepared"))
    for command, options in (("outliers", ["--sequences", "2"]), ("needles --attention", ["--lengths", "128"])):
        name, *flags = command.split()
        capsys.readouterr()
        assert main([name, "--hf", str(tmp_path / "hf"), *flags, *options]) == 2
        assert f"run `megadiff {command} --load` on the checkpoint" in capsys.readouterr().err
