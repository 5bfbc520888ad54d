"""Differential attention vs the equal-size Transformer's attention: time, TFLOP/s, peak memory.

    python bench/attention.py                      # CUDA: the 3B head shape at N = 4K, 16K, 64K
    python bench/attention.py --documents 512      # also document masking, 512-token documents
    python bench/attention.py --device cpu --small # a tiny run that checks the script itself

Every differential backend (fused Triton kernel, SDPA wide-V, SDPA split-V) is
timed in the same run as the baseline: softmax attention with 2x the heads,
head dim d and V width d, through SDPA's cuDNN and flash kernels (the faster
one is the baseline). The SDPA backends run as torch chooses, and again with
each kernel of --sdpa-kernels forced (cuDNN on CUDA); every row says which SDPA
kernel ran. Results go to bench/results/attention-<device>-<date>.{json,md}.
FLOP formulas: see `attention_flops` and bench/README.md.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(ROOT))

from bench.report import (  # noqa: E402
    OUT_DIR_HELP, cuda_missing, default_out_dir, environment, kernel_times_ms, kernels_ran, markdown_table, software,
    tiles_tuned_here, timed_ms, write,
)
from megadiff.ops import SDPA_KERNELS, differential_attention, sdpa_kernel_order, softmax_attention  # noqa: E402
from megadiff.ops.sdpa import recording_sdpa_kernels  # noqa: E402


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int  # differential heads; the baseline has twice as many
    d: int      # head dim of one map (and of a baseline head)
    dv: int     # V width of a differential head
    causal: bool = True


FULL_SHAPES = (Shape(2, 4096, 12, 128, 256), Shape(1, 16384, 12, 128, 256), Shape(1, 65536, 12, 128, 256))
SMALL_SHAPES = (Shape(1, 64, 2, 16, 32),)


def attention_flops(shape: Shape, maps: int, heads: int, dv: int) -> tuple[float, float]:
    """Matmul FLOPs (fwd, bwd) of `heads` heads of `maps` softmax maps sharing V of width dv.

    Per visible (query, key) pair and map, 2 FLOPs per multiply-add: forward S = Q K^T (2d) and
    O = P V (2dv); backward (FlashAttention convention, S recomputed) S (2d), dP = dO V^T (2dv),
    dV = P^T dO (2dv), dQ = dS K (2d), dK = dS^T Q (2d). Causal: N(N+1)/2 visible pairs.
    """
    pairs = shape.seq * (shape.seq + 1) / 2 if shape.causal else shape.seq ** 2
    per_pair = shape.batch * heads * maps * pairs
    return per_pair * (2 * shape.d + 2 * dv), per_pair * (6 * shape.d + 4 * dv)


SDPA_BACKENDS = ("sdpa", "sdpa_split_v")  # the differential backends made of SDPA calls


def _baseline_kernels(device: torch.device) -> dict[str, list[str] | None]:
    """Baseline variants: cuDNN and flash on CUDA, whatever SDPA picks elsewhere."""
    return {"sdpa-cudnn": ["cudnn"], "sdpa-flash": ["flash"]} if device.type == "cuda" else {"sdpa": None}


def _baseline(kernels: list[str] | None, causal: bool) -> Callable:
    def run(q, k, v):
        with sdpa_kernel_order(kernels):
            return softmax_attention(q, k, v, causal=causal)
    return run


def _differential(backend: str, causal: bool, integral: bool, document_length: int | None = None,
                  kernels: list[str] | None = None) -> Callable:
    # one boundaries tensor per shape, as a training micro-batch hands the same one to every layer: the
    # kernel reads the document bounds once per tensor, which a new tensor per call would time each call
    boundaries: dict[tuple, torch.Tensor] = {}

    def run(q1, k1, q2, k2, v, lam):
        documents = None
        if document_length:  # every sample packed from documents of document_length tokens
            key = (q1.shape[0], q1.shape[1], q1.device)
            if key not in boundaries:
                boundaries[key] = torch.arange(0, q1.shape[0] * q1.shape[1] + 1, document_length, dtype=torch.int32,
                                               device=q1.device)
            documents = boundaries[key]
        with sdpa_kernel_order(kernels):
            return differential_attention(q1, k1, q2, k2, v, lam, causal=causal, integral=integral,
                                          backend=backend, cu_seqlens=documents)
    return run


def document_shape(shape: Shape, document_length: int | None) -> Shape:
    """The shape whose attention FLOPs a document-masked run does: one sample per document."""
    if not document_length:
        return shape
    return replace(shape, batch=shape.batch * shape.seq // document_length, seq=document_length)


def _inputs(shape: Shape, baseline: bool, device, dtype) -> tuple[torch.Tensor, ...]:
    b, n, h, d = shape.batch, shape.seq, shape.heads, shape.d

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype).requires_grad_()

    if baseline:
        return rand(b, n, 2 * h, d), rand(b, n, 2 * h, d), rand(b, n, 2 * h, d)
    lam = torch.full((h,), 0.5, device=device, requires_grad=True)
    return rand(b, n, h, d), rand(b, n, h, d), rand(b, n, h, d), rand(b, n, h, d), rand(b, n, h, shape.dv), lam


def _mean_ms(fn: Callable, device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):  # includes Triton's compilation and autotuning on first use
        fn()
    return timed_ms(fn, device, reps)


def _peak_mib(fn: Callable, device: torch.device) -> float | None:
    """Memory allocated beyond the inputs while fn runs (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def measure(fn: Callable, inputs: tuple, device, warmup: int, reps: int) -> dict:
    """Times and peak memory; with the SDPA kernels a training call and a no-grad call ran apart, as torch
    may choose otherwise for a call whose backward will not run (cuDNN's limits differ, for one)."""
    with recording_sdpa_kernels() as kernels:
        grad = torch.randn_like(fn(*inputs))
    with recording_sdpa_kernels() as forward_kernels, torch.no_grad():
        fn(*inputs)

    def forward():
        with torch.no_grad():
            fn(*inputs)

    def forward_backward():
        torch.autograd.grad(fn(*inputs), inputs, grad)

    return dict(sdpa_kernels=kernels_ran(kernels),  # which SDPA kernels ran: torch's choice, or the one forced
                sdpa_kernels_fwd=kernels_ran(forward_kernels),  # those of the fwd column, timed without grad
                fwd_ms=_mean_ms(forward, device, warmup, reps),
                fwd_bwd_ms=_mean_ms(forward_backward, device, warmup, reps),
                # which of the kernels a fwd+bwd launches takes the time: the fused kernel's forward, dK/dV, dQ
                fwd_bwd_kernel_ms=kernel_times_ms(forward_backward, device, min(reps, 3)),
                peak_fwd_mib=_peak_mib(forward, device), peak_fwd_bwd_mib=_peak_mib(forward_backward, device))


def _methods(args, device) -> dict[str, tuple[Callable, bool, int, int | None]]:
    """name -> (fn taking the inputs, is_baseline, number of softmax maps, document length or None)."""
    methods = {f"baseline-{name}": (_baseline(kernels, args.causal), True, 1, None)
               for name, kernels in _baseline_kernels(device).items()}
    for backend in args.backends:
        methods[f"diff-{backend}"] = (_differential(backend, args.causal, False), False, 2, None)
        if args.integral:
            methods[f"dint-{backend}"] = (_differential(backend, args.causal, True), False, 2, None)
        if args.documents:
            methods[f"diff-{backend}-docs{args.documents}"] = (
                _differential(backend, True, False, args.documents), False, 2, args.documents)
    # last: a kernel forced onto calls it has not run before could fail for good (a sticky CUDA error), which
    # ends the shape's rows
    for backend in (b for b in args.backends if b in SDPA_BACKENDS):
        for kernel in args.sdpa_kernels:
            methods[f"diff-{backend}-{kernel}"] = (_differential(backend, args.causal, False, kernels=[kernel]),
                                                   False, 2, None)
    return methods


def run_shape(shape: Shape, args, device, dtype) -> list[dict]:
    rows = []
    for name, (fn, is_baseline, maps, document_length) in _methods(args, device).items():
        heads, dv = (2 * shape.heads, shape.d) if is_baseline else (shape.heads, shape.dv)
        fwd_flops, bwd_flops = attention_flops(document_shape(shape, document_length), maps, heads, dv)
        row = dict(asdict(shape), method=name, baseline=is_baseline, fwd_gflop=fwd_flops / 1e9,
                   fwd_bwd_gflop=(fwd_flops + bwd_flops) / 1e9, document_length=document_length)
        try:
            row.update(measure(fn, _inputs(shape, is_baseline, device, dtype), device, args.warmup, args.reps))
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = (fwd_flops + bwd_flops) / row["fwd_bwd_ms"] / 1e9
            row["status"] = "ok"
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as error:  # noqa: BLE001 -- one failing method must not lose the others' numbers
            row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        print(f"  {name:<24} {_brief(row)}", flush=True)
        rows.append(row)
        if device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except RuntimeError as error:  # a sticky CUDA error (an illegal access): the device is lost for good
                print(f"  the device failed ({str(error).splitlines()[0][:200]}); keeping the rows measured",
                      flush=True)
                break
    _add_ratios(rows)
    return rows


def _brief(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    return f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms, {row['fwd_bwd_tflops']:.1f} TFLOP/s"


def _add_ratios(rows: list[dict]) -> None:
    """Time and FLOPs relative to the fastest baseline of the same shape (> 1: more than the baseline)."""
    baselines = [r for r in rows if r["baseline"] and r["status"] == "ok"]
    if not baselines:
        return
    for pass_ in ("fwd", "fwd_bwd"):
        best = min(baselines, key=lambda r: r[f"{pass_}_ms"])
        for row in rows:
            row[f"{pass_}_flop_vs_baseline"] = row[f"{pass_}_gflop"] / best[f"{pass_}_gflop"]
            if row["status"] == "ok":
                row[f"{pass_}_vs_baseline"] = row[f"{pass_}_ms"] / best[f"{pass_}_ms"]


COLUMNS = (("method", "method", "{}"), ("SDPA kernel", "sdpa_kernels", "{}"), ("fwd's", "sdpa_kernels_fwd", "{}"),
           ("fwd+bwd FLOPs x baseline", "fwd_bwd_flop_vs_baseline", "{:.2f}"),
           ("fwd ms", "fwd_ms", "{:.3f}"), ("fwd+bwd ms", "fwd_bwd_ms", "{:.3f}"),
           ("fwd TFLOP/s", "fwd_tflops", "{:.3g}"), ("fwd+bwd TFLOP/s", "fwd_bwd_tflops", "{:.3g}"),
           ("peak fwd+bwd MiB", "peak_fwd_bwd_mib", "{:.0f}"), ("fwd x baseline", "fwd_vs_baseline", "{:.2f}"),
           ("fwd+bwd x baseline", "fwd_bwd_vs_baseline", "{:.2f}"), ("status", "status", "{}"))


TIME_TARGET = 1.5      # fused fwd+bwd at the first shape (the 3B one) over the baseline's time
MEMORY_SPREAD = 1.25   # "linear in N": peak MiB per token may vary this much across N


def target_checks(rows: list[dict], method: str = "diff-triton") -> list[dict]:
    """Issue 6's targets for `method`, from this run's rows: the time ratio at the first shape,
    and whether its peak fwd+bwd memory per token stays flat as N grows (linear in N)."""
    mine = [r for r in rows if r["method"] == method and r["status"] == "ok"]
    if not mine:
        return []
    first = mine[0]
    checks = []
    if first.get("fwd_bwd_vs_baseline") is not None:
        checks.append(dict(target=f"{method} fwd+bwd time / baseline at N={first['seq']}",
                           measured=first["fwd_bwd_vs_baseline"], bound=f"<= {TIME_TARGET}",
                           met=first["fwd_bwd_vs_baseline"] <= TIME_TARGET))
    per_token = {r["seq"]: r["peak_fwd_bwd_mib"] / (r["batch"] * r["seq"]) * 1024
                 for r in mine if r.get("peak_fwd_bwd_mib")}
    if len(per_token) > 1:
        spread = max(per_token.values()) / min(per_token.values())
        checks.append(dict(target=f"{method} peak fwd+bwd MiB per 1K tokens, N = "
                                  + ", ".join(f"{n}: {v:.1f}" for n, v in per_token.items()),
                           measured=spread, bound=f"max/min <= {MEMORY_SPREAD} (linear in N)",
                           met=spread <= MEMORY_SPREAD))
    return checks


def _shape_of(row: dict) -> Shape:
    return Shape(**{f.name: row[f.name] for f in fields(Shape)})


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Attention benchmark, {env['device']}", "",
             f"{env['date']}; {software(env)}, dtype {report['dtype']}. Times are means over repeated runs; "
             "\"x baseline\" divides by the fastest baseline of the same shape. FLOPs are counted as in "
             "bench/README.md.", ""]
    for shape in dict.fromkeys(_shape_of(r) for r in report["rows"]):
        lines += [f"## B={shape.batch}, N={shape.seq}, {shape.heads} differential heads (baseline "
                  f"{2 * shape.heads}), d={shape.d}, dv={shape.dv}, {'causal' if shape.causal else 'non-causal'}",
                  ""]
        rows = [r for r in report["rows"] if _shape_of(r) == shape]
        lines += markdown_table(COLUMNS, rows)
        lines += ["", "Where each fwd+bwd's time goes (ms a call, by kernel; profiled apart from the timings):", ""]
        lines += [f"- {r['method']}: " + ", ".join(f"`{name}` {ms:.3f}" for name, ms in r["fwd_bwd_kernel_ms"].items())
                  for r in rows if r.get("fwd_bwd_kernel_ms")]
        lines.append("")
    if report.get("targets"):
        lines += ["## Targets (issue 6)", ""]
        lines += [f"- {c['target']}: **{c['measured']:.3f}** ({c['bound']}): {'met' if c['met'] else 'MISSED'}"
                  for c in report["targets"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="one tiny shape: checks the script, not the speed")
    parser.add_argument("--backends", nargs="+", help="differential backends (default: triton sdpa sdpa_split_v "
                        "on CUDA; sdpa sdpa_split_v reference on CPU)")
    parser.add_argument("--sdpa-kernels", nargs="*", choices=tuple(SDPA_KERNELS), default=None,
                        help="also time the SDPA backends with each of these SDPA kernels forced (default: cudnn on "
                        "CUDA, none elsewhere); their rows fail, saying so, where the kernel does not take the call")
    parser.add_argument("--integral", action="store_true", help="also time DINT (the integral term)")
    parser.add_argument("--documents", type=int, metavar="LEN", help="also time each differential backend with "
                        "document masking, every sample packed from documents of LEN tokens (a divisor of N)")
    parser.add_argument("--non-causal", dest="causal", action="store_false")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=None, help=OUT_DIR_HELP)
    args = parser.parse_args(argv)
    args.out_dir = args.out_dir or default_out_dir(args.small)
    shapes = SMALL_SHAPES if args.small else FULL_SHAPES
    if args.documents and (not args.causal or any(shape.seq % args.documents for shape in shapes)):
        parser.error(f"--documents needs causal attention and a length dividing every N "
                     f"({', '.join(str(shape.seq) for shape in shapes)})")
    on_cuda = args.device == "cuda"
    args.backends = args.backends or (["triton", "sdpa", "sdpa_split_v"] if on_cuda
                                      else ["sdpa", "sdpa_split_v", "reference"])
    args.sdpa_kernels = args.sdpa_kernels if args.sdpa_kernels is not None else (["cudnn"] if on_cuda else [])
    args.warmup = args.warmup if args.warmup is not None else (3 if on_cuda else 1)
    args.reps = args.reps if args.reps is not None else (10 if on_cuda else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if cuda_missing(args.device, "bench/attention.py"):
        return 0
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    report = dict(environment=environment(device), dtype=args.dtype, rows=[],
                  flops=attention_flops.__doc__.strip().replace("\n    ", " "))
    for shape in SMALL_SHAPES if args.small else FULL_SHAPES:
        shape = replace(shape, causal=args.causal)
        print(f"{shape}", flush=True)
        report["rows"] += run_shape(shape, args, device, dtype)
        report["targets"] = target_checks(report["rows"])
        report["triton_tiles"] = tiles_tuned_here(device)  # the fused kernel's timings come with its tiles
        name = f"attention-docs{args.documents}" if args.documents else "attention"
        path = write(name, report, markdown(report), args.out_dir)  # after each shape: kept if cut short
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
