#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 (JAX >= 0.11 needs it) and install pallas-norm with its test extras,
# pinned by .ci/constraints.txt to the versions on the lent GPU image. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidates=("${PYTHON:-}" python3.13 python3.12 python3)
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -V -r); do
      candidates+=("$(pyenv root)/versions/$v/bin/python")
    done
  fi
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "setup.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  rm -rf .venv
  "$(find_python)" -m venv .venv
fi
# torch's Linux wheels on PyPI are CUDA builds: with their nvidia-* wheels the venv takes about 5.6 GiB. Without pip's
# cache the install needs that plus the downloads (~4 GiB) at its peak, not twice the downloads on top; a full disk
# failed CI once (2026-11-27), so say how much room there is before starting.
read -r free_mib mount < <(df -Pm . | awk 'NR == 2 {print $4, $6}')
if [ "${free_mib:-0}" -lt 10240 ]; then
  echo "setup.sh: only ${free_mib} MiB free on ${mount}; the install needs about 10 GiB" >&2
fi
.venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check -c .ci/constraints.txt -e ".[test]"
.venv/bin/python -c 'import jax, pallas_norm, torch_bridge; print("pallas-norm ready: jax", jax.__version__)'
