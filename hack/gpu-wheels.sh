#!/usr/bin/env bash
# Wheels of the engine's packages that a GPU machine's PyTorch image may lack, for a machine with no
# package index (docs/gpu.md): pydantic and what it needs, at the versions this checkout's venv runs,
# for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored). There:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 hack/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
pins=()
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    pins+=("$pkg==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")")
done
mkdir -p .whl
platforms=()
for n in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${n}_x86_64")
done
echo "[gpu-wheels] ${pins[*]} for CPython $PYVER -> .whl/" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls -1 .whl >&2
