#!/usr/bin/env bash
# Run CI as the CI machine does, on a clean clone of this repository's HEAD: `bash .ci/run` in a temporary folder,
# the log kept, the clone removed afterwards. Each clone's .venv takes about 5.6 GiB; a dozen left in /tmp by
# earlier sessions filled the disk that the real CI run then failed on (2026-11-27).
# Usage: bash scripts/ci_local.sh [LOG]   (default log: /tmp/pallas-norm-ci.log; exit code: CI's)
set -uo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
log=${1:-/tmp/pallas-norm-ci.log}
work=$(mktemp -d "${TMPDIR:-/tmp}/pallas-norm-ci.XXXXXX")
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/repo" || exit 1
rev=$(git -C "$work/repo" rev-parse --short HEAD)
start=$(date +%s)
(cd "$work/repo" && bash .ci/run) >"$log" 2>&1
rc=$?
echo "CI on $rev: rc=$rc after $(( $(date +%s) - start )) s; log: $log" | tee -a "$log"
exit "$rc"
