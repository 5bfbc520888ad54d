"""What every benchmark script shares: the run's environment, timing, and writing its results.

Results go to bench/results/<benchmark>-<device>-<date>.json with a Markdown twin (.md).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Callable

import torch

from megadiff.ops.common import TRITON_CANDIDATES_ENV

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OUT_DIR_HELP = "default: bench/results, or runs/bench for --small (a check of the script, not a measurement)"


def default_out_dir(small: bool) -> Path:
    return RESULTS_DIR.parents[1] / "runs" / "bench" if small else RESULTS_DIR


def environment(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return dict(device=name, torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                # which SDPA kernels take a call, and torch's default order of them, depend on it
                cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                date=datetime.date.today().isoformat(), python=platform.python_version(),
                # how many tile candidates each kernel's autotuner measured (all: unset)
                triton_candidates=os.environ.get(TRITON_CANDIDATES_ENV, "all"))


def software(env: dict) -> str:
    """The environment's versions, for a report's heading."""
    return f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}"


def kernels_ran(record: list[str]) -> str | None:
    """What megadiff.ops.sdpa.recording_sdpa_kernels saw, each kernel once in order ('cudnn+flash'); None
    where no SDPA call was made (the fused kernel)."""
    return "+".join(dict.fromkeys(record)) or None


def cuda_missing(device: str, script: str) -> bool:
    """True, after saying so, when CUDA is asked for and there is none: nothing to measure."""
    if device != "cuda" or torch.cuda.is_available():
        return False
    print(f"{script}: no CUDA device here, nothing to measure. "
          "Run it on a GPU machine, or `--device cpu --small` to check the script.")
    return True


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn: Callable, device: torch.device, reps: int) -> float:
    """Mean wall time of fn over reps, in ms (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - begin) * 1e3 / reps


KERNEL_NAME_CHARS = 60  # cuDNN's kernel names run to hundreds of characters


def kernel_times_ms(fn: Callable, device: torch.device, reps: int, top: int = 6) -> dict[str, float]:
    """Where fn's time goes: the mean time a call of each kernel it launches takes (on CUDA; on a CPU, of each
    op), the `top` largest by name, the rest summed as "other". fn runs compiled and tuned already."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as profiled:
        for _ in range(reps):
            fn()
        synchronize(device)
    times: dict[str, float] = {}
    for event in profiled.key_averages():
        # on CUDA the kernels alone: an op's device time is its kernels', counted with them
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if us > 0 and (event.device_type == DeviceType.CUDA or not on_cuda):
            name = event.key[:KERNEL_NAME_CHARS]
            times[name] = times.get(name, 0.0) + us / 1e3 / reps
    ranked = sorted(times.items(), key=lambda item: -item[1])
    kept = dict(ranked[:top])
    if len(ranked) > top:
        kept["other"] = sum(ms for _, ms in ranked[top:])
    return kept


def markdown_table(columns, rows: list[dict]) -> list[str]:
    """columns: (title, key, format) triples; a missing value prints as '-'."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tiles_tuned_here(device: torch.device) -> dict:
    """The tiles the fused kernel's autotuner chose in this process (none off CUDA): what its timings were
    measured with, for a report to carry."""
    if device.type != "cuda":
        return {}
    from megadiff.ops.triton_kernel import tuned_tiles
    return tuned_tiles()


def write(benchmark: str, report: dict, markdown: str, out_dir: Path) -> Path:
    """<out_dir>/<benchmark>-<device>-<date>.json and .md; returns the JSON path."""
    env = report["environment"]
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    path = out_dir / f"{benchmark}-{slug}-{env['date']}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown)
    return path
