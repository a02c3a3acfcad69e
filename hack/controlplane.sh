#!/usr/bin/env bash
# Local Kubernetes control plane for Consort's tests, built from the Go module proxy.
#
#   hack/controlplane.sh build    build (once) etcd, kube-apiserver, kube-controller-manager,
#                                 kube-scheduler, kubectl, kwok, helm into ~/.cache/consort/bin
#   hack/controlplane.sh build-node  build (once) the real node's kubelet + kube-proxy (one binary)
#   hack/controlplane.sh up       start the cluster in the background (idempotent), print kubeconfig
#                                 (--real-node: plus a containerd node; --images DIR: import its archives)
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

# check_go: Go must be on PATH; one older than MIN_GO_VERSION (but >= 1.21, which can switch
# toolchains) builds with the pinned GO_TOOLCHAIN, which it fetches from the module proxy.
check_go() {
  command -v go >/dev/null || die "Go is missing: no 'go' on PATH (need Go >= $MIN_GO_VERSION, https://go.dev/dl)"
  local have
  have=$(GOTOOLCHAIN=local go env GOVERSION 2>/dev/null | sed 's/^go//')
  [ -n "$have" ] || die "Go is broken: 'go env GOVERSION' failed"
  GOTOOLCHAIN=local
  if ! version_at_least "$have" "$MIN_GO_VERSION"; then
    version_at_least "$have" 1.21 || die "Go $have is too old: need Go >= $MIN_GO_VERSION (https://go.dev/dl)"
    say "Go $have is older than $MIN_GO_VERSION: building with $GO_TOOLCHAIN from the module proxy"
    GOTOOLCHAIN=$GO_TOOLCHAIN
  fi
  export GOTOOLCHAIN
}

version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

# key NAME FILES... : the stamp content for a binary group: its pins, its hashed inputs and the
# recipe. The Go version is deliberately not part of it: upgrading Go must not force a 25-minute
# rebuild, and the fast path must not need Go at all.
key() {
  local name=$1; shift
  { echo "$name recipe=$BUILD_RECIPE"; cat "$HACK/versions.env" "$@"; } | sha256sum | cut -d' ' -f1
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

KUBE_MOD=$HACK/kube
KUBE_BINARIES=(kube etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
KWOK_PKG=sigs.k8s.io/kwok/cmd/kwok
KWOK_LDFLAGS="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
HELM_PKG=helm.sh/helm/v3/cmd/helm
HELM_LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata="
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  HELM_LDFLAGS+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_K8S_MINOR"
done
# The kwok controller has no built-in stages (kwokctl passes them in); we use kwok's own upstream
# "fast" stages from the module just built: nodes Ready at once, pods Running/Ready at once.
KWOK_STAGES=$CACHE/share/kwok/stages.yaml

# Version ldflags so `kubectl version` and Helm's kubeVersion checks see the real release
# (buildDate is added at build time; it must not change the stamp).
kube_ldflags() {
  local minor=${KUBERNETES_VERSION#v1.} pkg flags="-s -w"
  minor=${minor%%.*}
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
  done
  echo "$flags"
}

# kube_ldflags plus the build date (which must not change the stamp, so it is added only here).
dated_kube_ldflags() {
  local flags pkg
  flags="$(kube_ldflags)"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  echo "$flags"
}

kube_fresh() {
  fresh kube "$(key "kube $(kube_ldflags)" "$KUBE_MOD/go.mod" "$KUBE_MOD/go.sum" "$KUBE_MOD"/cmd/*/main.go)" \
    "${KUBE_BINARIES[@]}"
}
# The real node's kubelet and kube-proxy: one multi-call binary from the same module graph.
NODE_BINARIES=(kube-node kubelet kube-proxy)
node_fresh() {
  fresh node "$(key "node $(kube_ldflags)" "$KUBE_MOD/go.mod" "$KUBE_MOD/go.sum" "$KUBE_MOD/node/main.go")" \
    "${NODE_BINARIES[@]}"
}
kwok_fresh() { fresh kwok "$(key "kwok $KWOK_PKG@$KWOK_VERSION $KWOK_LDFLAGS")" kwok && [ -f "$KWOK_STAGES" ]; }
helm_fresh() { fresh helm "$(key "helm $HELM_PKG@$HELM_VERSION $HELM_LDFLAGS")" helm; }

build_kube() {
  grep -q "k8s.io/kubernetes $KUBERNETES_VERSION\$" "$KUBE_MOD/go.mod" \
    || die "hack/kube/go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION (hack/versions.env)"
  if grep -E '^\s*k8s\.io/[a-z-]+ => ' "$KUBE_MOD/go.mod" | grep -vq " $STAGING_VERSION\$"; then
    die "hack/kube/go.mod replaces a staging module with a version other than $STAGING_VERSION"
  fi
  local ldflags
  ldflags="$(dated_kube_ldflags)"
  run_go kube-download "" "$KUBE_MOD" go mod download
  local total
  total=$(cd "$KUBE_MOD" && go list -tags providerless -deps ./cmd/kube ./cmd/etcd | grep -c .) || total=""
  run_go kube "$total" "$KUBE_MOD" go build -v -trimpath -tags providerless -ldflags "$ldflags" \
    -o "$BIN/" ./cmd/kube ./cmd/etcd
  local name
  for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    ln -sfn kube "$BIN/$name"
  done
  # Keyed after the build: go build -mod=mod may have completed go.sum.
  key "kube $(kube_ldflags)" "$KUBE_MOD/go.mod" "$KUBE_MOD/go.sum" "$KUBE_MOD"/cmd/*/main.go >"$BIN/.stamp-kube"
}

build_node() {
  local ldflags total
  ldflags="$(dated_kube_ldflags)"
  total=$(cd "$KUBE_MOD" && go list -tags providerless -deps ./node | grep -c .) || total=""
  run_go kube-node "$total" "$KUBE_MOD" go build -v -trimpath -tags providerless -ldflags "$ldflags" \
    -o "$BIN/kube-node" ./node
  ln -sfn kube-node "$BIN/kubelet"
  ln -sfn kube-node "$BIN/kube-proxy"
  key "node $(kube_ldflags)" "$KUBE_MOD/go.mod" "$KUBE_MOD/go.sum" "$KUBE_MOD/node/main.go" >"$BIN/.stamp-node"
}

cmd_build_node() {
  mkdir -p "$BIN"
  node_fresh && return 0
  build_env_locked node_fresh || return 0
  local start=$SECONDS
  say "building the real node's kubelet + kube-proxy (kubernetes $KUBERNETES_VERSION) into $BIN;" \
    "6-10 min on 2 cores once the control plane's build cache is warm"
  build_node
  say "kubelet + kube-proxy ready in $BIN after $(((SECONDS - start) / 60))m$(((SECONDS - start) % 60))s"
}

# build_tool NAME PACKAGE VERSION LDFLAGS : go install PACKAGE@VERSION into $BIN.
build_tool() {
  local name=$1 pkg=$2 version=$3 ldflags=$4
  # `go install pkg@version` ignores the current module and rejects -mod.
  GOFLAGS=-buildvcs=false GOBIN=$BIN run_go "$name" "" "$CACHE" \
    go install -v -trimpath -ldflags "$ldflags" "$pkg@$version"
  if [ "$name" = kwok ]; then copy_kwok_stages; fi
  key "$name $pkg@$version $ldflags" >"$BIN/.stamp-$name"
}

copy_kwok_stages() {
  local src f out=$KWOK_STAGES.tmp
  src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  mkdir -p "$(dirname "$KWOK_STAGES")"
  : >"$out"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    [ -f "$src/$f" ] || die "kwok stage $src/$f is missing from the module cache"
    { echo "---"; echo "# from sigs.k8s.io/kwok@$KWOK_VERSION kustomize/stage/$f"; cat "$src/$f"; } >>"$out"
  done
  mv "$out" "$KWOK_STAGES"
}

controlplane_fresh() { kube_fresh && kwok_fresh && helm_fresh; }

# build_env_locked FRESH_FN: the Go environment plus the cache's build lock (held until exit).
# One build at a time per cache (several checkouts may share it); the winner's result counts:
# returns 1 when FRESH_FN holds after waiting for another build, i.e. nothing is left to do.
build_env_locked() {
  check_go
  export GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
  exec 9>"$CACHE/build.lock"
  if ! flock -n 9; then
    say "another build holds $CACHE/build.lock; waiting for it (at most 60 min)"
    flock -w 3600 9 || die "timed out after 60 min waiting for $CACHE/build.lock"
    "$1" && return 1
  fi
  return 0
}

cmd_build() {
  mkdir -p "$BIN"
  # Fast path: everything stamped -> no go invocation at all.
  controlplane_fresh && return 0
  build_env_locked controlplane_fresh || return 0
  local start=$SECONDS
  say "building the local control plane into $BIN (kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION," \
    "kwok $KWOK_VERSION, helm $HELM_VERSION); a cold build takes 15-40 min on 2 cores"
  kube_fresh || build_kube
  kwok_fresh || build_tool kwok "$KWOK_PKG" "$KWOK_VERSION" "$KWOK_LDFLAGS"
  helm_fresh || build_tool helm "$HELM_PKG" "$HELM_VERSION" "$HELM_LDFLAGS"
  say "all binaries ready in $BIN after $(((SECONDS - start) / 60))m$(((SECONDS - start) % 60))s"
}

# --- cluster --------------------------------------------------------------------------------

python_bin() {
  local py=$ROOT/.venv/bin/python
  [ -x "$py" ] || py=$(command -v python3 || true)
  [ -n "$py" ] || die "Python is missing: run scripts/bootstrap.sh (make venv) first"
  echo "$py"
}

cluster() {
  if [ "$1" = up ]; then
    cmd_build
    case " $* " in *" --real-node "*) "$HACK/node-deps.sh"; cmd_build_node ;; esac
  fi
  PYTHONPATH=$HACK exec "$(python_bin)" -m localcluster --bin-dir "$BIN" "$@"
}

case "${1:-}" in
  build) cmd_build ;;
  build-node) cmd_build_node ;;
  up | down | status | env) cluster "$@" ;;
  *) echo "usage: $0 build|build-node|up|down|status|env" >&2; exit 2 ;;
esac
