#!/usr/bin/env bash
# Create .venv at the repository root with everything beatflow and its tests need, at the versions of
# requirements-lock.txt (hashes checked; scripts/lock.sh writes it). Idempotent: skipped when the lock,
# pyproject.toml and this script have not changed since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.beatflow-setup
want=$(sha256sum pyproject.toml requirements-lock.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/beatflow ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# the CPU build of torch: from this disk where it lies there, else from PyTorch's CPU index (a plain
# "torch" from PyPI would be a multi-GB CUDA build)
links=(--extra-index-url https://download.pytorch.org/whl/cpu)
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)
uv_links=("${links[@]}"); [ -d /opt/wheels ] || uv_links+=(--index-strategy unsafe-best-match)
# uv installs the lock's 176 packages in parallel (about 15 s here, against about 90 s for pip); pip
# is the fallback where uv cannot be installed
if .venv/bin/python -m pip install -q "uv==0.13.9" 2>/dev/null; then
  .venv/bin/uv pip sync -q --python .venv/bin/python --require-hashes "${uv_links[@]}" requirements-lock.txt
  .venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
else
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q --require-hashes "${links[@]}" -r requirements-lock.txt
  .venv/bin/python -m pip install -q --no-deps -e .
fi
echo "$want" > "$stamp"
