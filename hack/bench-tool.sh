#!/usr/bin/env bash
# Installs an off-the-shelf LLM benchmark tool (guidellm, pinned) into its OWN virtualenv under
# ~/.cache/consort/bench-tools/<tool>, so its dependencies (datasets, sanic, a torch of its
# choosing...) never touch the project's .venv. Idempotent: a stamp keyed on the pin and this
# script skips pip entirely on a second run. Prints the tool's executable on stdout.
#
# guidellm hard-depends on torch; the CUDA wheels `make images` caches in ~/.cache/consort/wheels
# are offered first (--find-links), so a warm machine downloads only the small packages.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOL=${BENCH_TOOL:-guidellm}
CACHE=${CACHE:-$HOME/.cache/consort}
PY=${PYTHON:-python3}
case "$TOOL" in
  guidellm) SPEC="guidellm==0.8.1" ;;
  *) echo "bench-tool: unknown tool $TOOL (supported: guidellm)" >&2; exit 2 ;;
esac
VENV=$CACHE/bench-tools/$TOOL
stamp=$VENV/.consort-installed
want=$(printf '%s\n' "$SPEC" | cat - hack/bench-tool.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/$TOOL" ]; then
  echo "$VENV/bin/$TOOL"
  exit 0
fi
command -v "$PY" >/dev/null || { echo "bench-tool: $PY not found (need Python >= 3.10)" >&2; exit 1; }
echo "bench-tool: installing $SPEC into $VENV (own venv; torch makes the first run take minutes)" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
links=()
[ -d "$CACHE/wheels" ] && links=(--find-links "$CACHE/wheels")
if ! "$VENV/bin/pip" install --progress-bar off -q "${links[@]}" "$SPEC" >&2; then
  echo "bench-tool: pip install $SPEC failed (is PyPI reachable?)" >&2; exit 1
fi
"$VENV/bin/$TOOL" --help >/dev/null   # fails here, not mid-benchmark, if the install is broken
echo "$want" > "$stamp"
echo "bench-tool: $SPEC installed in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/$TOOL"
