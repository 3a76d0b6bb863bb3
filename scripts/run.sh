#!/usr/bin/env bash
# Set up (if needed) and run the main job on embedded defaults: a synthetic 20-hour ECG through the
# whole flow on a local Dask cluster (CPU). Extra arguments go to `beatflow run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/beatflow run "$@"
