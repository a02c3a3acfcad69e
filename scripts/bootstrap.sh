#!/usr/bin/env bash
# Installs the project's Python environment into .venv/ (idempotent: a stamp keyed on the
# dependency spec skips pip entirely on a second run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "bootstrap: $PY not found (need Python >= 3.11)" >&2; exit 1; }
stamp=.venv/.consort-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing Python packages into .venv/ (torch is large; first run takes minutes)"
start=$(date +%s)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! .venv/bin/pip install --progress-bar off -e '.[engine,router,operator,test]'; then
  echo "bootstrap: pip install failed (is PyPI reachable?)" >&2; exit 1
fi
echo "$want" > "$stamp"
echo "bootstrap: done in $(( $(date +%s) - start )) s"
