"""Registers, spills and shared memory of the fused kernels' autotune candidates, compiled for a GPU
architecture without needing that GPU (Triton's compiler and ptxas run anywhere).

    python bench/kernel_resources.py                  # sm_90 (H100/H200), the 3B head shape d=128, dv=256
    python bench/kernel_resources.py --d 64 --dv 128 --arch 80
    python bench/kernel_resources.py --documents      # the kernels' document-masking mode
    python bench/kernel_resources.py --dtype fp32     # fp32 inputs (true fp32 dots: more shared memory)

A candidate that spills many bytes per thread ("stack") or needs more shared memory than the GPU
has is a poor tile choice; the autotuner measures the rest. Compiling takes seconds per candidate.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(ROOT))

from megadiff.ops import triton_bwd, triton_fwd  # noqa: E402

KERNELS = {"fwd": (triton_fwd._fwd_kernel, {"COMBINE": True, "DOCUMENTS": False}),
           "dkdv": (triton_bwd._dkdv_kernel, {"TIED": True, "DOCUMENTS": False, "SPLIT": False}),
           "dq": (triton_bwd._dq_kernel, {"TIED": True, "DOCUMENTS": False})}
FP32_POINTERS = {"LSE1", "LSE2", "DELTA1", "DELTA2", "LAM"}
INT32_POINTERS = {"DOC_START", "DOC_END"}
SCALARS = {"qk_scale": "fp32", "scale": "fp32"}  # every other lower-case argument is an int32 size or stride
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # Triton's names -> torch's


def signature(kernel, constexprs: dict, dtype: str) -> dict[str, str]:
    """Triton types of the kernel's arguments: tensors are the upper-case names."""
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.isupper() or name[0].isupper():
            return "*fp32" if name in FP32_POINTERS else "*i32" if name in INT32_POINTERS else f"*{dtype}"
        return SCALARS.get(name, "i32")
    return {name: kind(name) for name in kernel.arg_names}


def aligned_arguments(kernel, types: dict[str, str]) -> dict:
    """Every pointer and stride divisible by 16, as Triton specializes them at a launch on contiguous tensors
    of the 3B shape: alignment lets the pipeliner stream tiles with asynchronous copies, which takes a buffer
    per stage (262144 bytes for the dQ kernel's 128x64 tile in bf16, 196608 unaligned; the H200 launch needed
    262144, 2026-11-27) and spills far fewer registers."""
    return {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
            if types[name].startswith("*") or name.startswith("stride")}


def compile_candidate(kind: str, block_m: int, block_n: int, num_warps: int, num_stages: int, *, d: int, dv: int,
                      arch: int, causal: bool = True, dtype: str = "bf16", **flags):
    """flags override the kernel's mode constexprs (TIED, COMBINE, DOCUMENTS)."""
    kernel, modes = KERNELS[kind]
    constexprs = dict(HEAD_D=d, HEAD_DV=dv, BLOCK_D=triton_fwd.padded_dim(d), BLOCK_DV=triton_fwd.padded_dim(dv),
                      CAUSAL=causal, DOT_PREC=triton_fwd.dot_precision(DTYPES[dtype]), BLOCK_M=block_m,
                      BLOCK_N=block_n, **{**modes, **flags})
    types = signature(kernel, constexprs, dtype)
    source = ASTSource(kernel, types, constexprs=constexprs, attrs=aligned_arguments(kernel, types))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **triton_fwd.COMPILE_OPTIONS))


def resource_usage(compiled, workdir: Path) -> dict:
    """Registers and spill stack per thread from the cubin (cuobjdump ships with Triton)."""
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", text, re.S)
    return dict(registers=int(found[1]), stack_bytes=int(found[2]), shared_bytes=compiled.metadata.shared)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dv", type=int, default=256)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--all", action="store_true", help="also the candidates the autotuner prunes")
    parser.add_argument("--documents", action="store_true", help="the document-masking mode (data.document_masking)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="the inputs' dtype")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"sm_{args.arch}, d={args.d}, dv={args.dv}, {args.dtype}, "
              f"causal{', documents' if args.documents else ''}")
        print(f"{'kernel':<6} {'block_m':>7} {'block_n':>7} {'warps':>5} {'stages':>6} {'split':>5} {'regs':>5} "
              f"{'stack B':>8} {'smem KiB':>8}  autotuned")
        for kind in args.kernels:
            fits = triton_fwd.fitting_candidates(kind, args.d, args.dv)
            for candidate in triton_fwd.CANDIDATES[kind] if args.all else fits:
                block_m, block_n, warps, stages, *split = candidate
                flags = {"SPLIT": True} if any(split) else {}
                usage = resource_usage(compile_candidate(kind, block_m, block_n, warps, stages, d=args.d, dv=args.dv,
                                                         arch=args.arch, dtype=args.dtype, DOCUMENTS=args.documents,
                                                         **flags), Path(tmp))
                print(f"{kind:<6} {block_m:>7} {block_n:>7} {warps:>5} {stages:>6} {'yes' if split else '':>5} "
                      f"{usage['registers']:>5} {usage['stack_bytes']:>8} {usage['shared_bytes'] / 1024:>8.0f}  "
                      f"{'yes' if candidate in fits else 'pruned'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
