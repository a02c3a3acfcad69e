#!/usr/bin/env bash
# apt-get install of the Debian packages named, under one lock: `make test` builds its prerequisites
# in parallel, and two apt-get runs at once fail on dpkg's lock instead of waiting for it.
# Usage: hack/apt-install.sh WHO PACKAGE... (WHO prefixes the progress line). Needs root.
set -euo pipefail
who=$1; shift
[ "$(id -u)" -eq 0 ] || { echo "$who: need root to apt-get install $*" >&2; exit 1; }
echo "$who: installing $* (Debian packages)" >&2
export DEBIAN_FRONTEND=noninteractive
exec 9>/var/lock/consort-apt.lock
flock 9
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "$@" >/dev/null
