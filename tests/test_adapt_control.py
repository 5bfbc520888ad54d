"""`adaptation.method: finetune`, the papers' control (Dex's and DAA's "FT" rows): the same model fine-tuned on
the same data, in the same order, without any adapter, exported as its stock architecture. 2 gloo ranks, ZeRO-2,
on test_adapt_finetune's tiny Llama."""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megadiff.adapt.config import PAPER_TRAINABLE
from megadiff.observability.metrics import read_metrics
from tests.distributed import run_reporting_ranks
from tests.test_adapt_finetune import ITERS, _env, _trained_weights, adapt_in_ranks, adapt_workspace, finetuned

CONTROL = "adaptation.method=finetune"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return adapt_workspace(tmp_path_factory.mktemp("adapt"))


def batches_recorded(config: str, overrides: list[str], report: str) -> int:
    """finetuned() in a rank, writing the (input_ids, labels) of each micro-batch it trained on into
    `report`/RANK.json, in the order it read them."""
    import torch.distributed as dist

    from megadiff.adapt.data import BatchReader

    read, batches = BatchReader.micro_batch_at, []

    def micro_batch_at(reader, iteration, micro_step):
        input_ids, labels = read(reader, iteration, micro_step)
        batches.append([input_ids.tolist(), labels.tolist()])
        return input_ids, labels

    with mock.patch.object(BatchReader, "micro_batch_at", micro_batch_at):
        code = finetuned(config, overrides)
    Path(report, f"{dist.get_rank()}.json").write_text(json.dumps(batches))
    return code


def run_recording_batches(workspace: Path, output: Path, *overrides: str) -> list[list]:
    """An adaptation into `output` in 2 ranks; per rank, the micro-batches it trained on."""
    reports = output.with_name(f"{output.name}-batches")
    reports.mkdir()
    with mock.patch.dict(os.environ, _env(workspace)):
        run_reporting_ranks(2, batches_recorded, str(workspace / "adapt.yaml"), [*overrides, f"output_dir={output}"],
                            str(reports), timeout=400)
    return [json.loads((reports / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def control_run(workspace):
    """The control's uninterrupted run and the micro-batches each rank trained on."""
    output = workspace / "control"
    return output, run_recording_batches(workspace, output, CONTROL)


def base_model(workspace: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(workspace / "model").eval()


@pytest.mark.slow
def test_the_controls_first_loss_is_the_original_models_on_the_same_batch(control_run, workspace):
    """Nothing is changed at initialisation: iteration 1's loss is the pretrained model's mean cross entropy over
    that global batch (both ranks' micro-batches), computed here in plain torch."""
    output, batches = control_run
    per_rank = len(batches[0]) // ITERS  # micro-batches of one iteration
    first = [batch for rank_batches in batches for batch in rank_batches[:per_rank]]
    input_ids, labels = (torch.tensor([rows for batch in first for rows in batch[i]]) for i in (0, 1))
    with torch.no_grad():
        logits = base_model(workspace)(input_ids).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    records = read_metrics(output)
    assert records[0]["lm_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert "lambda" not in records[0]  # no adapter: no lambda(t) to log
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]


@pytest.mark.slow
def test_the_control_reads_the_data_in_a_dex_runs_order(control_run, workspace):
    """The same seed: every rank trains on the micro-batches a Dex run trains on, in the same order (Dex's head
    selection reads its calibration batches aside, moving nothing)."""
    _, control = control_run
    dex = run_recording_batches(workspace, workspace / "dex", "adaptation.method=dex")
    assert len(control[0]) == ITERS * 2  # iterations x micro-steps
    assert control == dex


@pytest.mark.slow
def test_the_controls_export_is_the_stock_model_with_the_trained_weights(control_run, workspace):
    """The export loads without remote code as LlamaForCausalLM, and its logits are those of the base model
    given the final checkpoint's trained parameters: the attention modules and the LM head (DAA's FT); the rest
    is the base model's."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    output, _ = control_run
    config = json.loads((output / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert "auto_map" not in config and "adaptation" not in config and not list((output / "hf").glob("*.py"))
    exported = AutoModelForCausalLM.from_pretrained(output / "hf", trust_remote_code=False).eval()
    assert type(exported) is LlamaForCausalLM

    base, trained = base_model(workspace), _trained_weights(output, ITERS)
    names = [name for name, _ in base.named_parameters()]
    assert sorted(trained) == sorted(name for name in names
                                     if any(fnmatch.fnmatchcase(name, p) for p in PAPER_TRAINABLE["finetune"]))
    assert all(not torch.equal(base.state_dict()[name], tensor) for name, tensor in trained.items())
    base.load_state_dict(trained, strict=False)
    input_ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, base(input_ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_a_resumed_control_equals_the_uninterrupted_one(control_run, workspace):
    """Stopped after iteration 2 and rerun: the same losses, lrs and gradient norms as the uninterrupted run, and
    the same exported weights."""
    from safetensors.torch import load_file

    uninterrupted, _ = control_run
    output = workspace / "control-resumed"
    adapt_in_ranks(workspace, CONTROL, f"output_dir={output}", "checkpoint.exit_interval=2")
    assert len(read_metrics(output)) == 2 and not (output / "hf").exists()
    rerun = adapt_in_ranks(workspace, CONTROL, f"output_dir={output}")
    assert "resuming after iteration 2" in rerun.stdout
    keys = ("iteration", "lm_loss", "lr", "grad_norm")
    assert [{k: r[k] for k in keys} for r in read_metrics(output)] == \
        [{k: r[k] for k in keys} for r in read_metrics(uninterrupted)]
    weights, expected = (load_file(run / "hf" / "model.safetensors") for run in (output, uninterrupted))
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_the_control_under_zero3_follows_zero2(control_run, workspace):
    """ZeRO-3 partitions the weights (the export gathers them whole): the curve and the exported weights of the
    ZeRO-2 run."""
    from safetensors.torch import load_file

    zero2, _ = control_run
    output = workspace / "control-zero3"
    adapt_in_ranks(workspace, CONTROL, f"output_dir={output}", f"deepspeed={workspace / 'zero3_all.json'}")
    assert [r["lm_loss"] for r in read_metrics(output)] == pytest.approx([r["lm_loss"] for r in read_metrics(zero2)],
                                                                         rel=1e-5)
    weights, expected = (load_file(run / "hf" / "model.safetensors") for run in (output, zero2))
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5)
