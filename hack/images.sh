#!/usr/bin/env bash
# `make images`: builds consort/engine:dev, consort/router:dev, consort/operator:dev and the pod
# sandbox image registry.k8s.io/pause:3.6 with buildah, with no registry at all:
#   1. base: a Debian bookworm root filesystem made with debootstrap (cached as a tarball),
#      committed under the name the Dockerfiles' BASE_IMAGE defaults to (debian:bookworm-slim),
#   2. wheels: `pip download` of each image's pinned requirements into ~/.cache/consort/wheels
#      (the builds install from there: this machine reaches PyPI only through a TLS proxy whose CA
#      the base image does not trust),
#   3. buildah bud with its layer cache (a warm rebuild reuses every layer but the project's own),
#   4. each image pushed to ~/.cache/consort/images/<name>.tar (oci-archive) with .ref and .digest
#      beside it, which the real node imports (hack/localcluster/node.py).
# Idempotent and cached; needs root (buildah's storage, debootstrap). Progress on stderr.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CONSORT_CACHE:-$HOME/.cache/consort}
BASE_IMAGE=docker.io/library/debian:bookworm-slim
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
WHEELS=$CACHE/wheels
OUT=$CACHE/images
LOGS=$CACHE/build-logs
# name  dockerfile  image ref (what pods and containerd's sandbox_image ask for)
IMAGES=(
  "pause hack/pause/Dockerfile registry.k8s.io/pause:3.6"
  "engine engine-image/Dockerfile docker.io/consort/engine:dev"
  "router router-image/Dockerfile docker.io/consort/router:dev"
  "operator operator/Dockerfile docker.io/consort/operator:dev"
)

say() { echo "images: $*" >&2; }
die() { say "$*"; exit 1; }
t0=$SECONDS
mkdir -p "$WHEELS" "$OUT" "$LOGS" "$CACHE/base"

[ "$(id -u)" -eq 0 ] || die "needs root (buildah storage, debootstrap)"
missing=()
# runc: buildah's RUN steps need an OCI runtime, which Debian's buildah only recommends (and apt-install.sh
# installs no recommends); the node installs it too, but on a cold `make -j3 test` it comes too late.
for p in buildah debootstrap runc; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] || "$ROOT/hack/apt-install.sh" images "${missing[@]}"

# --- 1. base image ---------------------------------------------------------------------------
tarball=$CACHE/base/debian-$SUITE-minbase.tar.gz
if [ ! -f "$tarball" ]; then
  say "debootstrap $SUITE (minbase) from $MIRROR (~1 min)"
  dir=$CACHE/base/rootfs-tmp
  rm -rf "$dir"
  debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1 \
    || { tail -5 "$LOGS/debootstrap.log" >&2; die "debootstrap failed: see $LOGS/debootstrap.log"; }
  # What the slim image trims; apt in a RUN step must not keep caches either.
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/*
  tar -C "$dir" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$dir"
fi
base_id=$(sha256sum "$tarball" | cut -c1-16)
if [ "$(buildah inspect --type image --format '{{index .ImageAnnotations "dev.consort.base"}}' "$BASE_IMAGE" 2>/dev/null)" != "$base_id" ]; then
  say "committing the Debian root filesystem as $BASE_IMAGE"
  ctr=$(buildah from scratch)
  buildah add --quiet "$ctr" "$tarball" / >/dev/null
  buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --annotation "dev.consort.base=$base_id" "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
fi

# --- 2. wheels -------------------------------------------------------------------------------
PIP=${PIP:-$ROOT/.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
reqs=(engine-image/requirements.txt router-image/requirements.txt operator/requirements.txt)
want=$(cd "$ROOT" && cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$want" ]; then
  say "downloading wheels into $WHEELS (torch and its CUDA wheels are ~4 GB on a cold cache)"
  for r in "${reqs[@]}"; do
    (cd "$ROOT" && $PIP download --quiet --progress-bar off --only-binary=:all: --dest "$WHEELS" \
      -r "$r" "setuptools>=77" wheel) || die "pip download for $r failed (is PyPI reachable?)"
  done
  echo "$want" >"$WHEELS/.stamp"
fi

# --- 3/4. build and archive ------------------------------------------------------------------
for entry in "${IMAGES[@]}"; do
  read -r name dockerfile ref <<<"$entry"
  start=$SECONDS
  say "[$name] buildah bud -f $dockerfile -t $ref (log: $LOGS/image-$name.log)"
  previous=$(buildah inspect --type image --format '{{.FromImageID}}' "$ref" 2>/dev/null || true)
  if ! (cd "$ROOT" && buildah bud --layers --pull=never --network=host --format=oci \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg PIP_FIND_LINKS=/wheels \
        --volume "$WHEELS:/wheels:ro" -f "$dockerfile" -t "$ref" . ) >"$LOGS/image-$name.log" 2>&1; then
    tail -15 "$LOGS/image-$name.log" >&2
    die "[$name] build failed: see $LOGS/image-$name.log"
  fi
  id=$(buildah inspect --type image --format '{{.FromImageID}}' "$ref")
  # The build it replaces, now untagged: removed so rebuilds do not fill the disk (not `rmi --prune`,
  # which also drops the cached layers of multi-stage builds' earlier stages).
  if [ -n "$previous" ] && [ "$previous" != "$id" ]; then buildah rmi "$previous" >/dev/null 2>&1 || true; fi
  if [ "$(cat "$OUT/$name.tar.id" 2>/dev/null)" != "$id" ] || [ ! -f "$OUT/$name.tar" ]; then
    rm -f "$OUT/$name.tar"
    # Uncompressed: gzip of the engine's ~6 GB layer costs minutes on 2 cores and the archive never leaves this machine.
    buildah push --quiet --disable-compression "$ref" "oci-archive:$OUT/$name.tar.tmp:$ref" >/dev/null
    mv "$OUT/$name.tar.tmp" "$OUT/$name.tar"
    echo "$ref" >"$OUT/$name.tar.ref"
    # The manifest digest containerd will list after import: the node skips archives it holds.
    tar -xOf "$OUT/$name.tar" index.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["manifests"][0]["digest"])' \
      >"$OUT/$name.tar.digest"
    echo "$id" >"$OUT/$name.tar.id"
  fi
  size=$(buildah images --format '{{.Size}}' "$ref" | head -1)
  say "[$name] $ref ready in $((SECONDS - start))s (${size})"
done
buildah rm --all >/dev/null 2>&1 || true
say "all images ready in $((SECONDS - t0))s: $(cd "$OUT" && ls ./*.tar | tr '\n' ' ')"
