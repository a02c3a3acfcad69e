#!/usr/bin/env bash
# promtool (Debian's `prometheus` package) for the alert-rule unit tests (`promtool test rules`) and
# the exposition checks (`promtool check metrics`). Idempotent: when it is installed it runs no apt
# command at all. The package's prometheus service is not wanted; only its promtool binary is used.
set -euo pipefail
command -v promtool >/dev/null && exit 0
dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed" && exit 0
"$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" prometheus-tools prometheus
echo "prometheus-tools: installed $(promtool --version 2>&1 | head -1)" >&2
