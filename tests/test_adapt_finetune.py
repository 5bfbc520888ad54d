"""`megadiff adapt` end to end: 2 real gloo ranks under torchrun / the deepspeed launcher for ZeRO
1, 2 and 3 on a tiny Llama (with its own trained BPE tokenizer and KJV text), the stages against
each other, exact resume against an uninterrupted run, the exported HF directory, config errors."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from megadiff.adapt.deepspeed_setup import deepspeed_config
from megadiff.adapt.schedule import lr_multiplier
from megadiff.adapt.settings import load_finetune_config
from megadiff.config import ConfigError
from megadiff.errors import MegadiffError
from megadiff.files import iteration_dir, write_atomically
from megadiff.observability.metrics import read_metrics
from tests.distributed import megadiff_main, reserved_port, run_ranks, run_reporting_ranks
from tests.test_chat_data import CHATML
from tests.wandb_log import exit_codes, logged_history_and_config

REPO = Path(__file__).resolve().parents[1]
ITERS = 4


def _write_tiny_llama(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    kjv = Path(list(find_spec("bible").submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    with open(kjv) as lines:
        verses = [json.loads(line)["text"] for line, _ in zip(lines, range(1200))]
    documents = ["\n".join(verses[i:i + 20]) for i in range(0, len(verses), 20)]
    (directory / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                         max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return adapt_workspace(tmp_path_factory.mktemp("adapt"))


def adapt_workspace(root: Path) -> Path:
    """A tiny Llama, its training data and an adaptation config (ZeRO-2) adapting it, under `root`."""
    _write_tiny_llama(root)
    zero3 = json.loads((REPO / "configs/deepspeed/zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny tensors
    (root / "zero3_all.json").write_text(json.dumps(zero3))
    config = {
        "model": {"path": str(root / "model")},
        "adaptation": {"method": "dex", "anneal_steps": 3, "calibration_batches": 2},
        "data": {"files": [str(root / "train.jsonl")], "seq_length": 32},
        "train": {"iters": ITERS, "micro_batch_size": 2, "grad_accum": 2, "lr": 3e-3, "warmup_ratio": 0.25},
        "checkpoint": {"save_interval": 2},
        "deepspeed": str(REPO / "configs/deepspeed/zero2.json"),
        "output_dir": str(root / "unused"),
    }
    (root / "adapt.yaml").write_text(yaml.safe_dump(config))
    return root


def _env(workspace: Path) -> dict:
    return {**os.environ, "HF_HOME": str(workspace / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(workspace / "torch_extensions"),
            "PYTHONPATH": str(REPO)}


def run_adapt(workspace: Path, *overrides: str, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    with reserved_port() as port:
        if launcher == "torchrun":
            command = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "megadiff"]
        else:
            # its own port: the launcher's default, 29500, is every launcher's, and another test's run may hold it
            command = [str(bin_dir / "deepspeed"), "--num_gpus=2", f"--master_port={port}", "--no_local_rank",
                       "--module", "megadiff"]
        result = subprocess.run(command + ["adapt", str(workspace / "adapt.yaml"), *overrides], env=_env(workspace),
                                capture_output=True, text=True, timeout=400, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def adapt_in_ranks(workspace: Path, *overrides: str, command=None) -> subprocess.CompletedProcess:
    """run_adapt's run in the gloo ranks of tests/distributed.py (a second to start, not a launcher's ten): for
    tests of what an adaptation does, not of how a launcher starts it (stage_runs' and the signal tests').
    `command`: what each rank runs in place of `finetuned` (with its arguments)."""
    with mock.patch.dict(os.environ, _env(workspace)):
        return run_reporting_ranks(2, command or finetuned, str(workspace / "adapt.yaml"), list(overrides),
                                   timeout=400)


def finetuned(config: str, overrides: list[str]) -> int:
    """`megadiff adapt`'s run without its CLI entry's os._exit, which would end a test's rank."""
    from megadiff.adapt.finetune import finetune

    return finetune(load_finetune_config(config, overrides))


STAGES = {1: ("configs/deepspeed/zero1.json", "deepspeed"), 2: ("configs/deepspeed/zero2.json", "torchrun"),
          3: (None, "torchrun")}
WANDB_STAGE = 2  # this stage's run also logs to W&B (offline: tests/conftest.py)
WANDB = "logging.wandb_project=megadiff-tests"


def wandb_runs(output: Path) -> list[Path]:
    return sorted((output / "wandb").glob("offline-run-*"))


def adapt_in_a_rank(workspace: Path, monkeypatch, target, output: Path, report: Path, *overrides: str) -> str:
    """target(rank, world, config, overrides, report) in one spawned rank, adapting the workspace's model into
    `output` with W&B on; what it reported."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    run_ranks(1, target, str(workspace / "adapt.yaml"), [f"output_dir={output}", WANDB, *overrides], str(report))
    return report.read_text()


@pytest.fixture
def refused_before_running():
    """For `main(["adapt", ...])` expected to be refused: an adaptation that ran instead would end pytest itself
    through finetune_from_config's os._exit, with code 0 and the later tests unrun (a pass without xdist)."""
    with mock.patch("os._exit", side_effect=AssertionError("the adaptation ran: its os._exit would end pytest")):
        yield


@pytest.fixture(scope="module")
def stage_runs(workspace):
    """One uninterrupted run per ZeRO stage (stage 1 through the deepspeed launcher), made on demand."""
    done = {}

    def get(stage: int) -> Path:
        if stage not in done:
            ds_json, launcher = STAGES[stage]
            ds_json = str(REPO / ds_json) if ds_json else str(workspace / "zero3_all.json")
            output = workspace / f"zero{stage}"
            wandb = [WANDB] if stage == WANDB_STAGE else []
            run_adapt(workspace, f"deepspeed={ds_json}", f"output_dir={output}", *wandb, launcher=launcher)
            done[stage] = output
        return done[stage]

    return get


def _load_exported(directory: Path, workspace: Path):
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_MODULES_CACHE", str(workspace / "modules"))
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_logs_and_exports(stage, stage_runs, workspace):
    output = stage_runs(stage)
    records = read_metrics(output)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for record in records:
        assert {"lm_loss", "lr", "grad_norm", "tokens_per_s", "lambda"} <= set(record)
        assert math.isfinite(record["lm_loss"]) and record["grad_norm"] > 0 and record["tokens_per_s"] > 0
        assert set(record["lambda"]) == {"layer_0", "layer_1"}
    assert all(v == 0.0 for v in records[0]["lambda"].values())  # lambda(0) = 0: the pretrained model
    assert all(v != 0.0 for v in records[1]["lambda"].values())
    assert (output / "tensorboard").is_dir() and (output / "checkpoints" / "latest").is_file()
    if stage == WANDB_STAGE:
        history, config = logged_history_and_config(wandb_runs(output))
        assert {r["iteration"]: r["lm_loss"] for r in history} == pytest.approx(
            {r["iteration"]: r["lm_loss"] for r in records})
        assert config["adaptation"]["method"] == "dex"
        assert exit_codes(wandb_runs(output)) == [0]  # W&B shows the run finished, not failed
    plan = json.loads((output / "adaptation.json").read_text())
    assert [len(layer["heads"]) for layer in plan["layers"]] == [2, 2]

    model = _load_exported(output / "hf", workspace)
    assert model.config.adaptation["step"] == ITERS and model.config.adaptation["layers"] == plan["layers"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output / "hf")
    prompt = tokenizer("In the beginning", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == prompt.shape[1] + 6


@pytest.mark.slow
def test_document_masking_reaches_training(workspace):
    """data.document_masking: the first iteration (the unmodified model: lambda(0) = 0) scores the
    same batches with attention kept within each document, so its loss differs. 128-token rows:
    the ~1,000-token documents end inside some of them."""
    first_losses = {}
    for masking in ("true", "false"):
        output = workspace / f"documents-{masking}"
        adapt_in_ranks(workspace, f"output_dir={output}", f"data.document_masking={masking}", "data.seq_length=128",
                       "train.iters=1")
        first_losses[masking] = read_metrics(output)[0]["lm_loss"]
    assert math.isfinite(first_losses["true"]) and abs(first_losses["true"] - first_losses["false"]) > 1e-4


@pytest.mark.slow
def test_zero_stages_agree(stage_runs, workspace):
    """Same data, same weights: ZeRO 1, 2 and 3 only partition differently."""
    from safetensors.torch import load_file

    curves = {stage: [r["lm_loss"] for r in read_metrics(stage_runs(stage))] for stage in (1, 2, 3)}
    for stage in (2, 3):
        assert curves[stage] == pytest.approx(curves[1], rel=1e-5)
    weights = {stage: load_file(stage_runs(stage) / "hf" / "model.safetensors") for stage in (1, 3)}
    assert weights[1].keys() == weights[3].keys()
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[3][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_resume_is_exact(stage_runs, workspace):
    """Stop at iteration 2 (exit_interval), rerun the same command: the whole curve equals the
    uninterrupted run's (ZeRO-3, the stage with partitioned weights and optimizer). Recorded every 3
    iterations, the stop falls between two records: the first holds the mean loss of iterations 1-3
    all the same, and the run's last iteration (4) is recorded although no interval ends there."""
    output = workspace / "resumed"
    command = (f"deepspeed={workspace / 'zero3_all.json'}", f"output_dir={output}", "checkpoint.exit_interval=2",
               "logging.log_interval=3")
    adapt_in_ranks(workspace, *command)
    assert read_metrics(output) == [] and not (output / "hf").exists()
    second = adapt_in_ranks(workspace, *command)
    assert "resuming after iteration 2" in second.stdout
    resumed, uninterrupted = read_metrics(output), read_metrics(stage_runs(3))
    keys = ("iteration", "lr", "grad_norm", "lambda")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in uninterrupted[2:]]
    each = [r["lm_loss"] for r in uninterrupted]
    assert [r["lm_loss"] for r in resumed] == pytest.approx([sum(each[:3]) / 3, each[3]], rel=1e-6)


def dropout_masks_recorded(config: str, overrides: list[str], report: str) -> int:
    """finetuned() in a rank, writing the attention dropout masks it drew (each as the positions it zeroed)
    into `report`/RANK.json."""
    import torch.distributed as dist
    import torch.nn.functional as F

    masks, dropout = [], F.dropout

    def recorded(input, p=0.5, training=True, inplace=False):
        output = dropout(input, p, training, inplace)
        if training and p > 0:
            masks.append((output == 0).nonzero().tolist())
        return output

    with mock.patch.object(F, "dropout", recorded):
        code = finetuned(config, overrides)
    Path(report, f"{dist.get_rank()}.json").write_text(json.dumps(masks))
    return code


def test_ranks_draw_their_own_dropout_masks_and_a_resume_draws_the_same(workspace, tmp_path):
    """A base model with attention dropout, on 2 ranks: each rank draws its own masks (seeded with seed + iteration
    alone, both drew the same ones, on their own samples), and a run stopped at iteration 2 and rerun draws the
    uninterrupted run's masks: the same losses and gradient norms."""
    model = tmp_path / "model"
    shutil.copytree(workspace / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    common = [f"model.path={model}", "model.attn_implementation=eager", "adaptation.selection=all"]
    reports = tmp_path / "masks"
    reports.mkdir()
    with mock.patch.dict(os.environ, _env(workspace)):
        run_reporting_ranks(2, dropout_masks_recorded, str(workspace / "adapt.yaml"),
                            [*common, f"output_dir={tmp_path / 'whole'}"], str(reports), timeout=400)
    first, second = (json.loads((reports / f"{rank}.json").read_text()) for rank in range(2))
    assert len(first) == len(second) == ITERS * 2 * 2  # iterations x micro-steps x layers
    assert all(mask != other for mask, other in zip(first, second))
    resumed = [*common, f"output_dir={tmp_path / 'resumed'}"]
    adapt_in_ranks(workspace, *resumed, "checkpoint.exit_interval=2")
    adapt_in_ranks(workspace, *resumed)
    curves = [[(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in read_metrics(tmp_path / run)]
              for run in ("whole", "resumed")]
    assert curves[1] == curves[0]  # iterations 1-2 from before the stop, 3-4 from the rerun


@pytest.mark.slow
def test_a_longer_rerun_follows_its_own_schedule_from_its_first_step(workspace, tmp_path):
    """Stopped after iteration 2 of 4, rerun with train.iters=6 and another peak lr: from iteration 3
    on, the lr is the rerun's schedule's (the loaded state held the first run's peak and last lr). The
    rerun of a plan that recorded neither its base model nor its data records them."""
    output, rerun = tmp_path / "longer", ["train.iters=6", "train.lr=1e-3"]
    adapt_in_ranks(workspace, f"output_dir={output}", "checkpoint.exit_interval=2")
    plan_file = output / "adaptation.json"
    plan = json.loads(plan_file.read_text())
    # as a plan from before plans recorded the base model and the data
    fingerprint, data = plan.pop("base_model"), plan.pop("data")
    plan_file.write_text(json.dumps(plan))
    longer = adapt_in_ranks(workspace, f"output_dir={output}", *rerun)
    recorded = json.loads(plan_file.read_text())
    assert (recorded["base_model"], recorded["data"]) == (fingerprint, data)  # recorded by the rerun
    first, train = (load_finetune_config(str(workspace / "adapt.yaml"), overrides).train for overrides in ([], rerun))
    warmup = round(train.warmup_ratio * train.iters)
    expected = [train.lr * lr_multiplier(step, warmup, train.iters, train.min_lr_ratio) for step in range(2, 6)]
    assert [r["lr"] for r in read_metrics(output)][2:] == pytest.approx(expected)
    was = first.lr * lr_multiplier(2, round(first.warmup_ratio * first.iters), first.iters, first.min_lr_ratio)
    assert f"update 3 takes lr {expected[0]:.4g}, where the checkpoint's schedule had {was:.4g}" in longer.stdout
    recorded.pop("data")  # a plan from the versions that recorded the base model alone
    plan_file.write_text(json.dumps(recorded))
    # nothing left to train, the plan read all the same; its own schedule goes on unsaid
    assert "the lr schedule differs" not in adapt_in_ranks(workspace, f"output_dir={output}", *rerun).stdout
    assert json.loads(plan_file.read_text())["data"] == data


@pytest.mark.slow
def test_bf16_with_fp32_gradient_accumulation_resumes_exactly(workspace):
    """ZeRO-1 in bf16 with the shipped fp32 gradient accumulation (DeepSpeed's BF16 optimizer then,
    another code path than fp32's), stopped by its time budget after iteration 1 and rerun, against
    an uninterrupted run."""
    bf16 = (f"deepspeed={REPO / 'configs/deepspeed/zero1.json'}", "train.precision=bf16")
    adapt_in_ranks(workspace, *bf16, f"output_dir={workspace / 'bf16'}")
    resumed = workspace / "bf16-resumed"
    # a budget spent before the first iteration ends: stop after it, exit code 0
    stopped = adapt_in_ranks(workspace, *bf16, f"output_dir={resumed}", "checkpoint.exit_duration_minutes=1e-6")
    assert "stopped after iteration 1 (checkpoint.exit_duration_minutes)" in stopped.stdout + stopped.stderr
    adapt_in_ranks(workspace, *bf16, f"output_dir={resumed}")
    # checkpoints hold the trained parameters only: the frozen ones are the base model's
    saved = torch.load(next((resumed / "checkpoints").glob("iter_*/mp_rank_00_model_states.pt")),
                       weights_only=False)["module"]
    assert any(name.endswith("dex_weight") for name in saved) and "model.embed_tokens.weight" not in saved
    assert not any(".mlp." in name or "q_proj" in name for name in saved)
    keys = ("iteration", "lm_loss", "grad_norm")
    uninterrupted = [{k: r[k] for k in keys} for r in read_metrics(workspace / "bf16")]
    assert len(uninterrupted) == ITERS
    assert [{k: r[k] for k in keys} for r in read_metrics(resumed)] == uninterrupted


def finetuned_with_fp16_on_cpu(config: str, overrides: list[str]) -> int:
    """finetuned, with DeepSpeed's CPU accelerator taking fp16: it offers fp16 only where oneDNN has fp16 kernels,
    though torch computes fp16 on any CPU (slowly), so DeepSpeed's fp16 path runs here as on a GPU."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float32, torch.bfloat16, torch.float16]
    return finetuned(config, overrides)


@pytest.mark.slow
def test_fp16_adaptation_follows_the_fp32_one(workspace, tmp_path):
    """DeepSpeed's fp16 path (dynamic loss scale, fp32 master copies of the fp16 adapter weights and lambda_learn):
    each iteration's loss, gradient norm and learning rate those of fp32 to 1e-3, lambda(t) to a few roundings
    of fp16 (the module holds lambda_learn in fp16)."""
    fp32, fp16 = tmp_path / "fp32", tmp_path / "fp16"
    adapt_in_ranks(workspace, f"output_dir={fp32}")
    adapt_in_ranks(workspace, f"output_dir={fp16}", "train.precision=fp16", command=finetuned_with_fp16_on_cpu)
    reference, records = read_metrics(fp32), read_metrics(fp16)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference] == list(range(1, ITERS + 1))
    for record, expected in zip(records, reference):
        assert record["skipped_iterations"] == 0 and "skipped_loss" not in record
        for key in ("lm_loss", "grad_norm", "lr"):
            assert record[key] == pytest.approx(expected[key], rel=1e-3), (record["iteration"], key)
        fp16_roundoff = torch.finfo(torch.float16).eps / 2
        assert record["lambda"] == pytest.approx(expected["lambda"], rel=4 * fp16_roundoff), record["iteration"]


@pytest.mark.slow
def test_fp16_steps_its_loss_scaler_skips_are_counted_with_the_scale_and_across_a_resume(workspace, tmp_path):
    """A step whose fp16 gradients overflow is left out by DeepSpeed's loss scaler: it was logged as one that
    trained, with no loss scale and no count. From 2^40 every step overflows: lambda(t), which follows the updates
    applied, stays lambda(0) = 0; the count and the scale follow the steps, and a stopped and rerun run's the
    uninterrupted one's."""
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    ds["fp16"]["initial_scale_power"] = 40
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    fp16 = ("train.precision=fp16", f"deepspeed={tmp_path / 'ds.json'}")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    adapt_in_ranks(workspace, *fp16, f"output_dir={whole}", command=finetuned_with_fp16_on_cpu)
    records = read_metrics(whole)
    assert all(value == 0 for record in records for value in record["lambda"].values())
    assert [r["loss_scale_overflows"] for r in records] == [r["iteration"] for r in records] == [*range(1, ITERS + 1)]
    scales = [r["loss_scale"] for r in records]
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2 ** 40
    adapt_in_ranks(workspace, *fp16, f"output_dir={stopped}", "checkpoint.exit_interval=2",
                   command=finetuned_with_fp16_on_cpu)
    adapt_in_ranks(workspace, *fp16, f"output_dir={stopped}", command=finetuned_with_fp16_on_cpu)
    keys = ("iteration", "loss_scale", "loss_scale_overflows")
    assert [{k: r[k] for k in keys} for r in read_metrics(stopped)] == [{k: r[k] for k in keys} for r in records]


def fp16_outcome(rank: int, world_size: int, config: str, overrides: list[str], report: str) -> None:
    """finetuned_with_fp16_on_cpu in a spawned rank; what it returned or raised goes to `report`."""
    try:
        outcome = f"finished with exit code {finetuned_with_fp16_on_cpu(config, overrides)}"
    except MegadiffError as error:
        outcome = str(error)
    Path(report).write_text(outcome)


@pytest.mark.slow
def test_fp16_steps_skipped_under_a_static_loss_scale_are_bounded(workspace, tmp_path, monkeypatch):
    """A static loss scale (fp16.loss_scale in a user's DeepSpeed JSON) is never lowered and never stops the run:
    at 2^40 every step overflowed and was left out, and the run went on to its end, exporting its untrained model
    with exit code 0. Its skips now count against train.max_skipped_nan_iters, as bf16's and fp32's do."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    ds["fp16"]["loss_scale"] = 2 ** 40
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    output, report = tmp_path / "static", tmp_path / "outcome"
    run_ranks(1, fp16_outcome, str(workspace / "adapt.yaml"),
              ["train.precision=fp16", f"deepspeed={tmp_path / 'ds.json'}", f"output_dir={output}", "train.iters=6",
               "train.max_skipped_nan_iters=2", "checkpoint.save_interval=1"], str(report))
    assert report.read_text().startswith("iteration 3: 3 steps skipped for a non-finite loss or gradient")
    assert "lower fp16.loss_scale" in report.read_text()
    assert [r["skipped_iterations"] for r in read_metrics(output)] == [1, 2, 3]
    assert (output / "checkpoints" / "latest").read_text() == "iter_0000002" and not (output / "hf").exists()


@pytest.mark.slow
def test_a_rerun_with_the_lowered_static_loss_scale_trains_with_it(workspace, tmp_path, monkeypatch):
    """The cure the run above names: fp16.loss_scale lowered in the DeepSpeed JSON, the run resumed from its last
    checkpoint. DeepSpeed's ZeRO optimizers load the saving run's loss scaler with their state, so the rerun kept
    2^40 and stopped again at its first step. Reference: the scale this run's JSON sets."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    output, report = tmp_path / "static", tmp_path / "outcome"
    for scale in (2 ** 40, 2 ** 8):
        (tmp_path / "ds.json").write_text(json.dumps({**ds, "fp16": {**ds["fp16"], "loss_scale": scale}}))
        run_ranks(1, fp16_outcome, str(workspace / "adapt.yaml"),
                  ["train.precision=fp16", f"deepspeed={tmp_path / 'ds.json'}", f"output_dir={output}",
                   "train.iters=6", "train.max_skipped_nan_iters=2", "checkpoint.save_interval=1"], str(report))
    assert report.read_text() == "finished with exit code 0"
    resumed = [record for record in read_metrics(output) if record["iteration"] > 2]
    assert [r["loss_scale"] for r in resumed] == [2 ** 8] * 4
    assert [r["skipped_iterations"] for r in resumed] == [2] * 4


def optimizer_settings_seen(config: str, overrides: list[str], report: str) -> int:
    """finetuned's run; rank 0 records, as each iteration begins, the settings of the torch AdamW that steps
    (inside DeepSpeed's ZeRO optimizer) and the norm the ZeRO optimizer clips the gradients at."""
    from megadiff.adapt import finetune

    train_iteration, seen = finetune._train_iteration, {}

    def recorded(engine, reader, iteration, grad_accum):
        if int(os.environ["RANK"]) == 0:
            seen[iteration] = {"groups": [{key: group[key] for key in ("betas", "eps", "weight_decay")}
                                          for group in engine.optimizer.optimizer.param_groups],
                               "clip_grad": engine.optimizer.clip_grad}
            Path(report).write_text(json.dumps(seen))
        return train_iteration(engine, reader, iteration, grad_accum)

    with mock.patch.object(finetune, "_train_iteration", recorded):
        return finetuned(config, overrides)


@pytest.mark.parametrize("stage", [
    [f"deepspeed={REPO / 'configs/deepspeed/zero2.json'}"],
    # DeepSpeed's BF16 optimizer wraps the AdamW otherwise
    [f"deepspeed={REPO / 'configs/deepspeed/zero1.json'}", "train.precision=bf16"],
])
def test_a_rerun_trains_with_its_own_adam_settings_and_clipping(workspace, tmp_path, stage):
    """Stopped after iteration 2, rerun with other betas, eps, weight decay and gradient clipping: its steps use
    them (as its lr schedule follows its config), not the ones the loaded optimizer state was saved with."""
    output, report = tmp_path / "run", tmp_path / "seen.json"
    adapt_in_ranks(workspace, *stage, f"output_dir={output}", "checkpoint.exit_interval=2")
    rerun = [*stage, f"output_dir={output}", "train.weight_decay=0.05", "train.adam_betas=[0.8,0.9]",
             "train.adam_eps=1e-6", "train.grad_clip=0.25"]
    with mock.patch.dict(os.environ, _env(workspace)):
        run_reporting_ranks(2, optimizer_settings_seen, str(workspace / "adapt.yaml"), rerun, str(report),
                            timeout=400)
    train = load_finetune_config(str(workspace / "adapt.yaml"), rerun).train
    assert train.grad_clip != load_finetune_config(str(workspace / "adapt.yaml"), []).train.grad_clip
    expected = {"betas": list(train.adam_betas), "eps": train.adam_eps, "weight_decay": train.weight_decay}
    seen = json.loads(report.read_text())
    assert sorted(seen) == [str(iteration) for iteration in range(3, ITERS + 1)]
    assert all(step["groups"] == [expected] * len(step["groups"]) for step in seen.values())
    assert all(step["clip_grad"] == train.grad_clip for step in seen.values())


def _llama_with_attention_biases(workspace: Path, directory: Path) -> None:
    """The workspace's tiny Llama with q/k/v/o biases, drawn non-zero (decay moves no zero)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(workspace / "model")
    config.attention_bias = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(workspace / "model").save_pretrained(directory)


def test_weight_decay_leaves_biases_and_norm_weights_alone(workspace, tmp_path):
    """AdamW as the DAA paper's Hugging Face Trainer runs it: biases and norm weights are never decayed, every
    other trained tensor is. One step of everything trained, with and without weight decay: both start from the
    same weights and gradients, so decoupled decay alone tells the two apart (p -= lr wd p, before Adam's step)."""
    from safetensors.torch import load_file

    model = tmp_path / "biased"
    _llama_with_attention_biases(workspace, model)
    exported = {}
    for decay in (0.0, 0.5):
        output = tmp_path / f"decay-{decay}"
        adapt_in_ranks(workspace, f"model.path={model}", f"output_dir={output}", 'adaptation.trainable=["*"]',
                       "train.iters=1", "train.warmup_ratio=0", f"train.weight_decay={decay}")
        exported[decay] = load_file(output / "hf" / "model.safetensors")
    undecayed = [name for name in exported[0.0] if name.endswith("bias") or "norm" in name]
    assert any("self_attn.k_proj.bias" in name for name in undecayed)
    assert any("layernorm" in name for name in undecayed)
    for name, tensor in exported[0.0].items():
        if name in undecayed:
            torch.testing.assert_close(exported[0.5][name], tensor, rtol=0, atol=0, msg=name)
        elif tensor.dim() == 2:  # lambda_learn starts at 0, which decay leaves
            assert not torch.equal(exported[0.5][name], tensor), name


def counted_adaptation(rank: int, world_size: int, config: str, overrides: list[str], report: str) -> None:
    """`megadiff adapt` in a spawned rank, recording the mode of each forward of a decoder layer's MLP
    (the layer's own forward is transformers' checkpointing wrapper): [training, grad enabled]."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from megadiff.adapt.finetune import finetune

    forwards, original = [], LlamaMLP.forward

    def forward(self, *args, **kwargs):
        forwards.append([self.training, torch.is_grad_enabled()])
        return original(self, *args, **kwargs)

    LlamaMLP.forward = forward
    assert finetune(load_finetune_config(config, overrides)) == 0
    Path(report).write_text(json.dumps(forwards))


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_each_layer_in_training_mode(workspace, tmp_path, monkeypatch):
    """Training forwards run in training mode (from_pretrained leaves the model in eval mode, in which
    dropout and gradient checkpointing do nothing); with train.gradient_checkpointing every decoder
    layer runs again in the backward, and the losses and gradient norms stay the same."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    iters, grad_accum, layers = 2, 2, 2
    forwards, curves = {}, {}
    for checkpointing in ("false", "true"):
        output, report = tmp_path / f"checkpointing-{checkpointing}", tmp_path / f"forwards-{checkpointing}.json"
        run_ranks(1, counted_adaptation, str(workspace / "adapt.yaml"),
                  [f"output_dir={output}", f"train.iters={iters}", f"train.grad_accum={grad_accum}",
                   f"train.gradient_checkpointing={checkpointing}"], str(report))
        forwards[checkpointing] = json.loads(report.read_text())
        curves[checkpointing] = [r[key] for r in read_metrics(output) for key in ("lm_loss", "grad_norm")]
    for checkpointing, recomputed in (("false", 1), ("true", 2)):
        training = [f for f in forwards[checkpointing] if f[1]]
        assert training == [[True, True]] * (iters * grad_accum * layers * recomputed)
        assert all(not mode for mode, _ in forwards[checkpointing] if mode is not True)  # head selection's
    assert curves["true"] == pytest.approx(curves["false"], rel=1e-6)


def slow_second_rank_save(rank: int, world_size: int, config: str, overrides: list[str], report: str) -> None:
    """`megadiff adapt` on 2 ranks whose second writes its part of each checkpoint slowly, recording
    the name it writes under, what `latest` named meanwhile and whether the checkpoint's own name was
    taken yet (a kill then would leave that)."""
    import time

    from deepspeed.runtime.engine import DeepSpeedEngine

    from megadiff.adapt.finetune import finetune

    seen, original = [], DeepSpeedEngine._save_zero_checkpoint

    def save_zero_checkpoint(self, save_dir, tag):
        if rank == 1:
            time.sleep(2.0)
            latest = Path(save_dir) / "latest"
            named = (Path(save_dir) / tag.removesuffix(".partial")).exists()
            seen.append([tag, latest.read_text() if latest.is_file() else None, named])
        return original(self, save_dir, tag)

    DeepSpeedEngine._save_zero_checkpoint = save_zero_checkpoint
    assert finetune(load_finetune_config(config, overrides)) == 0
    if rank == 1:
        Path(report).write_text(json.dumps(seen))


@pytest.mark.slow
def test_latest_names_a_checkpoint_only_once_every_rank_wrote_it(workspace, tmp_path, monkeypatch):
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    output, report = tmp_path / "slow", tmp_path / "seen.json"
    run_ranks(2, slow_second_rank_save, str(workspace / "adapt.yaml"),
              [f"output_dir={output}", "train.iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last=1"],
              str(report))
    # written under a staging name: a save killed then leaves no checkpoint's name for keep_last to count
    assert json.loads(report.read_text()) == [["iter_0000002.partial", None, False],
                                              ["iter_0000004.partial", "iter_0000002", False]]
    assert (output / "checkpoints" / "latest").read_text() == "iter_0000004"
    # checkpoint.keep_last: the older one removed once the newer one is committed
    assert sorted(p.name for p in (output / "checkpoints").iterdir() if p.is_dir()) == ["iter_0000004"]


def signalled_while_starting(rank: int, world_size: int, config: str, overrides: list[str], report: str) -> None:
    """`megadiff adapt` whose rank gets SIGUSR1 as its process group comes up, before the model loads."""
    import signal

    from megadiff.adapt import deepspeed_setup
    from megadiff.adapt.finetune import finetune

    original = deepspeed_setup.init_distributed

    def init_distributed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return original(*args, **kwargs)

    deepspeed_setup.init_distributed = init_distributed
    Path(report).write_text(str(finetune(load_finetune_config(config, overrides))))


def test_a_signal_while_the_adaptation_starts_requeues_it(workspace, tmp_path, monkeypatch):
    """The default action killed the rank (and failed the job): the run takes its first iteration,
    checkpoints it and exits 75; its W&B run ends as finished (exit code 0), not failed: the requeue resumes it."""
    output = tmp_path / "started"
    assert adapt_in_a_rank(workspace, monkeypatch, signalled_while_starting, output, tmp_path / "exit_code") == "75"
    assert (output / "checkpoints" / "latest").read_text() == "iter_0000001"
    assert exit_codes(wandb_runs(output)) == [0]


def failing_at_the_second_iteration(rank: int, world_size: int, config: str, overrides: list[str],
                                    report: str) -> None:
    """`megadiff adapt` in a spawned rank whose second iteration raises; reports what it raised."""
    from megadiff.adapt import finetune as module

    original = module._train_iteration

    def train_iteration(engine, reader, iteration, grad_accum):
        if iteration == 2:
            raise RuntimeError("a failing step")
        return original(engine, reader, iteration, grad_accum)

    module._train_iteration = train_iteration
    try:
        module.finetune(load_finetune_config(config, overrides))
    except RuntimeError as error:
        Path(report).write_text(str(error))


def test_a_failing_step_leaves_no_empty_stalls_file_and_fails_the_wandb_run(workspace, tmp_path, monkeypatch):
    """The watchdog's file (one a rank, filled only by a stalled step) was removed at a normal end only: an
    error left every rank's empty file behind, which reads as a stall that was not. W&B shows the run failed
    (exit code 1), not finished."""
    output = tmp_path / "failed"
    assert adapt_in_a_rank(workspace, monkeypatch, failing_at_the_second_iteration, output, tmp_path / "raised",
                           "logging.log_interval=1") == "a failing step"
    assert [r["iteration"] for r in read_metrics(output)] == [1]  # the metrics written before the error
    assert not (output / "stalls").exists()
    assert exit_codes(wandb_runs(output)) == [1]


def poisoned_at(rank: int, world_size: int, config: str, overrides: list[str], poisoned: list[int],
                report: str) -> None:
    """`megadiff adapt` in spawned ranks whose last rank's logits are NaN at the `poisoned` iterations (its loss
    and gradients, and so the global batch's); each rank writes what the run raised to `report`.RANK."""
    from megadiff.adapt import finetune as module
    from megadiff.errors import MegadiffError

    _poison_iterations(module, rank == world_size - 1, poisoned)
    try:
        outcome = f"finished with exit code {module.finetune(load_finetune_config(config, overrides))}"
    except MegadiffError as error:
        outcome = str(error)
    Path(f"{report}.{rank}").write_text(outcome)


def _poison_iterations(module, poisons: bool, poisoned: list[int], on_iteration=None) -> None:
    """Makes finetune `module`'s iterations in `poisoned` compute NaN logits where `poisons` (on this rank); each
    iteration's engine and outcome go to on_iteration(engine, Iteration) where given."""
    original = module._train_iteration

    def train_iteration(engine, reader, iteration, grad_accum):
        hook = engine.module.lm_head.register_forward_hook(lambda _module, _inputs, logits: logits * math.nan) \
            if poisons and iteration in poisoned else None
        try:
            outcome = original(engine, reader, iteration, grad_accum)
        finally:
            if hook is not None:
                hook.remove()
        if on_iteration is not None:
            on_iteration(engine, outcome)
        return outcome

    module._train_iteration = train_iteration


def annealing_steps_and_lrs(rank: int, world_size: int, config: str, overrides: list[str], poisoned: list[int],
                            report: str) -> None:
    """`megadiff adapt` in one spawned rank, NaN at the `poisoned` iterations; writes each iteration's lambda(t)
    step t and the lr it used to `report` (JSON)."""
    from megadiff.adapt import finetune as module
    from megadiff.adapt.apply import adapted_modules

    seen = []
    _poison_iterations(module, True, poisoned,
                       lambda engine, outcome: seen.append((adapted_modules(engine.module)[0].step, outcome.lr)))
    module.finetune(load_finetune_config(config, overrides))
    Path(report).write_text(json.dumps(seen))


def test_lambda_s_annealing_follows_the_applied_updates_as_the_lr_schedule_does(workspace, tmp_path, monkeypatch):
    """A step DeepSpeed skipped (here a NaN loss) trained nothing and leaves the lr schedule where it was: it
    moved lambda(t) on all the same. Each step's t is now the schedule's step, whose lr the update used (the
    reference: the schedule's own multiplier), the same in a run resumed after the skipped step."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    cfg = load_finetune_config(workspace / "adapt.yaml")
    warmup = round(cfg.train.warmup_ratio * cfg.train.iters)
    seen = {}
    for run, stops in (("whole", []), ("resumed", ["checkpoint.exit_interval=2"])):
        report, steps = tmp_path / run, []
        for _ in range(1 + len(stops)):  # a stopped run: the same command again resumes it
            run_ranks(1, annealing_steps_and_lrs, str(workspace / "adapt.yaml"),
                      [f"output_dir={tmp_path / f'{run}-run'}", *stops], [2], str(report))
            steps += json.loads(report.read_text())
        seen[run] = steps
    assert seen["resumed"] == seen["whole"] and len(seen["whole"]) == ITERS
    assert [t for t, _ in seen["whole"]] == [0, 1, 1, 2]  # iteration 2's update skipped
    assert [lr for _, lr in seen["whole"]] == pytest.approx(
        [cfg.train.lr * lr_multiplier(t, warmup, cfg.train.iters, cfg.train.min_lr_ratio) for t, _ in seen["whole"]])


def _trained_weights(output: Path, iteration: int) -> dict:
    states = torch.load(output / "checkpoints" / f"iter_{iteration:07d}" / "mp_rank_00_model_states.pt",
                        weights_only=False)
    return states["module"]


def test_non_finite_steps_are_counted_and_stop_every_rank_before_a_save(workspace, tmp_path, monkeypatch):
    """DeepSpeed leaves out the update of a step whose gradient norm is not finite, silently: a run whose
    every step was NaN went on to its end, kept saving, and exported its untrained model with exit code 0.
    Now, as in pretraining, the skips are counted (checkpoints carry the count) and one more than
    train.max_skipped_nan_iters stops every rank at the same step, before it saves: one rank of two poisoned."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    output, report = tmp_path / "poisoned", tmp_path / "raised"
    overrides = [f"output_dir={output}", "train.iters=6", "checkpoint.save_interval=1", "logging.log_interval=1"]
    run_ranks(2, poisoned_at, str(workspace / "adapt.yaml"), overrides + ["train.max_skipped_nan_iters=1"],
              list(range(2, 7)), str(report))
    outcomes = {Path(f"{report}.{rank}").read_text() for rank in range(2)}
    assert len(outcomes) == 1
    said = outcomes.pop()
    # the rank whose own loss was NaN is named, with its host: every rank's loss is the global batch's
    assert said.startswith("iteration 3: 2 steps skipped for a non-finite loss")
    assert f"loss nan (not finite on rank 1 ({socket.gethostname()}))" in said and "rank 0 (" not in said
    assert [r["skipped_iterations"] for r in read_metrics(output)] == [0, 1, 2]
    assert (output / "checkpoints" / "latest").read_text() == "iter_0000002" and not (output / "hf").exists()
    before, skipped = _trained_weights(output, 1), _trained_weights(output, 2)
    assert before.keys() == skipped.keys() and all(torch.equal(before[k], skipped[k]) for k in before)
    # resumed from iteration 2 (one skip) with a bound of 2: iterations 3 and 4 make three
    run_ranks(2, poisoned_at, str(workspace / "adapt.yaml"), overrides + ["train.max_skipped_nan_iters=2"],
              list(range(3, 7)), str(report))
    assert Path(f"{report}.0").read_text().startswith("iteration 4: 3 steps skipped")
    assert (output / "checkpoints" / "latest").read_text() == "iter_0000003"


def test_keep_last_keeps_the_last_checkpoint_before_a_streak_of_skipped_steps(workspace, tmp_path, monkeypatch):
    """NaN from iteration 3 on, a checkpoint at every iteration, keep_last=2: the saves of the skipped steps
    (their weights the second's again) rotated every checkpoint before the streak away. The last one before it
    is kept, and a rerun from it with the poison gone records the uninterrupted run's losses."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    output, report, first_poisoned = tmp_path / "blown", tmp_path / "raised", 3
    overrides = [f"output_dir={output}", "train.iters=6", "checkpoint.save_interval=1", "checkpoint.keep_last=2"]
    run_ranks(1, poisoned_at, str(workspace / "adapt.yaml"), overrides + ["train.max_skipped_nan_iters=2"],
              list(range(first_poisoned, 7)), str(report))
    stopped = int(Path(f"{report}.0").read_text().split(":")[0].removeprefix("iteration "))
    saved = list(range(1, stopped))  # the stopping step saves nothing
    expected = sorted({*saved[-2:], max(i for i in saved if i < first_poisoned)})
    checkpoints = output / "checkpoints"
    assert sorted(int(p.name.removeprefix("iter_")) for p in checkpoints.glob("iter_*")) == expected
    (checkpoints / "latest").write_text(iteration_dir(checkpoints, first_poisoned - 1).name)
    run_ranks(1, poisoned_at, str(workspace / "adapt.yaml"), overrides, [], str(report))
    reference = tmp_path / "reference"
    run_ranks(1, poisoned_at, str(workspace / "adapt.yaml"), [f"output_dir={reference}", *overrides[1:]], [],
              str(report))
    assert [r["lm_loss"] for r in read_metrics(output)] == [r["lm_loss"] for r in read_metrics(reference)]


def _metrics_logged_every_1_and_2(workspace, tmp_path, monkeypatch, target, overrides: list[str],
                                  steps: list[int]) -> dict[int, list[dict]]:
    """The metrics of one adaptation in a spawned rank (`target`, altered at `steps`), recorded every iteration
    (the reference) and every 2, by interval; the runs' outputs are tmp_path/every1 and every2."""
    for name, value in _env(workspace).items():
        monkeypatch.setenv(name, value)
    records = {}
    for interval in (1, 2):
        output = tmp_path / f"every{interval}"
        run_ranks(1, target, str(workspace / "adapt.yaml"),
                  [f"output_dir={output}", f"logging.log_interval={interval}", *overrides], steps,
                  str(tmp_path / "report"))
        records[interval] = read_metrics(output)
    return records


def test_a_skipped_step_leaves_the_means_of_its_interval_finite(workspace, tmp_path, monkeypatch):
    """Recorded every 2 iterations, the NaN of iteration 2 (skipped by DeepSpeed) made the mean loss of
    iterations 1-2 NaN, hiding iteration 1's. As in pre-training, the record holds the updating steps' mean
    and the skipped step's own loss as skipped_loss; the reference is the same run recorded every iteration."""
    records = _metrics_logged_every_1_and_2(workspace, tmp_path, monkeypatch, poisoned_at, [], [2])
    each = [r["lm_loss"] for r in records[1]]
    assert math.isnan(each[1]) and [r["skipped_iterations"] for r in records[1]] == [0, 1, 1, 1]
    assert [r["iteration"] for r in records[2]] == [2, 4]
    assert [r["lm_loss"] for r in records[2]] == pytest.approx([each[0], (each[2] + each[3]) / 2], rel=1e-6)
    assert math.isnan(records[2][0]["skipped_loss"]) and "skipped_loss" not in records[2][1]


def adapted_with_targets_cut_at(rank: int, world_size: int, config: str, overrides: list[str], cut: list[int],
                                report: str) -> None:
    """`megadiff adapt` in spawned ranks whose global batches at the `cut` iterations (1-based) hold no targets,
    as chat data whose assistant turns were all cut."""
    from megadiff.adapt.data import IGNORED_LABEL, BatchReader

    read = BatchReader.micro_batch_at

    def micro_batch_at(reader, iteration, micro_step):
        input_ids, labels = read(reader, iteration, micro_step)
        return input_ids, torch.full_like(labels, IGNORED_LABEL) if iteration + 1 in cut else labels

    BatchReader.micro_batch_at = micro_batch_at
    Path(f"{report}.{rank}").write_text(str(finetuned(config, overrides)))


def test_a_global_batch_without_targets_has_no_loss_and_is_not_trained_on(workspace, tmp_path, monkeypatch):
    """Its loss was 0.0 (the target count clamped to one), recorded and averaged into its interval's mean, and
    DeepSpeed's step moved the weights on its zero gradients (Adam's moments). Now it records no loss, the means
    are the other steps' (the reference: the same run recorded every iteration) and the weights stay."""
    records = _metrics_logged_every_1_and_2(workspace, tmp_path, monkeypatch, adapted_with_targets_cut_at,
                                            ["checkpoint.save_interval=1"], [2])
    each = records[1]
    assert "lm_loss" not in each[1] and each[1]["no_loss_tokens"] is True
    assert all("lm_loss" in record and "no_loss_tokens" not in record for record in each[:1] + each[2:])
    assert [r["skipped_iterations"] for r in each] == [0] * ITERS
    assert [r["lm_loss"] for r in records[2]] == pytest.approx(
        [each[0]["lm_loss"], (each[2]["lm_loss"] + each[3]["lm_loss"]) / 2], rel=1e-6)
    before, untrained = _trained_weights(tmp_path / "every1", 1), _trained_weights(tmp_path / "every1", 2)
    assert all(torch.equal(before[k], untrained[k]) for k in before)


def failing_as_deepspeed_starts(rank: int, world_size: int, config: str, overrides: list[str], report: str) -> None:
    """`megadiff adapt` in a spawned rank whose deepspeed.initialize raises; reports what it raised."""
    import deepspeed

    from megadiff.adapt.finetune import finetune

    def initialize(*args, **kwargs):
        raise RuntimeError("DeepSpeed failed to start")

    deepspeed.initialize = initialize
    try:
        finetune(load_finetune_config(config, overrides))
    except RuntimeError as error:
        Path(report).write_text(str(error))


def test_a_run_failing_before_its_first_step_fails_its_wandb_run(workspace, tmp_path, monkeypatch):
    """The W&B run starts before the model loads (a login or project problem stops the run at once): an error in
    the minutes between (the model, head selection, DeepSpeed, the checkpoint) left it unfinished, never failed."""
    output = tmp_path / "failed"
    assert adapt_in_a_rank(workspace, monkeypatch, failing_as_deepspeed_starts, output,
                           tmp_path / "raised") == "DeepSpeed failed to start"
    assert exit_codes(wandb_runs(output)) == [1]
    assert not (output / "stalls").exists()


def test_an_adaptation_s_config_read_from_elsewhere_names_the_files_it_named(workspace, tmp_path, monkeypatch):
    """Its config.yaml, passed back from another working directory (a Slurm job submitted elsewhere), read the
    relative model.path and data.files from there: refused, or other files, as pre-training's once did."""
    monkeypatch.chdir(workspace)
    output = tmp_path / "run"
    adapt_in_a_rank(workspace, monkeypatch, failing_as_deepspeed_starts, output, tmp_path / "raised",
                    "model.path=model", "data.files=[train.jsonl]")
    monkeypatch.chdir(tmp_path)
    cfg = load_finetune_config(output / "config.yaml")
    assert (cfg.model.path, cfg.data.files) == (str(workspace / "model"), [str(workspace / "train.jsonl")])


@pytest.mark.slow
def test_sigusr1_checkpoints_and_exits_for_requeue(workspace):
    """One plain process (world of one): SIGUSR1 mid-run -> checkpoint at the iteration it was in,
    exit code 75 (slurm/job.sh requeues on it), and a rerun would resume from there."""
    import signal
    import time

    output = workspace / "preempted"
    process = subprocess.Popen([sys.executable, "-m", "megadiff", "adapt", str(workspace / "adapt.yaml"),
                                f"output_dir={output}", "train.iters=100000", "checkpoint.save_interval=100000"],
                               env=_env(workspace), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    deadline = time.time() + 300
    while not ((output / "metrics.jsonl").is_file() and read_metrics(output)) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    log, _ = process.communicate(timeout=300)
    assert process.returncode == 75, log[-3000:]
    stopped_at = read_metrics(output)[-1]["iteration"]
    assert f"stopped after iteration {stopped_at} (SIGUSR1)" in log
    assert (output / "checkpoints" / "latest").read_text().strip() == f"iter_{stopped_at:07d}"
    assert not (output / "hf").exists()


def test_directories_of_the_users_are_refused_as_output_or_export(workspace, tmp_path):
    """An export replaces its directory whole: at output_dir it deleted the run, at model.path the base model.
    And a run took over an output_dir holding another (a pre-training run's metrics and config overwritten)."""
    yaml_file, model = str(workspace / "adapt.yaml"), workspace / "model"
    run = tmp_path / "run"
    for export, said in ((run, "output_dir"), (tmp_path, "output_dir"), (model, "model.path")):
        with pytest.raises(ConfigError, match=f"export_dir: .* is or holds {said}"):
            load_finetune_config(yaml_file, [f"output_dir={run}", f"export_dir={export}"])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="export_dir: .*notes holds files that are not an earlier export"):
        load_finetune_config(yaml_file, [f"output_dir={run}", f"export_dir={tmp_path / 'notes'}"])
    pretraining = tmp_path / "pretraining"
    (pretraining / "checkpoints").mkdir(parents=True)
    (pretraining / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="output_dir: .*pretraining holds another run"):
        load_finetune_config(yaml_file, [f"output_dir={pretraining}"])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="output_dir: .*a-file is a file"):
        load_finetune_config(yaml_file, [f"output_dir={tmp_path / 'a-file'}"])
    with pytest.raises(ConfigError, match="export_dir: .*a-file is a file"):  # found by the export, at the end
        load_finetune_config(yaml_file, [f"output_dir={run}", f"export_dir={tmp_path / 'a-file'}"])
    assert load_finetune_config(yaml_file, [f"output_dir={run}"]).resolved_export_dir == run / "hf"


def _sharded_without_its_second_shard(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(model / "model.safetensors"))
    names = sorted(state)
    save_file({name: state[name] for name in names[:1]}, str(model / "shard-1.safetensors"))
    (model / "model.safetensors").unlink()
    weight_map = {name: "shard-1.safetensors" if i == 0 else "shard-2.safetensors" for i, name in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("damage, said", [
    (lambda model: (model / "config.json").write_text("{"), r"config.json is not JSON"),
    (lambda model: (model / "config.json").write_text(json.dumps(
        {key: value for key, value in json.loads((model / "config.json").read_text()).items()
         if key != "num_hidden_layers"})), "config.json gives no num_hidden_layers"),
    (lambda model: (model / "model.safetensors").unlink(), r"holds no weights"),
    (lambda model: (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:4096]),
     r"model.safetensors cannot be read \(.*cut short"),
    (lambda model: _sharded_without_its_second_shard(model), r"model.safetensors.index.json names shard-2"),
], ids=["config not JSON", "config without layers", "no weights", "weights cut short", "a shard missing"])
def test_a_damaged_model_is_refused_before_any_work(workspace, tmp_path, damage, said):
    """Found by transformers after the data was tokenized (a traceback), or as a KeyError."""
    model = tmp_path / "model"
    shutil.copytree(workspace / "model", model)
    damage(model)
    with pytest.raises(ConfigError, match=f"model.path: .*{said}"):
        load_finetune_config(str(workspace / "adapt.yaml"), [f"model.path={model}", "adaptation.selected_heads=[[0]]"])


@pytest.mark.usefixtures("refused_before_running")
def test_config_errors_name_their_key(workspace, tmp_path):
    yaml_file = str(workspace / "adapt.yaml")
    with pytest.raises(ConfigError, match="model.attn_implementation: .*unknown attention implementation 'garbage'"):
        load_finetune_config(yaml_file, ["model.attn_implementation=garbage"])
    for known in ("eager", "sdpa", "kernels-community/flash-attn"):
        assert load_finetune_config(yaml_file, [f"model.attn_implementation={known}"]).model.attn_implementation \
            == known
    with pytest.raises(ConfigError, match=r"data.files\[0\]: .*missing.jsonl does not exist"):
        load_finetune_config(yaml_file, [f"data.files=[{tmp_path / 'missing.jsonl'}]"])
    with pytest.raises(ConfigError, match=r"data.files\[0\]: .* is a directory; name its files \(.txt"):
        load_finetune_config(yaml_file, [f"data.files=[{tmp_path}]"])
    with pytest.raises(ConfigError, match="train.lr_max: unknown key"):
        load_finetune_config(yaml_file, ["train.lr_max=1"])
    with pytest.raises(ConfigError, match="train.lr: Input should be a finite number"):
        load_finetune_config(yaml_file, ["train.lr=.inf"])
    with pytest.raises(ConfigError, match="train.iters: a number is expected, not true or false"):
        load_finetune_config(yaml_file, ["train.iters=true"])
    with pytest.raises(ConfigError, match="adaptation.lambda_learn_init: a number is expected, not true or false"):
        load_finetune_config(yaml_file, ["adaptation.lambda_learn_init=false"])
    with pytest.raises(ConfigError, match="adaptation.selection"):
        load_finetune_config(yaml_file, ["adaptation.method=diff_v", "adaptation.selection=entropy"])
    # a share of the heads where every head, or the given ones, are adapted: it was ignored without a word
    for overrides in (["adaptation.method=daa"], ["adaptation.selected_heads=[[0],[1]]"]):
        with pytest.raises(ConfigError, match="adaptation: .*heads_fraction=0.25 takes a share of the heads"):
            load_finetune_config(yaml_file, [*overrides, "adaptation.heads_fraction=0.25"])
    ranked = load_finetune_config(yaml_file, ["adaptation.method=daa", "adaptation.selection=importance",
                                              "adaptation.heads_fraction=0.25"]).adaptation
    assert ranked.resolved_selection == "importance" and ranked.heads_fraction == 0.25
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model.path: model_type 'gpt2' is not supported"):
        load_finetune_config(yaml_file, [f"model.path={gpt2}"])
    with pytest.raises(ConfigError, match=r"adaptation.selected_heads\[0\]"):
        load_finetune_config(yaml_file, ["adaptation.selected_heads=[[7],[0]]"])
    conflicting = tmp_path / "ds.json"
    conflicting.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                       "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}))
    cfg = load_finetune_config(yaml_file, [f"deepspeed={conflicting}"])
    with pytest.raises(ConfigError, match="optimizer.params.lr"):
        deepspeed_config(cfg, world_size=2)
    for without_zero in ({"zero_optimization": {"stage": 0}}, {}):  # trained, but with a grad_norm of NaN
        conflicting.write_text(json.dumps(without_zero))
        with pytest.raises(ConfigError, match="zero_optimization.stage must be 1, 2 or 3, not 0"):
            load_finetune_config(yaml_file, [f"deepspeed={conflicting}"])
    for not_an_object in ([1, 2], {"zero_optimization": [2]}):  # an AttributeError
        conflicting.write_text(json.dumps(not_an_object))
        with pytest.raises(ConfigError, match="ds.json: expected an object with a zero_optimization object"):
            load_finetune_config(yaml_file, [f"deepspeed={conflicting}"])
    # DeepSpeed asserted on these after the model had loaded; SGD has no betas to fill
    for optimizer, refusal in (({"type": "SGD"}, "optimizer.type 'SGD': adaptation trains with Adam or AdamW"),
                               ({"params": {}}, "optimizer.type None: adaptation trains with Adam or AdamW"),
                               ({"type": "adamw", "params": [1]}, "optimizer must be an object with a params object")):
        conflicting.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": optimizer}))
        with pytest.raises(ConfigError, match=refusal):
            load_finetune_config(yaml_file, [f"deepspeed={conflicting}"])
    conflicting.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}))
    assert load_finetune_config(yaml_file, [f"deepspeed={conflicting}"]).deepspeed == str(conflicting)
    # the tiny base model's context is 128 positions
    assert load_finetune_config(yaml_file, ["data.seq_length=128"]).data.seq_length == 128
    with pytest.raises(ConfigError, match=r"data.seq_length: 129 is past the base model's context \(128, "
                                          "max_position_embeddings in .*config.json\)"):
        load_finetune_config(yaml_file, ["data.seq_length=129"])
    from megadiff.cli import main

    assert main(["adapt", yaml_file, f"data.files=[{tmp_path / 'missing.jsonl'}]"]) == 2
    text = tmp_path / "kjv.txt"
    text.write_text("In the beginning")
    with pytest.raises(ConfigError, match=r"data.files\[0\]: .* reads JSON records"):
        load_finetune_config(yaml_file, [f"data.files=[{text}]", "data.messages_key=messages"])
    with pytest.raises(ConfigError, match="data.chat_template: only used with data.messages_key"):
        load_finetune_config(yaml_file, [f"data.chat_template={CHATML}"])


def _write_conversations(workspace: Path) -> Path:
    """KJV verses as two-turn chats, in ShareGPT's form (the Dex paper's OpenHermes-2.5)."""
    path = workspace / "chats.jsonl"
    if not path.exists():
        verses = [json.loads(line)["text"] for line in (workspace / "train.jsonl").read_text().splitlines()]
        verses = [verse for document in verses for verse in document.split("\n")]
        chats = [[{"from": "human", "value": verses[i]}, {"from": "gpt", "value": verses[i + 1]},
                  {"from": "human", "value": verses[i + 2]}, {"from": "gpt", "value": verses[i + 3]}]
                 for i in range(0, 800, 4)]
        path.write_text("".join(json.dumps({"conversations": chat}) + "\n" for chat in chats))
    return path


def _chat_overrides(workspace: Path) -> list[str]:
    return [f"data.files=[{_write_conversations(workspace)}]", "data.messages_key=conversations",
            f"data.chat_template={CHATML}"]


def test_conversations_label_the_assistant_turns_only(workspace, tmp_path, monkeypatch):
    """Packed rows keep the loss on what the assistant writes (and each chat's EOS); the labels of
    a micro-batch are its ids there and -100 elsewhere."""
    from transformers import AutoTokenizer

    from megadiff.adapt.data import BatchReader, build_packed_dataset

    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), _chat_overrides(workspace) + [
        f"data.cache_dir={tmp_path}"])
    dataset = build_packed_dataset(cfg.data, tokenizer)
    ids, mask = dataset[:]["input_ids"].flatten(), dataset[:]["loss_mask"].flatten().bool()
    chats = [json.loads(line)["conversations"] for line in _write_conversations(workspace).read_text().splitlines()]
    assistant = "".join("".join(f"{turn['value']}<|im_end|>\n" for turn in chat if turn["from"] == "gpt") + "<eos>"
                        for chat in chats)
    kept = tokenizer.decode(ids[mask].tolist())
    assert len(kept) > len(assistant) / 2 and assistant.startswith(kept)  # the packed rows drop a tail
    reader = BatchReader(dataset, seed=1, micro_batch=3, grad_accum=1, rank=0, world=1)
    input_ids, labels = reader.micro_batch_at(0, 0)
    rows = [dataset[reader.order.row(j)] for j in range(3)]
    assert torch.equal(input_ids, torch.stack([row["input_ids"] for row in rows]))
    expected = torch.stack([torch.where(row["loss_mask"].bool(), row["input_ids"], -100) for row in rows])
    assert torch.equal(labels, expected) and (labels == -100).any() and (labels != -100).any()
    ends_with_eos = tmp_path / "eos.jinja"
    ends_with_eos.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}")
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), _chat_overrides(workspace) + [
        f"data.chat_template={ends_with_eos}", "data.document_masking=true"])
    with pytest.raises(ConfigError, match="data.document_masking: .* would cut each conversation at every turn"):
        build_packed_dataset(cfg.data, tokenizer)
    untemplated = load_finetune_config(str(workspace / "adapt.yaml"), _chat_overrides(workspace)[:2])
    with pytest.raises(ConfigError, match="data.messages_key: tokenizer .* has no chat template"):
        build_packed_dataset(untemplated.data, tokenizer)
    # the adaptation refuses them before it loads the model
    from megadiff.adapt import finetune

    monkeypatch.setattr(finetune, "_load_model", lambda *args: pytest.fail("the model was loaded before the data"))
    with pytest.raises(ConfigError, match="data.messages_key: tokenizer .* has no chat template"):
        finetune._prepare(untemplated, {}, rank=0, world=1)


@pytest.mark.slow
def test_instruction_tuning_on_conversations_exports_the_template(workspace, tmp_path):
    """Dex instruction-tuned on chats: the first iteration's loss (the model still the original:
    lambda(0) = 0) is the original model's cross entropy on the assistant turns of the global batch
    (both ranks, both micro-steps), each target weighing the same; the export renders chats with the template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megadiff.adapt.data import BatchReader, build_packed_dataset

    output = workspace / "chat"
    adapt_in_ranks(workspace, *_chat_overrides(workspace), f"output_dir={output}", "train.iters=1")
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), _chat_overrides(workspace) + [
        f"data.cache_dir={tmp_path}"])
    dataset = build_packed_dataset(cfg.data, AutoTokenizer.from_pretrained(workspace / "model"))
    model = AutoModelForCausalLM.from_pretrained(workspace / "model").eval()
    logits, targets, every_token = [], [], []
    with torch.no_grad():
        for rank in range(2):
            reader = BatchReader(dataset, cfg.data.seed, cfg.train.micro_batch_size, cfg.train.grad_accum, rank, 2)
            for micro_step in range(cfg.train.grad_accum):
                input_ids, labels = reader.micro_batch_at(0, micro_step)
                logits.append(model(input_ids).logits[:, :-1].flatten(0, 1))
                targets.append(labels[:, 1:].flatten())
                every_token.append(input_ids[:, 1:].flatten())
    counts = [int((t != -100).sum()) for t in targets]
    assert len(set(counts)) > 1, counts  # micro-batches of unequal targets: a mean of their means would differ
    logits = torch.cat(logits)
    expected = torch.nn.functional.cross_entropy(logits, torch.cat(targets), ignore_index=-100).item()
    everything = torch.nn.functional.cross_entropy(logits, torch.cat(every_token)).item()
    assert abs(expected - everything) > 2e-4 * everything  # what a run scoring every token would log
    first = read_metrics(output)[0]
    assert first["lm_loss"] == pytest.approx(expected, rel=2e-5)
    # the same global batch in four micro-steps of one row: the same objective, so the same gradient
    resplit = workspace / "chat_resplit"
    adapt_in_ranks(workspace, *_chat_overrides(workspace), f"output_dir={resplit}", "train.iters=1",
                   "train.micro_batch_size=1", "train.grad_accum=4")
    again = read_metrics(resplit)[0]
    assert (again["lm_loss"], again["grad_norm"]) == pytest.approx((first["lm_loss"], first["grad_norm"]), rel=1e-5)
    exported = AutoTokenizer.from_pretrained(output / "hf")
    chat = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Seth."}]
    assert exported.apply_chat_template(chat, tokenize=False) == \
        "<|im_start|>user\nWho begat Enos?<|im_end|>\n<|im_start|>assistant\nSeth.<|im_end|>\n"


def test_a_rerun_asking_for_other_planned_settings_is_refused(workspace):
    """A saved plan fixes the adapted heads and lambdas: a rerun whose config or overrides ask for
    other ones is refused by name, not held to the plan without a word."""
    from megadiff.adapt.plan import _planned_settings, check_planned_settings

    config = str(workspace / "adapt.yaml")
    first = load_finetune_config(config, [])
    plan = {"method": "dex", "anneal_steps": 3, "lambda_learn_init": 0.0, "step": 0, "layers": [],
            "settings": json.loads(json.dumps(_planned_settings(first)))}
    check_planned_settings(plan, load_finetune_config(config, []))  # the same run again
    check_planned_settings(plan, load_finetune_config(config, ["adaptation.heads_fraction=0.5"]))  # as planned
    check_planned_settings(plan, load_finetune_config(config, ["adaptation.selection=entropy"]))  # Dex's default
    for override, key in (("adaptation.anneal_steps=99", "anneal_steps"), ("adaptation.heads_fraction=0.25",
                                                                          "heads_fraction"),
                          ("adaptation.lambda_init=0.3", "lambda_init"), ("adaptation.selection=importance",
                                                                          "selection")):
        with pytest.raises(ConfigError, match=f"adaptation.{key}: .* was planned with"):
            check_planned_settings(plan, load_finetune_config(config, [override]))
    earlier = {key: value for key, value in plan.items() if key != "settings"}  # a plan from before settings
    check_planned_settings(earlier, load_finetune_config(config, ["adaptation.heads_fraction=0.25"]))
    with pytest.raises(ConfigError, match="adaptation.anneal_steps"):
        check_planned_settings(earlier, load_finetune_config(config, ["adaptation.anneal_steps=99"]))


@pytest.mark.usefixtures("refused_before_running")
def test_a_model_saved_without_its_head_is_refused_before_training(workspace, tmp_path, capsys):
    """A LlamaModel's directory (the decoder saved without lm_head) loads in transformers as a causal LM whose
    head it draws at random, with a note in its load report: the adaptation trained and exported a model that
    was never the pretrained one."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from megadiff.cli import main

    bare, run = tmp_path / "bare", tmp_path / "run"
    LlamaForCausalLM.from_pretrained(workspace / "model").model.save_pretrained(bare)
    AutoTokenizer.from_pretrained(workspace / "model").save_pretrained(bare)
    with mock.patch.dict(os.environ):  # the adaptation's world of one sets RANK and WORLD_SIZE in this process
        assert main(["adapt", str(workspace / "adapt.yaml"), f"model.path={bare}", f"output_dir={run}"]) == 2
    refusal = capsys.readouterr().err
    assert f"model.path: {bare} lacks lm_head.weight" in refusal
    assert not (run / "metrics.jsonl").exists() and not (run / "hf").exists()


@pytest.mark.usefixtures("refused_before_running")
def test_a_rerun_asking_for_another_method_is_refused_before_it_records_its_config(workspace, tmp_path, capsys):
    """Refused after tokenizing and loading the weights, the rerun had already written its config.yaml: the
    run's recorded config then described a run that never happened."""
    from megadiff.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "adaptation.json").write_text(json.dumps({"method": "dex", "anneal_steps": 3, "lambda_learn_init": 0.0}))
    (run / "config.yaml").write_text("the dex run's\n")
    assert main(["adapt", str(workspace / "adapt.yaml"), f"output_dir={run}", "adaptation.method=daa"]) == 2
    assert f"adaptation.method: 'daa', but {run} holds a 'dex' run" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == "the dex run's\n"


@pytest.mark.usefixtures("refused_before_running")
def test_a_second_adaptation_on_a_directory_in_use_is_refused(workspace, tmp_path, capsys):
    """As pre-training's: an adaptation started on the output_dir of one still running is refused before it
    writes anything there."""
    from megadiff.cli import main
    from megadiff.rank_agreement import RUN_LOCK
    from tests.conftest import lock_held_elsewhere

    run = tmp_path / "run"
    # the adaptation's world of one sets RANK and WORLD_SIZE in this process (tests/conftest.py)
    with lock_held_elsewhere(run / RUN_LOCK) as pid, mock.patch.dict(os.environ):
        assert main(["adapt", str(workspace / "adapt.yaml"), f"output_dir={run}"]) == 2
    refusal = capsys.readouterr().err
    assert f"output_dir {run} is in use by another run (host " in refusal and f", pid {pid})" in refusal
    assert [path.name for path in run.iterdir()] == [RUN_LOCK]


@pytest.mark.usefixtures("refused_before_running")
def test_a_rerun_reading_other_data_is_refused(workspace, tmp_path, capsys):
    """Another seq_length packs other samples: the rerun resumed at its checkpoint's count of samples read, in an
    order it never read, without a word."""
    from megadiff.adapt.plan import check_planned_data, planned_data
    from megadiff.cli import main

    run, config = tmp_path / "run", str(workspace / "adapt.yaml")
    run.mkdir()
    plan = {"method": "dex", "anneal_steps": 3, "lambda_learn_init": 0.0,
            "data": planned_data(load_finetune_config(config, [f"output_dir={run}"]))}
    (run / "adaptation.json").write_text(json.dumps(plan))
    assert main(["adapt", config, f"output_dir={run}", "data.seq_length=64"]) == 2
    assert f"data.seq_length: 64, but {run} was trained on 32" in capsys.readouterr().err
    # the same data elsewhere (a node-local copy) is the same data; a file grown since is not
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    first = Path(load_finetune_config(config, []).data.files[0])
    shutil.copyfile(first, copy / first.name)
    copied = [f"output_dir={run}", f"data.files=[{copy / first.name}]"]
    check_planned_data(plan, load_finetune_config(config, copied))
    with (copy / first.name).open("a") as grown:
        grown.write('{"text": "and more"}\n')
    with pytest.raises(ConfigError, match="data.files: .* was trained on"):
        check_planned_data(plan, load_finetune_config(config, copied))
    (run / "adaptation.json").write_text('{"method": "dex", "anch')  # cut short by a kill mid-write
    assert main(["adapt", config, f"output_dir={run}"]) == 2
    assert "adaptation.json is not JSON" in capsys.readouterr().err


def test_checkpoints_leave_out_a_tied_head_s_frozen_embedding():
    """DeepSpeed drops frozen parameters by their first names only; a tied head's second name is
    dropped too (DeepSpeed's own module_state_dict, on a tiny tied Llama whose attention trains)."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import LlamaConfig, LlamaForCausalLM

    from megadiff.adapt.finetune import leave_out_frozen_aliases

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    for name, param in model.named_parameters():
        param.requires_grad = ".self_attn." in name
    engine = SimpleNamespace(module=model, random_ltd_enabled=lambda: False)
    engine.module_state_dict = lambda **kwargs: DeepSpeedEngine.module_state_dict(engine, **kwargs)
    assert "lm_head.weight" in engine.module_state_dict(exclude_frozen_parameters=True)  # DeepSpeed's own
    leave_out_frozen_aliases(engine)
    kept = engine.module_state_dict(exclude_frozen_parameters=True)
    assert set(kept) == {name for name, param in model.named_parameters() if param.requires_grad}
    assert "lm_head.weight" in engine.module_state_dict()  # the whole model when asked for it


def test_a_rerun_on_another_base_model_is_refused(workspace, tmp_path):
    """Checkpoints leave the frozen weights to model.path: a rerun must find the same model there
    (moved or copied is fine; changed weights or config are not)."""
    from megadiff.adapt.plan import base_model_fingerprint, check_base_model

    model = tmp_path / "model"
    shutil.copytree(workspace / "model", model)
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"model.path={model}", f"output_dir={tmp_path}"])
    plan = {"base_model": base_model_fingerprint(str(model))}
    assert plan["base_model"]["weight_bytes"].keys() == {"model.safetensors"}
    moved = tmp_path / "moved"
    model.rename(moved)
    check_base_model(plan, cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(moved)})}))
    moved.rename(model)
    check_base_model({}, cfg)  # a plan from before plans recorded it
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(ConfigError, match="model.path: .* is not the model .* was adapted from"):
        check_base_model(plan, cfg)
    plan = {"base_model": base_model_fingerprint(str(model))}  # config.json as it now is
    check_base_model(plan, cfg)
    with open(model / "model.safetensors", "ab") as weights:
        weights.write(b"\0" * 8)
    with pytest.raises(ConfigError, match="model.path: .* is not the model"):
        check_base_model(plan, cfg)


def rerun_planned_on_own_copy(rank: int, world_size: int, config: str, overrides: list[str], models: list[str],
                              report: str) -> None:
    """Rank r checks output_dir's saved plan against its own copy of the base model, models[r], as ranks
    of different nodes reading node-local copies do."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megadiff.adapt.plan import adaptation_plan

    dist.init_process_group("gloo")
    cfg = load_finetune_config(config, [*overrides, f"model.path={models[rank]}"])
    try:
        adaptation_plan(cfg, AutoModelForCausalLM.from_pretrained(models[rank]), reader=None, stage=2, rank=rank)
        outcome = "accepted"
    except MegadiffError as err:
        outcome = str(err)
    Path(report, f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


def test_a_base_model_that_differs_on_one_node_is_refused_on_every_rank(workspace, tmp_path):
    """A rank whose model.path differs refuses the rerun; the others refuse it with its error rather
    than waiting for it in their next collective."""
    from megadiff.adapt.plan import PLAN_FILE, _planned_settings, base_model_fingerprint

    copies = [str(tmp_path / f"node{rank}") for rank in range(2)]
    for copy in copies:
        shutil.copytree(workspace / "model", copy)
    overrides = [f"output_dir={tmp_path / 'out'}"]
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [*overrides, f"model.path={copies[0]}"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / PLAN_FILE).write_text(json.dumps({
        "method": cfg.adaptation.method, "anneal_steps": cfg.adaptation.anneal_steps,
        "lambda_learn_init": cfg.adaptation.lambda_learn_init, "settings": _planned_settings(cfg),
        "base_model": base_model_fingerprint(copies[0])}))

    def outcomes() -> list[str]:
        run_ranks(2, rerun_planned_on_own_copy, str(workspace / "adapt.yaml"), overrides, copies, str(tmp_path),
                  timeout=120)
        return [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]

    assert outcomes() == ["accepted", "accepted"]
    config = json.loads(Path(copies[1], "config.json").read_text())
    Path(copies[1], "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    first, second = outcomes()
    assert second.startswith(f"model.path: {copies[1]} is not the model")
    assert first == f"rank 1 refused the run: {second}"


def adapted_as_rank(rank: int, world_size: int, config: str, overrides: list[str], per_rank: dict, report: str) -> None:
    """finetune with this rank's own extra overrides (a node's own copy of a config or model); what it raised."""
    from megadiff.adapt.finetune import finetune

    try:
        finetune(load_finetune_config(config, [*overrides, *per_rank.get(rank, [])]))
        outcome = "trained"
    except MegadiffError as err:
        outcome = str(err)
    Path(report, f"rank{rank}").write_text(outcome)


def test_adaptation_ranks_started_differently_are_refused_before_the_model_loads(workspace, tmp_path):
    """Another lr on one node trained its replica apart; a node's own copy of the base model, at its own path,
    is no difference."""
    copy = tmp_path / "node1-model"
    shutil.copytree(workspace / "model", copy)
    overrides = [f"output_dir={tmp_path / 'run'}", "train.iters=1"]
    with mock.patch.dict(os.environ, _env(workspace)):
        run_ranks(2, adapted_as_rank, str(workspace / "adapt.yaml"), overrides,
                  {1: ["train.lr=0.5", f"model.path={copy}"]}, str(tmp_path), timeout=300)
    first, second = ((tmp_path / f"rank{rank}").read_text() for rank in range(2))
    host = socket.gethostname()
    assert first == second == ("the ranks were started differently (a config file or data that differs between "
                               f"nodes?): config.train.lr: rank 0 ({host}) has 0.003, rank 1 ({host}) has 0.5; "
                               f"deepspeed.optimizer.params.lr: rank 0 ({host}) has 0.003, rank 1 ({host}) has 0.5")
    assert not (tmp_path / "run" / "adaptation.json").exists()  # refused before head selection


def built_by_node_leader_first(rank: int, world_size: int, failing_rank: int | None, error: str, report: str) -> None:
    """finetune's data build, rank 0 first, failing on `failing_rank` with a refusal
    (`error` "config") or an unexpected error ("os", "local": of a class defined here)."""
    import time

    import torch.distributed as dist

    from megadiff.adapt.finetune import _rank_0_first

    leader_built = Path(report, "leader_built")

    class LocalError(Exception):  # no class by name to pickle
        pass

    errors = {"config": ConfigError("data.files: too few tokens"), "os": OSError("disk on fire"),
              "local": LocalError("made here")}

    def build() -> str:
        if rank == 0:
            time.sleep(1.0)
            leader_built.touch()
        if rank == failing_rank:
            raise errors[error]
        return "leader's cache there" if leader_built.exists() else "built alone"

    dist.init_process_group("gloo")
    try:
        outcome = _rank_0_first(build, rank)
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
    Path(report, f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.parametrize("failing_rank, error, expected", [
    (None, "", ["leader's cache there"] * 2),
    (0, "config", ["ConfigError: data.files: too few tokens",
                   "ConfigError: rank 0 refused the run: data.files: too few tokens"]),
    (1, "config", ["ConfigError: rank 1 refused the run: data.files: too few tokens",
                   "ConfigError: data.files: too few tokens"]),
    (0, "os", ["OSError: disk on fire", "MegadiffError: rank 0 failed: OSError: disk on fire"]),
    (1, "local", ["MegadiffError: rank 1 failed: LocalError: made here", "LocalError: made here"]),
])
def test_the_data_is_built_by_the_node_leader_first_and_refused_on_every_rank(failing_rank, error, expected,
                                                                              tmp_path):
    """Every rank stops, as the same kind of refusal (the same exit code), where any rank's build fails."""
    run_ranks(2, built_by_node_leader_first, failing_rank, error, str(tmp_path), timeout=120)
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == expected


def built_into_a_shared_cache(rank: int, world_size: int, cache: str) -> None:
    """finetune's data build in turns, a stand-in for datasets' building into a cache every node shares: the data
    read from `cache` where it is there, else tokenized (a while) and written there, the rank noted as tokenizing."""
    import time

    import torch.distributed as dist

    from megadiff.adapt.finetune import _rank_0_first

    built = Path(cache, "tokens")

    def build() -> str:
        if not built.exists():
            with open(Path(cache, "tokenized_by"), "a") as log:
                log.write(f"{rank}\n")
            time.sleep(1.0)
            write_atomically(built, b"tokens")  # renamed over what another rank may be reading
        return built.read_text()

    dist.init_process_group("gloo")
    Path(cache, f"rank{rank}").write_text(_rank_0_first(build, rank))
    dist.destroy_process_group()


def test_the_data_is_tokenized_once_into_a_cache_every_node_shares(tmp_path):
    """The datasets cache under a shared $HOME or data.cache_dir: every node's leader tokenized into it at once,
    renaming its file over the one the other nodes' ranks had memory-mapped (a stale handle, SIGBUS, on NFS). Rank 0
    builds first; every other rank reads what it built."""
    cache = tmp_path / "cache"
    cache.mkdir()
    run_ranks(4, built_into_a_shared_cache, str(cache), nodes=tmp_path / "nodes", timeout=120)
    assert (cache / "tokenized_by").read_text().split() == ["0"]
    assert [(cache / f"rank{rank}").read_text() for rank in range(4)] == ["tokens"] * 4


def test_adapt_imports_no_megatron():
    """adapt works on HF models alone: neither megatron-core nor megadiff's megatron layers load."""
    probe = ("import sys, megadiff.adapt.finetune, megadiff.adapt.export; print(sorted(m for m in sys.modules "
             "if m.split('.')[0] == 'megatron' or m.startswith(('megadiff.models', 'megadiff.training'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("recipe", sorted((REPO / "configs/adapt").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load(recipe, workspace):
    cfg = load_finetune_config(str(recipe), [f"model.path={workspace / 'model'}",  # a context of 128 positions
                                             f"data.files=[{workspace / 'train.jsonl'}]", "data.seq_length=128"])
    assert deepspeed_config(cfg, world_size=8)["train_batch_size"] == 8 * cfg.train.grad_accum


def test_deepspeed_auto_values_and_schedule(workspace):
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), ["train.grad_accum=3", "train.precision=bf16"])
    ds = deepspeed_config(cfg, world_size=4)
    assert ds["train_batch_size"] == 2 * 3 * 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["optimizer"]["params"]["lr"] == 3e-3 and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    for stage in (1, 2, 3):  # not summed in bf16 over the micro-steps, at any ZeRO stage shipped
        shipped = load_finetune_config(str(workspace / "adapt.yaml"), [
            f"deepspeed={REPO / f'configs/deepspeed/zero{stage}.json'}", "train.precision=bf16"])
        assert deepspeed_config(shipped, world_size=4)["data_types"]["grad_accum_dtype"] == "fp32", stage
    # linear warmup (the first step already trains), then cosine towards min_ratio, reached one step after the
    # last: with min_ratio 0 the last step trained nothing
    steps = [lr_multiplier(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(20)]
    assert steps[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 17)) for k in range(1, 17)]
    assert steps[4:] == pytest.approx(cosine) and all(a > b for a, b in zip(steps[3:], steps[4:]))
    assert all(lr_multiplier(s, 0, 5, min_ratio=0.0) > 0 for s in range(5))


def test_a_tokenizer_with_more_ids_than_the_model_embeds_is_refused_before_any_work(workspace, small_tokenizer_dir,
                                                                                    tmp_path):
    """Another model's tokenizer, or tokens added without resize_token_embeddings: the first batch holding an id
    past the embedding failed on an IndexError (a device-side assert on a GPU), after the data and weights loaded."""
    from transformers import AutoTokenizer

    rows = json.loads((workspace / "model" / "config.json").read_text())["vocab_size"]
    assert len(AutoTokenizer.from_pretrained(small_tokenizer_dir)) > rows
    with mock.patch.dict(os.environ, _env(workspace)):
        refused = run_reporting_ranks(2, megadiff_main, ["adapt", str(workspace / "adapt.yaml"),
                                                         f"output_dir={tmp_path / 'run'}",
                                                         f"model.tokenizer={small_tokenizer_dir}"],
                                      timeout=400, expect=2)
    said = f"model.tokenizer: {small_tokenizer_dir} has 512 ids, but the model in {workspace / 'model'} embeds {rows} "
    assert refused.stderr.count(said) == 2, refused.stderr[-2000:]
    assert "Loading weights" not in refused.stderr + refused.stdout


def test_a_special_tokens_text_in_a_document_is_text(workspace, tmp_path):
    """A literal EOS text inside a document is text, as prepare-data reads it: the EOS id only ends documents."""
    from transformers import AutoTokenizer

    from megadiff.adapt.data import build_packed_dataset

    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    documents = [f"line {i} says {tokenizer.eos_token} in the middle of its text" for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"data.files=[{tmp_path / 'docs.jsonl'}]",
                                                               f"data.cache_dir={tmp_path / 'cache'}"])
    stream = build_packed_dataset(cfg.data, tokenizer)[:]["input_ids"].flatten().tolist()
    as_text = [tokenizer(d, split_special_tokens=True, add_special_tokens=False)["input_ids"] for d in documents]
    assert all(tokenizer.eos_token_id not in ids for ids in as_text)
    assert stream == [token for ids in as_text for token in ids + [tokenizer.eos_token_id]][:len(stream)]


def test_bad_data_files_are_refused_by_name_and_textless_records_skipped(workspace, tmp_path):
    """An empty .jsonl ended in a bare StopIteration from datasets, a line that is no JSON in its
    DatasetGenerationError, a record with a null text in the tokenizer's ValueError."""
    from transformers import AutoTokenizer

    from megadiff.adapt.data import build_packed_dataset

    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")

    def packed(*files: Path, key: str = "text") -> list[int]:
        cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"data.files=[{','.join(map(str, files))}]",
                                                                   f"data.text_key={key}",
                                                                   f"data.cache_dir={tmp_path / 'cache'}"])
        return build_packed_dataset(cfg.data, tokenizer)[:]["input_ids"].flatten().tolist()

    documents = [f"verse {i}: and God saw the light, that it was good" for i in range(30)]
    records = [json.dumps({"text": d}) for d in documents]
    (tmp_path / "docs.jsonl").write_text("\n".join([records[0], '{"text": null}', '{"body": "x"}', '{"text": ""}',
                                                    *records[1:]]) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    eos = tokenizer.eos_token_id
    expected = [t for d in documents for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]]
    stream = packed(tmp_path / "empty.jsonl", tmp_path / "docs.jsonl")
    assert stream == expected[:len(stream)] and len(stream) > 0
    (tmp_path / "broken.jsonl").write_text(records[0] + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"data.files\[1\]: .*broken.jsonl could not be read"):
        packed(tmp_path / "docs.jsonl", tmp_path / "broken.jsonl")
    with pytest.raises(ConfigError, match=r"data.text_key: data.files\[0\] \(.*docs.jsonl\) has no field 'content'"):
        packed(tmp_path / "docs.jsonl", key="content")


def test_documents_begin_as_the_tokenizer_begins_a_text(workspace, tmp_path):
    """A Llama-like tokenizer puts BOS before every text: each document begins with it, as the model's
    pre-training documents did; the workspace's tokenizer adds nothing (see the test above)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from megadiff.adapt.data import build_packed_dataset
    from megadiff.data.tokenizers import text_start

    plain = AutoTokenizer.from_pretrained(workspace / "model")
    assert text_start(plain) == ()
    llama_like = AutoTokenizer.from_pretrained(workspace / "model")
    llama_like.add_special_tokens({"bos_token": "<s>"})
    bos = llama_like.bos_token_id
    llama_like.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    assert text_start(llama_like) == (bos,)
    documents = [f"verse {i}: and the evening and the morning were the day" for i in range(30)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"data.files=[{tmp_path / 'docs.jsonl'}]",
                                                               f"data.cache_dir={tmp_path / 'cache'}"])
    stream = build_packed_dataset(cfg.data, llama_like)[:]["input_ids"].flatten().tolist()
    texts = [plain(d, add_special_tokens=False)["input_ids"] for d in documents]
    assert stream == [token for ids in texts for token in [bos] + ids + [plain.eos_token_id]][:len(stream)]


def test_a_resumed_adaptation_trains_what_its_plan_recorded(workspace):
    """The plan file records the trained parameters: a rerun keeps them (its optimizer state holds
    those) even where the defaults changed since, and refuses other ones asked for explicitly."""
    from transformers import AutoModelForCausalLM

    from megadiff.adapt.apply import has_tied_head
    from megadiff.adapt.plan import _with_trainable

    model = AutoModelForCausalLM.from_pretrained(workspace / "model")
    daa = load_finetune_config(str(workspace / "adapt.yaml"), ["adaptation.method=daa"])
    default = daa.adaptation.trainable_patterns(has_tied_head(model))
    assert _with_trainable({"method": "daa"}, daa, model, saved=False)["trainable"] == default
    earlier = {"method": "daa", "trainable": ["*.self_attn.*"]}
    assert _with_trainable(earlier, daa, model, saved=True)["trainable"] == ["*.self_attn.*"] != default
    # a plan saved before plans recorded it: DAA then trained its attention modules alone
    assert _with_trainable({"method": "daa"}, daa, model, saved=True)["trainable"] == ["*.self_attn.*"]
    other = load_finetune_config(str(workspace / "adapt.yaml"), ["adaptation.method=daa", 'adaptation.trainable=["*"]'])
    with pytest.raises(ConfigError, match=r"adaptation.trainable: \['\*'\], but .* trains \['\*.self_attn.\*'\]"):
        _with_trainable(earlier, other, model, saved=True)


def test_tokenizer_workers_give_the_same_sequences(workspace, tmp_path):
    from transformers import AutoTokenizer

    from megadiff.adapt.data import build_packed_dataset

    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    packed = {}
    for workers in (1, 2):
        cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"data.workers={workers}",
                                                                   f"data.cache_dir={tmp_path / str(workers)}"])
        packed[workers] = build_packed_dataset(cfg.data, tokenizer)[:]["input_ids"]
    assert len(packed[1]) > 10
    assert torch.equal(packed[1], packed[2])



def test_tokenizer_workers_start_under_a_long_tmpdir(workspace, tmp_path):
    """datasets' workers report to a manager whose socket lies below TMPDIR: under a Slurm job's long one its path
    was too long, and adapt failed tokenizing (a bare EOFError). The sequences are those of one process."""
    from transformers import AutoTokenizer

    from megadiff.adapt.data import build_packed_dataset
    from tests.test_long_tmpdir import long_tmpdir, run_under

    code = (f"import torch\nfrom transformers import AutoTokenizer\n"
            f"from megadiff.adapt.data import build_packed_dataset\nfrom megadiff.adapt.settings import "
            f"load_finetune_config\ncfg = load_finetune_config({str(workspace / 'adapt.yaml')!r}, "
            f"['data.workers=2', 'data.cache_dir={tmp_path / 'two'}'])\n"
            f"tokenizer = AutoTokenizer.from_pretrained({str(workspace / 'model')!r})\n"
            f"torch.save(build_packed_dataset(cfg.data, tokenizer)[:]['input_ids'], {str(tmp_path / 'two.pt')!r})")
    proc = run_under(long_tmpdir(tmp_path), code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"data.cache_dir={tmp_path / 'one'}"])
    alone = build_packed_dataset(cfg.data, AutoTokenizer.from_pretrained(workspace / "model"))[:]["input_ids"]
    assert torch.equal(torch.load(tmp_path / "two.pt"), alone)

def _calibration_worker(rank: int, world_size: int, workspace: str, selection: str, out_path: str) -> None:
    """ZeRO-3 on 2 ranks: head scores measured with each block gathered while it runs (forward, and
    backward for importance), against the whole model gathered; and how many weights a rank held at
    once, probed as every block starts its forward and its backward."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from megadiff.adapt import deepspeed_setup as dss
    from megadiff.adapt.selection import attention_entropy, head_importance

    measure = {"entropy": attention_entropy, "importance": head_importance}[selection]
    cfg = load_finetune_config(f"{workspace}/adapt.yaml", [f"deepspeed={workspace}/zero3_all.json"])
    dss.init_distributed(cfg.train.timeout_minutes)
    ds_config = HfDeepSpeedConfig(dss.deepspeed_config(cfg, world_size))  # noqa: F841 -- partitions at load
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    batches = [torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    params = list(model.parameters())
    blocks = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    held = {"forward": [], "backward": []}

    def probe(phase):
        def hook(_module, _args):
            held[phase].append(sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))
        return hook

    with dss.calibration_parameters(model, 3, selection):
        # registered after the gathering hooks, so they see each block gathered
        handles = [block.register_forward_pre_hook(probe("forward")) for block in blocks]
        handles += [block.register_full_backward_pre_hook(probe("backward")) for block in blocks]
        per_block = measure(model, batches)
        for handle in handles:
            handle.remove()
    released = sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = measure(model, batches)
    if rank == 0:
        torch.save({"per_block": per_block, "whole": whole, "held": held, "released": released,
                    "largest_block": max(sum(p.ds_numel for p in b.parameters()) for b in blocks),
                    "total": sum(p.ds_numel for p in params)}, out_path)


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["entropy", "importance"])
def test_zero3_head_selection_holds_one_block_at_a_time(selection, workspace, tmp_path):
    from tests.distributed import run_ranks

    out = tmp_path / "calibration.pt"
    run_ranks(2, _calibration_worker, str(workspace), selection, str(out))
    result = torch.load(out)
    torch.testing.assert_close(result["per_block"], result["whole"])
    held = result["held"]
    # forwards x (embedding, 2 layers, norm, output layer): importance one per batch (2), entropy one
    # per window of a row (2 batches of 2 rows of one window)
    assert len(held["forward"]) == (4 if selection == "entropy" else 2) * (2 + 3)
    # backward runs through every block but the embedding (no gate lies before it)
    assert len(held["backward"]) == (2 * (2 + 2) if selection == "importance" else 0)
    assert 0 < max(held["forward"] + held["backward"]) <= result["largest_block"] < result["total"]
    assert result["released"] == 0


def test_adam_and_clipping_settings_fill_a_deepspeed_json_that_leaves_them_out(workspace, tmp_path):
    """A DeepSpeed JSON naming only its optimizer's type gets train.adam_betas, adam_eps, weight_decay and
    grad_clip from the adapt config: left out, DeepSpeed's own defaults (AdamW's weight decay of 0.01, no
    clipping) trained silently instead of the config's."""
    minimal = tmp_path / "ds.json"
    minimal.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [
        f"deepspeed={minimal}", "train.adam_betas=[0.8,0.95]", "train.adam_eps=1e-6", "train.weight_decay=0.05",
        "train.grad_clip=0.5"])
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["optimizer"]["params"] == {"lr": cfg.train.lr, "betas": list(cfg.train.adam_betas),
                                         "eps": cfg.train.adam_eps, "weight_decay": cfg.train.weight_decay}
    assert ds["gradient_clipping"] == cfg.train.grad_clip


def test_a_deepspeed_scheduler_section_is_refused(workspace, tmp_path):
    """DeepSpeed's own scheduler would replace megadiff's warmup/cosine schedule (train.lr, warmup_ratio,
    min_lr_ratio) without a word: refused before anything runs."""
    with_scheduler = tmp_path / "ds.json"
    with_scheduler.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                          "scheduler": {"type": "WarmupLR", "params": {}}}))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={with_scheduler}"])
    with pytest.raises(ConfigError, match="deepspeed: .* has a scheduler section"):
        deepspeed_config(cfg, world_size=2)


@pytest.mark.parametrize("key, needed, value, said", [
    ("managed_gradient_accumulation", True, False, "an update at every micro-step"),
    ("gradient_allreduce_op", "mean", "sum", "the number of ranks times the global batch's"),
    ("tensor_parallel.autotp_size", 1, 2, "trains data-parallel"),
    ("checkpoint.writer", None, {"decoupled": True}, "DeepSpeed's own writers"),
    ("wandb.enabled", False, True, "logging.wandb_project")])
def test_a_deepspeed_json_changing_how_the_loop_s_steps_train_is_refused(workspace, tmp_path, key, needed, value,
                                                                         said):
    """megadiff calls DeepSpeed's step() after every micro-step and leaves the accumulation boundary to DeepSpeed's
    count: managed_gradient_accumulation = false made each micro-step an update (the lr schedule ran grad_accum
    times as fast, silently); its loss is normalised for averaged gradients, and gradient_allreduce_op = sum made
    the gradient norm (logged, and clipped at train.grad_clip) the number of ranks times the global batch's;
    AutoTP's tensor parallelism failed at the first step (ranks of its group read their own samples), after the
    model loaded, and so did DeepSpeed's checkpoint writers (a decoupled one writes after save_checkpoint returns,
    when megadiff commits the checkpoint); DeepSpeed's W&B monitor wrote into megadiff's W&B run at its own
    step count. Refused before anything runs; the value the loop needs is kept."""
    path = tmp_path / "ds.json"

    def json_setting(value) -> dict:  # key's dots name the sections it is in
        *sections, name = key.split(".")
        setting = {name: value}
        for section in reversed(sections):
            setting = {section: setting}
        return {"zero_optimization": {"stage": 2}, **setting}

    path.write_text(json.dumps(json_setting(needed)))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={path}"])
    deepspeed_config(cfg, world_size=2)  # not refused
    path.write_text(json.dumps(json_setting(value)))
    with pytest.raises(ConfigError, match=f"deepspeed: .* sets {key} = {json.dumps(value)}: .*{said}"):
        deepspeed_config(cfg, world_size=2)


@pytest.mark.parametrize("precision, section, key", [("bf16", "bf16", "check_grad_overflow"),
                                                   ("fp32", "zero_optimization", "compute_grad_norm")])
def test_a_deepspeed_json_that_applies_non_finite_gradients_is_refused(workspace, tmp_path, precision, section, key):
    """DeepSpeed finds a step's NaN or inf gradients (and leaves its update out) by its overflow check in
    bf16, by the gradient norm in fp32. A JSON turning that off (a speed option) let one NaN step make
    every weight NaN: each later checkpoint held them, the export too, and the run ended with exit code 0.
    Refused before anything runs; the other precision, which the key does not guard, is left alone."""
    unchecked = tmp_path / "ds.json"
    ds = {"zero_optimization": {"stage": 2}}
    ds.setdefault(section, {})[key] = False
    unchecked.write_text(json.dumps(ds))
    overrides = [f"deepspeed={unchecked}", "train.grad_clip=0"]  # DeepSpeed clips by the norm it is told to skip
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), overrides + [f"train.precision={precision}"])
    with pytest.raises(ConfigError, match=f"deepspeed: .* sets {section}.{key} = false: under "
                                          f"train.precision={precision} DeepSpeed then applies"):
        deepspeed_config(cfg, world_size=2)
    other = load_finetune_config(str(workspace / "adapt.yaml"),
                                 overrides + [f"train.precision={'fp32' if precision == 'bf16' else 'bf16'}"])
    assert deepspeed_config(other, world_size=2)[section][key] is False


def test_a_deepspeed_json_s_bfloat16_section_is_read_as_its_bf16_section(workspace, tmp_path):
    """DeepSpeed reads a section named by its older name, bfloat16, where there is no bf16 section, and the bf16
    section filled from train.precision shadowed it: one enabling bf16 trained in fp32, one turning off the bf16
    overflow check kept it on, both silently. It is read as bf16 is, and with a bf16 section beside it refused."""
    path = tmp_path / "ds.json"

    def config_with(ds: dict, precision: str) -> dict:
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **ds}))
        cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={path}", f"train.precision={precision}"])
        return deepspeed_config(cfg, world_size=2)

    enabled = {"bfloat16": {"enabled": True}}
    assert config_with(enabled, "bf16")["bf16"] == {"enabled": True} and "bfloat16" not in config_with(enabled, "bf16")
    with pytest.raises(ConfigError, match="bf16.enabled = True disagrees with the adapt config"):
        config_with(enabled, "fp32")
    with pytest.raises(ConfigError, match="sets bf16.check_grad_overflow = false"):
        config_with({"bfloat16": {"enabled": "auto", "check_grad_overflow": False}}, "bf16")
    with pytest.raises(ConfigError, match="has both a bf16 and a bfloat16 section"):
        config_with({"bf16": {"enabled": "auto"}, "bfloat16": {"enabled": "auto"}}, "bf16")


@pytest.mark.parametrize("setting, said", [
    ({"amp": {"enabled": True}}, "NVIDIA Apex AMP integration has been removed"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "offload_optimizer.device Input should be 'none', 'cpu' or 'nvme'"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}},
     "reduce_bucket_sise Extra inputs are not permitted")])
def test_a_deepspeed_json_deepspeed_refuses_is_refused_before_any_compute(workspace, tmp_path, setting, said):
    """DeepSpeed read the JSON only in deepspeed.initialize: a section it has removed, a misspelt key or a bad value
    failed there with a traceback, once the data was tokenized, the model loaded and the heads measured. Its
    reading now comes with the adapt config's checks, for any world size (the global batch is megadiff's check)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**json.loads((REPO / "configs/deepspeed/zero2.json").read_text()), **setting}))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={path}"])
    with pytest.raises(ConfigError, match=f"deepspeed: .*: DeepSpeed refuses it: .*{re.escape(said)}"):
        deepspeed_config(cfg, world_size=8)
    shipped = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={workspace / 'zero3_all.json'}"])
    assert deepspeed_config(shipped, world_size=8)["train_batch_size"] == 8 * 2 * 2


def test_a_universal_checkpoint_load_is_refused(workspace, tmp_path):
    """DeepSpeed's universal checkpoints need state that Hugging Face models do not record (ds_to_universal
    refuses adapt's checkpoints, and a universal load of one failed after the model loaded, calling it
    damaged): refused before anything runs."""
    universal = tmp_path / "ds.json"
    universal.write_text(json.dumps({"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}))
    cfg = load_finetune_config(str(workspace / "adapt.yaml"), [f"deepspeed={universal}"])
    with pytest.raises(ConfigError, match="sets checkpoint.load_universal"):
        deepspeed_config(cfg, world_size=2)


def test_a_rerun_with_another_data_seed_is_refused(workspace, tmp_path):
    """data.seed orders the samples: a rerun with another one resumed at its checkpoint's count of samples
    read, in an order it never read."""
    from megadiff.adapt.plan import check_planned_data, planned_data

    config = str(workspace / "adapt.yaml")
    first = load_finetune_config(config, [f"output_dir={tmp_path}"])
    plan = {"data": planned_data(first)}
    check_planned_data(plan, first)
    with pytest.raises(ConfigError, match=f"data.seed: {first.data.seed + 1}, but .* was trained on {first.data.seed}"):
        check_planned_data(plan, load_finetune_config(config, [f"output_dir={tmp_path}",
                                                               f"data.seed={first.data.seed + 1}"]))


@pytest.mark.parametrize("override", ["adaptation.calibration_batches=3", "adaptation.selected_heads=[[0],[1]]"])
def test_a_rerun_asking_for_other_calibration_or_given_heads_is_refused(workspace, override):
    """The heads a plan adapts were measured on its calibration batches (or given): a rerun asking for
    another count of batches, or other heads, is refused by name rather than held to the saved plan."""
    from megadiff.adapt.plan import _planned_settings, check_planned_settings

    config = str(workspace / "adapt.yaml")
    plan = {"method": "dex", "anneal_steps": 3, "lambda_learn_init": 0.0,
            "settings": json.loads(json.dumps(_planned_settings(load_finetune_config(config, []))))}
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: .* was planned with"):
        check_planned_settings(plan, load_finetune_config(config, [override]))


def test_each_epoch_reads_its_own_permutation_of_the_sequences():
    """The sample order is one seeded permutation per epoch (seed + epoch): a second epoch reads every
    sequence once again, in another order, not the first epoch's order repeated."""
    from megadiff.adapt.data import SampleOrder

    rows, order = 50, SampleOrder(num_rows=50, seed=3)
    first, second = ([order.row(epoch * rows + i) for i in range(rows)] for epoch in (0, 1))
    assert sorted(first) == sorted(second) == list(range(rows)) and first != second


def test_calibration_batches_are_the_first_micro_batches_of_the_order():
    """Head selection measures the first `calibration_batches` micro-batches of the training order: that many
    distinct sequences x micro_batch_size, the same on every rank, none measured twice."""
    from megadiff.adapt.data import BatchReader, SampleOrder

    dataset = [{"input_ids": torch.full((4,), i)} for i in range(20)]
    micro_batch, count = 2, 3
    order = SampleOrder(len(dataset), seed=5)
    expected = [order.row(sample) for sample in range(count * micro_batch)]
    for rank in (0, 1):
        reader = BatchReader(dataset, seed=5, micro_batch=micro_batch, grad_accum=2, rank=rank, world=2)
        measured = [int(row[0]) for batch in reader.calibration_batches(count) for row in batch]
        assert measured == expected


def test_head_selection_needs_at_least_one_calibration_batch(workspace):
    """calibration_batches=0 would measure entropy or importance on nothing (a division by zero rows):
    refused by name with the config."""
    with pytest.raises(ConfigError, match="adaptation.calibration_batches"):
        load_finetune_config(str(workspace / "adapt.yaml"), ["adaptation.calibration_batches=0"])


def test_the_schedule_warms_up_for_the_rounded_share_and_a_resume_follows_the_reruns_schedule():
    """warmup_ratio x iters is rounded to whole warmup steps (1.8 -> 2), and a run resumed from a checkpoint with
    another lr and iters continues on the rerun's schedule at the step the loaded state reached, not the saving
    run's peak or a step behind, and says how its lr jumps there."""
    from megadiff.adapt.schedule import resume_schedule, warmup_cosine
    from megadiff.adapt.settings import TrainSection

    first = TrainSection(iters=20, warmup_ratio=0.09, lr=1e-3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=first.lr)
    scheduler = warmup_cosine(first)(optimizer)
    warmup, steps = round(first.warmup_ratio * first.iters), 5
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert warmup == 2 and lrs == pytest.approx(
        [first.lr * lr_multiplier(step, warmup, first.iters, first.min_lr_ratio) for step in range(steps)])
    same = warmup_cosine(first)(optimizer)
    same.load_state_dict(scheduler.state_dict())
    assert resume_schedule(same, first) is None  # the same schedule goes on unsaid
    rerun = TrainSection(iters=40, warmup_ratio=0.09, lr=5e-4)
    resumed = warmup_cosine(rerun)(optimizer)
    resumed.load_state_dict(scheduler.state_dict())  # as DeepSpeed's load_checkpoint restores it
    said = resume_schedule(resumed, rerun)
    rerun_warmup = round(rerun.warmup_ratio * rerun.iters)
    # the jump, said: the rerun's lr at the checkpoint's position, and the lr the saving run's schedule had next
    was = first.lr * lr_multiplier(steps, warmup, first.iters, first.min_lr_ratio)
    now = rerun.lr * lr_multiplier(steps, rerun_warmup, rerun.iters, rerun.min_lr_ratio)
    assert f"update {steps + 1} takes lr {now:.4g}, where the checkpoint's schedule had {was:.4g}" in said
    for step in (steps, steps + 1):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            rerun.lr * lr_multiplier(step, rerun_warmup, rerun.iters, rerun.min_lr_ratio))
        optimizer.step()
        resumed.step()


def test_a_rerun_leaving_out_a_planned_setting_is_held_to_the_plan(workspace):
    """Only the settings a rerun gives are compared with its plan: the same command without the overrides the
    first run was given (heads_fraction, lambda_init) resumes on the saved plan rather than being refused."""
    from megadiff.adapt.plan import _planned_settings, check_planned_settings

    config = str(workspace / "adapt.yaml")
    first = load_finetune_config(config, ["adaptation.heads_fraction=0.25", "adaptation.lambda_init=0.3"])
    plan = {"method": "dex", "anneal_steps": first.adaptation.anneal_steps, "lambda_learn_init": 0.0,
            "settings": json.loads(json.dumps(_planned_settings(first)))}
    rerun = load_finetune_config(config, [])
    assert rerun.adaptation.heads_fraction != first.adaptation.heads_fraction
    check_planned_settings(plan, rerun)


def test_ranks_and_micro_steps_read_disjoint_samples_in_the_documented_order():
    """Micro-batch (iteration i, micro-step m) on rank r holds the samples ((i * grad_accum + m) * world + r)
    * micro_batch + j of the order: each rank reads its own sequences (two ranks reading the same ones trained
    a global batch of half the data, twice), and a resume at any iteration reads what an uninterrupted run would."""
    from megadiff.adapt.data import BatchReader, SampleOrder

    dataset = [{"input_ids": torch.full((3,), i)} for i in range(64)]
    micro_batch, grad_accum, world, seed = 2, 2, 2, 9
    order = SampleOrder(len(dataset), seed)
    readers = [BatchReader(dataset, seed, micro_batch, grad_accum, rank, world) for rank in range(world)]
    read = []
    for iteration in range(3):
        for micro_step in range(grad_accum):
            for rank, reader in enumerate(readers):
                ids, labels = reader.micro_batch_at(iteration, micro_step)
                first = ((iteration * grad_accum + micro_step) * world + rank) * micro_batch
                assert ids[:, 0].tolist() == [order.row(first + j) for j in range(micro_batch)]
                assert torch.equal(labels, ids)
                read += ids[:, 0].tolist()
    assert len(set(read)) == len(read) == 3 * grad_accum * world * micro_batch


def test_a_tokenizer_directory_without_tokenizer_files_is_refused_with_the_config(workspace, tmp_path):
    """model.tokenizer naming a directory that holds no tokenizer is refused by name before any rank starts,
    rather than by transformers once the process group has formed."""
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"model.tokenizer: no tokenizer files in {empty}"):
        load_finetune_config(str(workspace / "adapt.yaml"), [f"model.tokenizer={empty}"])
    assert load_finetune_config(str(workspace / "adapt.yaml"), [f"model.tokenizer={workspace / 'model'}"])


def samples_read_by(config: str, overrides: list[str], report_dir: str) -> int:
    """finetuned's run; each rank records the first sample number of every micro-batch it reads."""
    from megadiff.adapt.data import BatchReader

    read_rows, read = BatchReader._rows, []

    def recorded(reader, first_sample):
        read.extend(range(first_sample, first_sample + reader.micro_batch))
        Path(report_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(read))
        return read_rows(reader, first_sample)

    with mock.patch.object(BatchReader, "_rows", recorded):
        return finetuned(config, overrides)


def test_a_rerun_with_another_global_batch_reads_on_from_the_samples_read(workspace, tmp_path):
    """Stopped after iteration 2 of global batches of 8 (2 ranks x grad_accum 2 x 2), rerun with grad_accum 1:
    the rerun reads on from sample 16, as a run reads its data once, not from iteration x its own global batch
    (sample 8: the samples 8-15 trained on twice; with a larger batch, samples never read)."""
    output = tmp_path / "run"
    runs = [[f"output_dir={output}", "checkpoint.exit_interval=2", "adaptation.selection=all"],
            [f"output_dir={output}", "train.grad_accum=1"]]
    read = []
    for overrides in runs:
        reports = tmp_path / f"read{len(read)}"
        reports.mkdir()
        with mock.patch.dict(os.environ, _env(workspace)):
            run_reporting_ranks(2, samples_read_by, str(workspace / "adapt.yaml"), overrides, str(reports),
                                timeout=400)
        read.append(sorted(sample for report in reports.glob("rank*.json")
                           for sample in json.loads(report.read_text())))
    first = load_finetune_config(str(workspace / "adapt.yaml"), runs[0]).train
    second = load_finetune_config(str(workspace / "adapt.yaml"), runs[1]).train
    assert read[0] == list(range(2 * 2 * first.grad_accum * first.micro_batch_size))
    rerun_samples = (second.iters - 2) * 2 * second.grad_accum * second.micro_batch_size
    assert read[1] == list(range(len(read[0]), len(read[0]) + rerun_samples))


def adaptations_in_one_process(config: str, output: str, runs: int, report: str) -> None:
    """`runs` adaptations one after another in this plain process (a notebook's, a sweep driver's), the process
    group released after each as a pre-training run's end releases it; reports the signal handlers and rendezvous
    variables before and after them, and each run's losses."""
    import signal

    from megadiff.adapt.finetune import finetune
    from megadiff.helper_processes import PREEMPTION_SIGNALS
    from megadiff.parallel import shutdown
    from tests.conftest import RENDEZVOUS_VARIABLES

    def held() -> dict:
        return {"signals": [str(signal.getsignal(sig)) for sig in PREEMPTION_SIGNALS],
                "environment": {key: os.environ.get(key) for key in RENDEZVOUS_VARIABLES}}

    seen = {"before": held(), "losses": []}
    for run in range(runs):
        output_dir = Path(output) / f"run-{run}"
        assert finetune(load_finetune_config(config, [f"output_dir={output_dir}", "train.iters=2"])) == 0
        seen["losses"].append([record["lm_loss"] for record in read_metrics(output_dir) if "lm_loss" in record])
        shutdown()
    seen["after"] = held()
    Path(report).write_text(json.dumps(seen))


def reported_by_a_plain_process(workspace: Path, function: str, *args) -> object:
    """function(*args, report) (one of this module's) run in a plain `python` process (no launcher's variables):
    what it wrote into `report` (JSON)."""
    from tests.conftest import RENDEZVOUS_VARIABLES

    report = workspace / f"report-{os.getpid()}-{function}.json"
    report.unlink(missing_ok=True)
    program = f"from tests.test_adapt_finetune import {function} as run; run(*{[*args, str(report)]!r})"
    env = {key: value for key, value in _env(workspace).items() if key not in RENDEZVOUS_VARIABLES}
    result = subprocess.run([sys.executable, "-c", program], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(report.read_text())


def adapted_in_one_process(workspace: Path, tmp_path: Path, runs: int) -> dict:
    """adaptations_in_one_process's report."""
    return reported_by_a_plain_process(workspace, "adaptations_in_one_process", str(workspace / "adapt.yaml"),
                                       str(tmp_path), runs)


def test_an_adaptation_leaves_its_process_s_signal_handlers_as_it_found_them(workspace, tmp_path):
    """After the run, SIGTERM ends the caller's process again (the run's handler, left installed, only noted it)."""
    seen = adapted_in_one_process(workspace, tmp_path, runs=1)
    assert seen["after"]["signals"] == seen["before"]["signals"]


def test_an_adaptation_leaves_no_rendezvous_variables_in_its_process(workspace, tmp_path):
    """A world of one sets RANK, WORLD_SIZE... for DeepSpeed: left after the run, the process's next process group
    (a pre-training run's, load_checkpoint's) failed without MASTER_PORT, and every process it started inherited
    them."""
    seen = adapted_in_one_process(workspace, tmp_path, runs=1)
    assert seen["after"]["environment"] == seen["before"]["environment"]


def test_a_second_adaptation_in_a_process_whose_group_was_released_trains_as_the_first(workspace, tmp_path):
    """A sweep driver adapts, pre-trains (whose end releases the process group), then adapts again: the second
    adaptation trains as the first did (it failed at its first broadcast, on DeepSpeed's clone of the released
    group)."""
    seen = adapted_in_one_process(workspace, tmp_path, runs=2)
    assert seen["losses"][1] == seen["losses"][0]


def interrupted_zero3_adaptation(config: str, output: str, report: str) -> None:
    """A ZeRO-3 adaptation interrupted at its first iteration (Ctrl-C) in this plain process, its exception kept as a
    notebook keeps the last one; then the base model loaded with from_pretrained, as the notebook goes on. Reports
    whether its weights are the model file's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import megadiff.adapt.finetune as finetune_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    finetune_module._train_iteration = interrupted
    cfg = load_finetune_config(config, [f"output_dir={output}", "deepspeed=configs/deepspeed/zero3.json"])
    interruptions = []
    try:
        finetune_module.finetune(cfg)
    except KeyboardInterrupt as error:
        interruptions.append(error)  # held, with its traceback's frames, as sys.last_value holds it
    loaded = AutoModelForCausalLM.from_pretrained(cfg.model.path).state_dict()
    saved = load_file(Path(cfg.model.path) / "model.safetensors")
    Path(report).write_text(json.dumps(sorted(name for name, tensor in saved.items()
                                              if not torch.equal(loaded[name], tensor))))


def test_an_interrupted_zero3_adaptation_leaves_from_pretrained_as_it_was(workspace, tmp_path):
    """The run's HfDeepSpeedConfig, kept alive by the interrupted run's traceback, kept transformers' ZeRO-3 on:
    the next from_pretrained in the process loaded through ZeRO-3's partitioning, and failed."""
    differing = reported_by_a_plain_process(workspace, "interrupted_zero3_adaptation", str(workspace / "adapt.yaml"),
                                            str(tmp_path / "run"))
    assert differing == []  # every weight as the file holds it
