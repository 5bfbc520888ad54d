#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root. A session holds the GPU for 15 minutes of device
# time in all (a start takes 1-2 of them) and one call for at most 10, so two calls in a row, the second on the
# still warm machine, do issue 6's measurements and the kernel tests:
#   bash bench/run_on_gpu.sh measure            # at most 550 s: the attention benchmark (SDPA as torch chooses and
#                                               #   with cuDNN forced) and the whole model in BF16, DIFF once per
#                                               #   attention backend (fused, SDPA wide-V, split-V), every tile
#                                               #   candidate tuned
#   bash bench/run_on_gpu.sh tests              # at most 270 s (150 s): kernel/float8/TE/memory GPU tests
# or, in one call:
#   bash bench/run_on_gpu.sh quick              # at most 560 s (241 s on an H100, 2026-11-26): the attention
#                                               #   benchmark (150 s), the kernel tests (150 s), the whole-model
#                                               #   benchmark in BF16 (230 s), each kernel's autotuner measuring
#                                               #   its first 3 fitting tile candidates (MEGADIFF_TRITON_CANDIDATES=3)
# then, with what time is left (a warm machine; none starts with under 4 minutes left), any of the
# full stages, each under 10 minutes:
#   bash bench/run_on_gpu.sh attention          # 540 s: the attention benchmark with DINT rows, all candidates
#   bash bench/run_on_gpu.sh model              # 560 s: the whole-model benchmark, BF16 and FP8, all candidates
#   bash bench/run_on_gpu.sh training           # 300 s: the user's commands (pretrain/resume/convert/generate) on
#                                               #   CUDA; one tile candidate each (correctness), as every command
#                                               #   tunes afresh
#   bash bench/run_on_gpu.sh documents          # 400 s: document masking, 512-token documents (fused
#                                               #   kernel vs per-document SDPA)
# Installs the wheels carried in .whl/ (made here by bench/fetch_wheels.sh), then writes the results
# (bench JSON + Markdown, one log) to $OUT, or to bench/results when OUT is unset.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
wheels=${WHEEL_DIR:-.whl}
stages=${*:-quick}
mkdir -p "$out"
log="$out/run_on_gpu.log"
: > "$log"
status=0
{ echo "python $(python3 -V 2>&1 | cut -d' ' -f2)"; nvidia-smi -L 2>&1 | head -1; } | tee -a "$log"
if [ -f "$wheels/requirements.txt" ]; then
  # before the CUDA check, so that a CPU machine can rehearse it (bench/README.md). One package at a time,
  # pip choosing each wheel whose tags fit this Python: a package that does not install costs the stages
  # that need it (they fail naming the import), not the others; </dev/null keeps pip off the loop's input
  while read -r requirement; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      --find-links "$wheels" "$requirement" </dev/null 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "== $requirement did not install (above)" | tee -a "$log"; status=1; }
  done < "$wheels/requirements.txt"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# what the stages will import (the carried wheels first; megatron where installed), its warnings aside
python3 -W ignore -c 'import importlib.util, torch, triton
print("torch", torch.__version__, "triton", triton.__version__)
if importlib.util.find_spec("megatron"):
    import megatron.core
    print("megatron-core", megatron.core.__version__)' 2>&1 | tee -a "$log"
if ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "== no CUDA device visible to torch: nothing to measure" | tee -a "$log"; exit 1
fi
run() {  # run <seconds> <command...>: one stage, its output appended to the log
  echo "== $*" | tee -a "$log"
  timeout -k 10 "$1" "${@:2}" 2>&1 | tee -a "$log"  # -k: a stage ignoring SIGTERM (stuck in NCCL) is killed
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== exit $rc: $*" | tee -a "$log"; status=1; }
}
# -v: a stage cut short by its timeout still says which tests passed; the project's addopts ask for
# pytest-timeout, which the image may lack (the stage's own timeout bounds it)
gpu_pytest=(python3 -m pytest -m gpu -v -ra -o addopts= -p no:cacheprovider)
for stage in $stages; do
  case $stage in
    quick) export MEGADIFF_TRITON_CANDIDATES=3
           run 150 python3 bench/attention.py --out-dir "$out"
           # correctness needs no tuning: one candidate per kernel, 17 compiles for the test grid
           MEGADIFF_TRITON_CANDIDATES=1 run 150 "${gpu_pytest[@]}" tests/test_triton_kernel.py
           run 230 python3 bench/model.py --precisions bf16 --steps 5 --out-dir "$out"
           unset MEGADIFF_TRITON_CANDIDATES ;;
    # correctness: one candidate per kernel. Untuned, the diff half of the training test ran past 300 s
    # (2026-11-26): each of its seven commands is a process whose autotuner measures every candidate anew
    tests) MEGADIFF_TRITON_CANDIDATES=1 run 270 "${gpu_pytest[@]}" tests/test_triton_kernel.py tests/test_float8.py \
             tests/test_transformer_engine.py tests/test_memory.py ;;
    # the two benchmarks in one call, every candidate tuned: the attention benchmark (cut short, it keeps the
    # shapes it finished: 4K and 16K), then the model's runs, whose DIFF kernels reuse the tiles tuned at 4K
    # (the autotuner's choice is cached on disk by its key, which holds no batch size). The SDPA rows: wide-V
    # took 1.18x split-V's time at 64K (which ran at twice cuDNN's softmax time); which kernel each ran, and
    # whether this torch lets cuDNN take V 256 wide with Q and K 128 (current torch: forward only), is what the
    # rows' SDPA kernel and the cuDNN rows say
    measure) run 270 python3 bench/attention.py --out-dir "$out"
             run 280 python3 bench/model.py --precisions bf16 --diff-backends triton sdpa sdpa_split_v \
               --out-dir "$out" ;;
    attention) run 540 python3 bench/attention.py --integral --out-dir "$out" ;;
    model) run 560 python3 bench/model.py --out-dir "$out" ;;
    # each command's output goes to $out/commands as it runs: a stage cut short still shows how far it got
    training) MEGADIFF_TEST_OUTPUT_DIR="$out/commands" MEGADIFF_TRITON_CANDIDATES=1 \
                run 300 "${gpu_pytest[@]}" tests/test_gpu_training.py ;;
    documents) run 400 python3 bench/attention.py --documents 512 --backends triton sdpa --out-dir "$out" ;;
    *) echo "unknown stage $stage (quick | measure | attention | tests | model | training | documents)"; exit 2 ;;
  esac
done
exit $status
