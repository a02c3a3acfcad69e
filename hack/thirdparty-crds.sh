#!/usr/bin/env bash
# Third-party CRDs the e2e tests apply (KEDA's ScaledObject, prometheus-operator's ServiceMonitor,
# PodMonitor, PrometheusRule), taken from the Go module proxy: a module zip holds the whole
# repository tree at that tag, YAML included, so no GitHub access is needed. Pinned versions;
# idempotent and cached: a second run with the same pins only prints the directory.
# Prints the output directory (one line on stdout); progress on stderr. Nothing here is committed.
set -euo pipefail
CACHE=${CONSORT_CACHE:-$HOME/.cache/consort}
OUT=$CACHE/crds/thirdparty
KEDA_MODULE=github.com/kedacore/keda/v2
KEDA_VERSION=v2.21.0
PROMOP_MODULE=github.com/prometheus-operator/prometheus-operator
PROMOP_VERSION=v0.85.0
# module@version  path inside the module
FILES=(
  "$KEDA_MODULE@$KEDA_VERSION config/crd/bases/keda.sh_scaledobjects.yaml"
  "$PROMOP_MODULE@$PROMOP_VERSION example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
  "$PROMOP_MODULE@$PROMOP_VERSION example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml"
  "$PROMOP_MODULE@$PROMOP_VERSION example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
)

say() { echo "thirdparty-crds: $*" >&2; }
die() { say "$*"; exit 1; }

stamp="keda=$KEDA_VERSION prometheus-operator=$PROMOP_VERSION"
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$stamp" ]; then
  echo "$OUT"
  exit 0
fi

[ -x /usr/local/go/bin/go ] && PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || die "Go is missing: no 'go' on PATH (the CRDs come from the Go module proxy)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
declare -A dirs=()
for entry in "${FILES[@]}"; do
  read -r module path <<<"$entry"
  if [ -z "${dirs[$module]:-}" ]; then
    say "go mod download $module"
    # Outside any main module: -mod=mod lets `go mod download` resolve module@version on its own.
    json=$(cd "$work" && GOFLAGS=-mod=mod go mod download -json "$module" 2>&1) \
      || die "cannot download $module from GOPROXY=$(go env GOPROXY): $(echo "$json" | grep -m1 '"Error"' || echo "$json" | tail -1)"
    dir=$(echo "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -d "$dir" ] || die "no module directory for $module in: $json"
    dirs[$module]=$dir
  fi
  src=${dirs[$module]}/$path
  [ -f "$src" ] || die "$path is not in $module"
  cp "$src" "$work/$(basename "$path")"
done
# Publish only a complete set (the module cache's files are read-only: copies are made writable).
for entry in "${FILES[@]}"; do
  read -r _ path <<<"$entry"
  install -m 0644 "$work/$(basename "$path")" "$OUT/"
done
echo "$stamp" >"$OUT/.stamp"
say "${#FILES[@]} CRDs in $OUT"
echo "$OUT"
