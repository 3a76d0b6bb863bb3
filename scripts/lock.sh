#!/usr/bin/env bash
# Write requirements-lock.txt: every package beatflow and its tests need (the [test] extra), pinned with
# hashes, for Linux x86_64 and Python 3.11, torch the 2.13.0 CPU build. scripts/setup.sh installs from it,
# so a fresh machine gets the versions CI tested. Run this after changing the dependencies in
# pyproject.toml (or to take newer releases within its ranges: add --upgrade), then run the tests and
# commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null 2>&1 || python3 -m pip install -q --user "uv==0.13.9"
UV=$(command -v uv || echo "$HOME/.local/bin/uv")
links=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)  # where the CPU wheel of torch lies on disk
"$UV" pip compile pyproject.toml --extra test --generate-hashes --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 "${links[@]}" -c <(echo "torch==2.13.0+cpu") \
  --custom-compile-command "bash scripts/lock.sh" -o requirements-lock.txt "$@"
