"""bench/model.py runs end to end: its CPU smoke mode, the equal-size softmax twin, a clean exit without CUDA."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "model.py"


@pytest.fixture(scope="module")
def bench():
    import bench.model as module  # the repository root is on pytest's path
    return module


def test_cpu_smoke_writes_json_and_markdown(tmp_path):
    """In a subprocess: the benchmark initialises megatron's CPU mode, which must not leak into pytest."""
    precisions = ["bf16", "fp8"] if importlib.util.find_spec("torchao") else ["bf16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--precisions", *precisions,
                           "--diff-backends", "sdpa", "sdpa_split_v", "--out-dir", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("model-*.json")
    report = json.loads(path.read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert set(rows) == {f"{v}-{p}" for v in ("softmax", "diff[sdpa]", "diff[sdpa_split_v]") for p in precisions}
    # the SDPA kernels each model's attention ran, as torch chose them on a CPU (flash needs V as wide as Q)
    assert [rows[f"{v}-bf16"]["sdpa_kernels"] for v in ("softmax", "diff[sdpa]", "diff[sdpa_split_v]")] == \
        ["flash", "math", "flash"]
    steps = report["setup"]["warmup"] + report["setup"]["steps"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert len(row["losses"]) == steps and all(map(math.isfinite, row["losses"]))
        # a linear warmup over the run, as pretraining's scheduler steps it: the last step at the peak lr
        assert row["lrs"] == pytest.approx([3e-4 * (i + 1) / steps for i in range(steps)])
        assert row["tokens_per_s"] > 0 and row["tflops_per_device"] > 0
        # a step beyond the curve, profiled: its time by op on a CPU, the 12 largest and the rest
        assert len(row["step_kernel_ms"]) == 13 and min(row["step_kernel_ms"].values()) > 0
    assert {"diff[sdpa]-bf16 / softmax-bf16 tokens/s", "diff[sdpa_split_v]-bf16 / softmax-bf16 tokens/s"} <= \
        set(report["ratios"])
    if "fp8" in precisions:  # the same initial weights and data: float8 starts from BF16's loss
        assert rows["diff[sdpa]-fp8"]["first_loss"] == pytest.approx(rows["diff[sdpa]-bf16"]["first_loss"], rel=2e-2)
        assert report["ratios"]["diff[sdpa]-fp8 / diff[sdpa]-bf16 tokens/s"] == rows["diff[sdpa]-fp8"]["vs_bf16"] > 0
    markdown = path.with_suffix(".md").read_text()
    assert markdown.count("| diff[") == 2 * len(precisions) and "## Ratios" in markdown
    assert markdown.count("\n- diff[sdpa]-bf16: `") == 1


def test_softmax_twin_has_the_same_widths(bench):
    args = bench.parse_args(["--device", "cpu", "--small"])
    diff = bench.run_config(args, bench.Run("diff", "bf16")).model
    twin = bench.run_config(args, bench.Run("softmax", "bf16")).model
    assert (twin.variant, twin.num_attention_heads) == ("softmax", 2 * diff.num_attention_heads)
    assert (twin.hidden_size, twin.num_layers, twin.ffn_hidden_size) == (diff.hidden_size, diff.num_layers,
                                                                         diff.ffn_hidden_size)
    counts = [bench.count_parameters(m) for m in (diff, twin)]
    # equal up to DIFF's lambda vectors and head-norm weight (6 d per layer)
    assert counts[0].total - counts[1].total == diff.num_layers * 6 * bench.resolved_head_dim(diff)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_exits_cleanly_without_cuda(bench, capsys, tmp_path):
    assert bench.main(["--out-dir", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_a_run_whose_process_dies_is_recorded_and_the_next_still_runs(bench):
    """Each run has its own process (megatron's DDP keeps an engine alive in the one that built it)."""
    broken = bench.parse_args(["--device", "cpu", "--small", "--set", "model.no_such_key=1"])
    row = bench.measure_in_own_process(broken, bench.Run("diff", "bf16"))
    assert row["run"] == "diff-bf16" and row["status"].startswith("error: ConfigError: ")
    assert "model.no_such_key" in row["status"]
    dying = bench.parse_args(["--device", "cpu", "--small"])
    dying.device = "no-such-device"  # torch.device() raises before any row exists
    row = bench.measure_in_own_process(dying, bench.Run("diff", "bf16"))
    assert row["status"] == "error: its process died (exit code 1)"
    args = bench.parse_args(["--device", "cpu", "--small", "--steps", "1"])
    row = bench.measure_in_own_process(args, bench.Run("diff", "bf16"))
    assert row["status"] == "ok" and len(row["losses"]) == args.warmup + args.steps
