#!/usr/bin/env bash
# The runtime dependencies of beatflow that ../shared/device/wheels.sh leaves out, as wheels for the GPU machine's
# Python (3.12, x86_64), into .whl-extra/; carry it beside .whl and bench/gpu.sh's setup step installs them.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl-extra
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --no-deps -d .whl-extra platformdirs
ls .whl-extra
