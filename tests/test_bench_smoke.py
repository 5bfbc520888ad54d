"""bench/attention.py runs end to end: its CPU smoke mode, and a clean exit where CUDA is missing."""
from __future__ import annotations

import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    import bench.attention as module  # the repository root is on pytest's path
    return module


def test_cpu_smoke_writes_json_and_markdown(bench, tmp_path):
    assert bench.main(["--device", "cpu", "--small", "--backends", "sdpa", "sdpa_split_v", "reference",
                       "--dtype", "float32", "--sdpa-kernels", "math", "efficient", "--out-dir", str(tmp_path)]) == 0
    (report_path,) = tmp_path.glob("attention-*.json")
    rows = {r["method"]: r for r in json.loads(report_path.read_text())["rows"]}
    # the SDPA kernel each row ran: torch's choice (on a CPU, flash where V is as wide as Q and K), or the one
    # forced; a forced kernel that cannot take the call (efficient, off CUDA) fails its row only
    kernels = {"baseline-sdpa": "flash", "diff-sdpa": "math", "diff-sdpa-math": "math", "diff-sdpa_split_v": "flash",
               "diff-sdpa_split_v-math": "math", "diff-reference": None}
    assert set(rows) == set(kernels) | {"diff-sdpa-efficient", "diff-sdpa_split_v-efficient"}
    for method, kernel in kernels.items():
        row = rows[method]
        assert row["status"] == "ok" and row["sdpa_kernels"] == row["sdpa_kernels_fwd"] == kernel, row
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and math.isfinite(row["fwd_bwd_tflops"])
        # where the time goes: the largest first, the rest as "other" (on a CPU by op)
        times = row["fwd_bwd_kernel_ms"]
        ranked = [ms for name, ms in times.items() if name != "other"]
        assert len(ranked) == 6 and "other" in times and ranked == sorted(ranked, reverse=True) and min(ranked) > 0
    for method in ("diff-sdpa-efficient", "diff-sdpa_split_v-efficient"):
        assert rows[method]["status"].startswith("error: RuntimeError: No viable backend"), rows[method]
    assert rows["diff-sdpa"]["fwd_flop_vs_baseline"] == pytest.approx(1.5)  # two maps, V twice as wide, half the heads
    markdown = report_path.with_suffix(".md").read_text()
    assert markdown.count("| diff-") == 7
    assert "- diff-sdpa: `aten::" in markdown and "- baseline-sdpa: `aten::" in markdown


def test_document_rows_count_the_flops_of_their_documents(bench, tmp_path, monkeypatch):
    """Document-masked rows count their documents' FLOPs, and hand every timed call the same boundaries,
    as a micro-batch does its layers: the fused kernel reads a tensor's document bounds once, so a new
    tensor per call would time that read at every call."""
    boundaries = set()
    attention = bench.differential_attention
    monkeypatch.setattr(bench, "differential_attention", lambda *args, cu_seqlens=None, **kwargs:
                        boundaries.add(id(cu_seqlens)) or attention(*args, cu_seqlens=cu_seqlens, **kwargs))
    assert bench.main(["--device", "cpu", "--small", "--backends", "sdpa", "--dtype", "float32", "--documents", "16",
                       "--out-dir", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads(next(tmp_path.glob("attention-*.json")).read_text())["rows"]}
    masked, whole = rows["diff-sdpa-docs16"], rows["diff-sdpa"]
    assert masked["status"] == "ok" and masked["document_length"] == 16
    n = whole["seq"]  # 4 causal documents of 16 instead of one of 64: 4 x 16 x 17 / 2 pairs of 64 x 65 / 2
    assert masked["fwd_bwd_gflop"] / whole["fwd_bwd_gflop"] == pytest.approx(4 * 16 * 17 / (n * (n + 1)))
    assert len(boundaries) == 2  # None (the whole sequences) and the documents' one tensor
    with pytest.raises(SystemExit):
        bench.parse_args(["--small", "--documents", "24"])  # 64 tokens are not whole documents of 24


def test_flop_formula_matches_a_direct_count(bench):
    shape = bench.Shape(batch=2, seq=8, heads=3, d=4, dv=8, causal=False)
    fwd, bwd = bench.attention_flops(shape, maps=2, heads=3, dv=8)
    per_map_fwd = 2 * 8 * 8 * 4 + 2 * 8 * 8 * 8  # Q K^T, then P V
    assert fwd == 2 * 3 * 2 * per_map_fwd
    assert bwd == 2 * 3 * 2 * (3 * 2 * 8 * 8 * 4 + 2 * 2 * 8 * 8 * 8)  # S, dQ, dK; dP, dV


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_exits_cleanly_without_cuda(bench, capsys, tmp_path):
    assert bench.main(["--out-dir", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def _row(method, seq, batch=1, ratio=None, peak=None):
    return dict(method=method, seq=seq, batch=batch, status="ok", fwd_bwd_vs_baseline=ratio, peak_fwd_bwd_mib=peak)


def test_target_checks_judge_time_and_memory_growth(bench):
    rows = [_row("baseline-sdpa-cudnn", 4096, 2, 1.0, 100.0),
            _row("diff-triton", 4096, 2, 1.4, 96.0), _row("diff-triton", 16384, 1, 1.3, 200.0),
            _row("diff-triton", 65536, 1, 1.3, 800.0)]
    time_check, memory_check = bench.target_checks(rows)
    assert time_check["met"] and time_check["measured"] == 1.4  # the first (3B) shape's ratio
    assert memory_check["met"] and memory_check["measured"] == pytest.approx(800 / 65536 / (96 / 8192))
    rows[-1]["peak_fwd_bwd_mib"] = 3200.0  # quadratic growth from 16K to 64K
    rows[1]["fwd_bwd_vs_baseline"] = 1.6
    assert [c["met"] for c in bench.target_checks(rows)] == [False, False]
    assert bench.target_checks(rows, method="diff-sdpa") == []
