#!/usr/bin/env bash
# Debian packages the real node needs (hack/localcluster/node.py): containerd + runc, the CNI
# plugins, iptables, socat (the apiserver relay for pods), conntrack. Idempotent: when every
# package is installed it runs no apt command at all.
set -euo pipefail
PACKAGES=(containerd runc containernetworking-plugins iptables socat conntrack iproute2)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
"$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" node-deps "${missing[@]}"
# Debian's package starts containerd as a service where an init system runs; the node runs its own
# containerd with its own config and socket, so a system one is harmless but not needed.
echo "node-deps: installed ${missing[*]}" >&2
