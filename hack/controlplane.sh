#!/usr/bin/env bash
# Local Kubernetes control plane for Consort's tests, built from the Go module proxy.
#
#   hack/controlplane.sh build    build (once) etcd, kube-apiserver, kube-controller-manager,
#                                 kube-scheduler, kubectl, kwok, helm into ~/.cache/consort/bin
#   hack/controlplane.sh up       start the cluster in the background (idempotent), print kubeconfig
#   hack/controlplane.sh down     stop it and remove its state
#   hack/controlplane.sh status   say what runs
#   hack/controlplane.sh env      print `export KUBECONFIG=... PATH=...` for eval
#
# Pins live in hack/versions.env. Each binary group has a stamp keyed on its pins and inputs;
# when the stamp matches and the binaries exist, `build` runs no go command at all.
# Env: CONSORT_CACHE (default ~/.cache/consort), CONSORT_CLUSTER_DIR (default $CONSORT_CACHE/cluster).
set -euo pipefail

HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HACK")
# shellcheck source=versions.env
source "$HACK/versions.env"
CACHE=${CONSORT_CACHE:-$HOME/.cache/consort}
BIN=$CACHE/bin
LOGS=$CACHE/build-logs
BUILD_RECIPE=1 # bump when the go flags below change, so every stamp goes stale
# Helm's own release build sets its default Capabilities.KubeVersion from its client-go minor.
HELM_K8S_MINOR=36

say() { echo "controlplane: $*" >&2; }
die() { say "$*"; exit 1; }

# --- build ----------------------------------------------------------------------------------

check_go() {
  command -v go >/dev/null || die "Go is missing: no 'go' on PATH (need Go >= $MIN_GO_VERSION, https://go.dev/dl)"
  local have
  have=$(go env GOVERSION 2>/dev/null | sed 's/^go//')
  [ -n "$have" ] || die "Go is broken: 'go env GOVERSION' failed"
  if [ "$(printf '%s\n%s\n' "$MIN_GO_VERSION" "$have" | sort -V | head -1)" != "$MIN_GO_VERSION" ]; then
    die "Go $have is too old: need Go >= $MIN_GO_VERSION (https://go.dev/dl)"
  fi
}

# key NAME FILES... : the stamp content for a binary group (pins + hashed inputs + recipe).
key() {
  local name=$1; shift
  { echo "$name recipe=$BUILD_RECIPE go=$(go_version_cached)"; cat "$HACK/versions.env" "$@"; } | sha256sum | cut -d' ' -f1
}
# The Go version is part of the key but must not cost a go invocation on the fast path:
# it is read from the Go root's VERSION file when that exists.
go_version_cached() {
  local goroot
  goroot=$(dirname "$(dirname "$(readlink -f "$(command -v go 2>/dev/null || echo /nonexistent/bin/go)")")")
  head -1 "$goroot/VERSION" 2>/dev/null || echo unknown
}

fresh() { # fresh STAMPNAME KEY BINARIES... : true when the group needs no build
  local stamp=$BIN/.stamp-$1 want=$2; shift 2
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || return 1
  local b; for b in "$@"; do [ -x "$BIN/$b" ] || return 1; done
}

# run_go LABEL TOTAL DIR CMD... : run a go command with its output in a log, printing progress
# (elapsed time, packages compiled) every 30 s; on failure print a one-line diagnosis.
run_go() {
  local label=$1 total=$2 dir=$3; shift 3
  local log=$LOGS/$label.log start=$SECONDS
  mkdir -p "$LOGS"
  say "[$label] $* (log: $log)"
  ( cd "$dir" && exec "$@" ) >"$log" 2>&1 &
  local pid=$! tick=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    tick=$((tick + 1))
    if [ $((tick % 30)) -eq 0 ]; then
      local n last
      n=$(grep -cv '^go: \|^#\|^\s' "$log" 2>/dev/null || true)
      last=$(grep -v '^go: \|^#\|^\s' "$log" 2>/dev/null | tail -1 || true)
      say "[$label] $((SECONDS - start))s elapsed, ${n:-0}${total:+/$total} packages compiled${last:+ (now: $last)}"
    fi
  done
  if ! wait "$pid"; then
    if grep -qiE 'dial tcp|no such host|connection refused|i/o timeout|TLS handshake|proxy\.golang|reading https?://|403 Forbidden|404 Not Found|410 Gone' "$log"; then
      die "[$label] cannot download Go modules from GOPROXY=$(go env GOPROXY) (is the Go module proxy reachable?): $(grep -iE 'dial tcp|no such host|refused|timeout|TLS|reading http|Forbidden|Not Found|Gone' "$log" | head -1)"
    fi
    tail -20 "$log" >&2
    die "[$label] failed after $((SECONDS - start))s: see $log"
  fi
  say "[$label] done in $((SECONDS - start))s"
}

build_kube() {
  local mod=$HACK/kube
  local inputs=("$mod/go.mod" "$mod/go.sum" "$mod/cmd/kube/main.go" "$mod/cmd/etcd/main.go")
  local k
  k=$(key kube "${inputs[@]}")
  fresh kube "$k" kube etcd kube-apiserver kube-controller-manager kube-scheduler kubectl && return 0
  grep -q "k8s.io/kubernetes $KUBERNETES_VERSION\$" "$mod/go.mod" \
    || die "hack/kube/go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION (hack/versions.env)"
  if grep -E '^\s*k8s\.io/[a-z-]+ => ' "$mod/go.mod" | grep -vq " $STAGING_VERSION\$"; then
    die "hack/kube/go.mod replaces a staging module with a version other than $STAGING_VERSION"
  fi
  local minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  local ldflags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  run_go kube-download "" "$mod" go mod download
  local total
  total=$(cd "$mod" && go list -tags providerless -deps ./cmd/kube ./cmd/etcd | grep -c .) || total=""
  run_go kube "$total" "$mod" go build -v -trimpath -tags providerless -ldflags "$ldflags" \
    -o "$BIN/" ./cmd/kube ./cmd/etcd
  local name
  for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    ln -sfn kube "$BIN/$name"
  done
  # go build -mod=mod may have completed go.sum; key on what was actually built.
  key kube "${inputs[@]}" >"$BIN/.stamp-kube"
}

# build_tool NAME PACKAGE VERSION LDFLAGS : go install PACKAGE@VERSION into $BIN.
build_tool() {
  local name=$1 pkg=$2 version=$3 ldflags=$4
  local k
  k=$(key "$name $pkg@$version $ldflags")
  fresh "$name" "$k" "$name" && { [ "$name" != kwok ] || [ -f "$KWOK_STAGES" ]; } && return 0
  # `go install pkg@version` ignores the current module and rejects -mod.
  GOFLAGS=-buildvcs=false GOBIN=$BIN run_go "$name" "" "$CACHE" \
    go install -v -trimpath -ldflags "$ldflags" "$pkg@$version"
  if [ "$name" = kwok ]; then copy_kwok_stages; fi
  echo "$k" >"$BIN/.stamp-$name"
}

# The kwok controller has no built-in stages (kwokctl passes them in); use kwok's own upstream
# "fast" stages from the module just built: nodes Ready at once, pods Running/Ready at once.
KWOK_STAGES=$CACHE/share/kwok/stages.yaml
copy_kwok_stages() {
  local src
  src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  mkdir -p "$(dirname "$KWOK_STAGES")"
  local f out=$KWOK_STAGES.tmp
  : >"$out"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    [ -f "$src/$f" ] || die "kwok stage $src/$f is missing from the module cache"
    { echo "---"; echo "# from sigs.k8s.io/kwok@$KWOK_VERSION kustomize/stage/$f"; cat "$src/$f"; } >>"$out"
  done
  mv "$out" "$KWOK_STAGES"
}

cmd_build() {
  mkdir -p "$BIN"
  local kube_inputs=("$HACK/kube/go.mod" "$HACK/kube/go.sum" "$HACK/kube/cmd/kube/main.go" "$HACK/kube/cmd/etcd/main.go")
  local helm_ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata= -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$HELM_K8S_MINOR -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$HELM_K8S_MINOR"
  local kwok_ld="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
  # Fast path: everything stamped -> no go invocation at all.
  if [ -f "$HACK/kube/go.sum" ] \
    && fresh kube "$(key kube "${kube_inputs[@]}")" kube etcd kube-apiserver kube-controller-manager kube-scheduler kubectl \
    && fresh kwok "$(key "kwok sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION $kwok_ld")" kwok && [ -f "$KWOK_STAGES" ] \
    && fresh helm "$(key "helm helm.sh/helm/v3/cmd/helm@$HELM_VERSION $helm_ld")" helm; then
    return 0
  fi
  check_go
  export GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local
  touch "$HACK/kube/go.sum"
  local start=$SECONDS
  say "building the local control plane into $BIN (kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION); a cold build takes 15-40 min on 2 cores"
  build_kube
  build_tool kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" "$kwok_ld"
  build_tool helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$helm_ld"
  say "all binaries ready in $BIN after $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
}

# --- cluster --------------------------------------------------------------------------------

python_bin() {
  local py=$ROOT/.venv/bin/python
  [ -x "$py" ] || py=$(command -v python3 || true)
  [ -n "$py" ] || die "Python is missing: run scripts/bootstrap.sh (make venv) first"
  echo "$py"
}

cluster() {
  if [ "$1" = up ]; then cmd_build; fi
  exec "$(python_bin)" "$HACK/cluster.py" --bin-dir "$BIN" "$@"
}

case "${1:-}" in
  build) cmd_build ;;
  up | down | status | env) cluster "$@" ;;
  *) echo "usage: $0 build|up|down|status|env" >&2; exit 2 ;;
esac
