"""The user's path on a GPU, as commands: pre-train (NCCL, bf16, checkpoints, evaluation), stop and
resume (profiling an iteration), convert to Hugging Face with its logits check, generate,
evaluate, activation outliers, needle retrieval. Everything CUDA-only that the CPU
suite cannot reach runs here: the NCCL collectives on the loss and the stop flag, the model's move
to the GPU, CUDA RNG states in checkpoints, the fused kernel inside the model, and inference and
conversion on a machine where megatron computes on the GPU."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from megadiff.checkpoint.format import read_latest_iteration
from megadiff.observability.metrics import read_metrics
from tests.conftest import kjv_verses
from tests.pretrain_runs import run_command, run_pretrain, tiny_overrides

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ITERS, STOP_AT = 6, 3


@pytest.fixture(scope="module")
def kjv_prefix(small_tokenizer_dir, tmp_path_factory) -> str:
    """KJV verses as a prepared dataset, written here rather than by prepare-data: the GPU machine
    lacks `datasets` (and a recent enough pyarrow for it), which prepare-data reads text with."""
    from megadiff.data.indexed import AtomicIndexedWriter, token_dtype
    from megadiff.data.tokenize_workers import encode_documents
    from megadiff.data.tokenizers import load_tokenizer

    dtype = token_dtype(load_tokenizer(str(small_tokenizer_dir)).vocab_size)
    ids, lengths = encode_documents(kjv_verses()[:4000], str(small_tokenizer_dir), dtype.name)
    prefix = tmp_path_factory.mktemp("kjv") / "kjv"
    with AtomicIndexedWriter(prefix, dtype) as writer:
        writer.add_documents(ids, lengths)
        writer.commit()
    return str(prefix)


def _megadiff(*args: str) -> subprocess.CompletedProcess:
    proc = run_command([sys.executable, "-m", "megadiff", *args], timeout=300)
    assert proc.returncode == 0, (f"megadiff {args[0]}: exit {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.mark.parametrize("variant", ["diff", "softmax"])
def test_pretrain_resume_convert_generate_on_gpu(variant, small_tokenizer_dir, kjv_prefix, tmp_path):
    out = tmp_path / variant
    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + [
        "data.bundled_corpus=null", f"data.prefix={kjv_prefix}", f"model.variant={variant}",
        "train.precision=bf16", f"train.iters={ITERS}", "train.eval_interval=2", "train.eval_iters=1",
        "checkpoint.save_interval=2", f"output_dir={out}"]
    run_pretrain(1, overrides + [f"train.exit_interval={STOP_AT}"])
    assert read_latest_iteration(out / "checkpoints") == STOP_AT
    # the resumed run also profiles one iteration, with a CUDA memory snapshot
    profiled = ITERS - 1
    run_pretrain(1, overrides + [f"logging.profile_iterations=[{profiled},{profiled}]", "logging.profile_memory=true"])
    assert read_latest_iteration(out / "checkpoints") == ITERS
    steps = [record for record in read_metrics(out) if "lm_loss" in record]
    assert len(steps) == ITERS and all(math.isfinite(record["lm_loss"]) for record in steps)
    assert all(0 < record["max_memory_allocated_gib"] <= record["max_memory_reserved_gib"] for record in steps)

    hf_dir = tmp_path / f"{variant}-hf"
    converted = _megadiff("convert", "to-hf", "--load", str(out), "--save", str(hf_dir))
    assert "check passed" in converted.stdout
    sample = _megadiff("generate", "--load", str(out), "--prompt", "In the beginning", "--max-new-tokens", "8")
    assert sample.stdout.startswith("In the beginning")
    if variant == "diff":  # one evaluate run: bench/run_on_gpu.sh gives this test 300 s in all
        report_file = tmp_path / "evaluation.json"
        _megadiff("evaluate", "--load", str(out), "--sequences", "4", "--batch-size", "2", "--output", str(report_file))
        report = json.loads(report_file.read_text())
        assert math.isfinite(report["loss"]) and report["tokens"] == 4 * report["seq_length"]
        outliers_file = tmp_path / "outliers.json"  # statistics kept on the GPU while streaming
        _megadiff("outliers", "--load", str(out), "--sequences", "2", "--output", str(outliers_file))
        outliers = json.loads(outliers_file.read_text())
        assert outliers["attention_logits"]["top_1"] >= outliers["attention_logits"]["median"] > 0
        needles_file = tmp_path / "needles.json"  # answer-position logits and attention rows on the GPU
        _megadiff("needles", "--load", str(out), "--lengths", "256", "--depths", "0", "1", "--trials", "1",
                  "--attention", "--output", str(needles_file))
        needles = json.loads(needles_file.read_text())
        assert np.shape(needles["accuracy"]) == np.shape(needles["attention_noise"]) == (1, 2)

    window = f"rank0-iters{profiled}-{profiled}"
    trace = json.loads((out / "profile" / f"trace-{window}.json").read_text())["traceEvents"]
    kernels = {event["name"] for event in trace if event.get("cat") == "kernel"}
    assert kernels  # CUDA kernels were recorded
    if variant == "diff":  # the fused differential attention runs inside the model
        assert all(any(name.startswith(kernel) for name in kernels) for kernel in ("_fwd_kernel", "_dq_kernel"))
    assert (out / "profile" / f"memory-{window}.pickle").stat().st_size > 0
