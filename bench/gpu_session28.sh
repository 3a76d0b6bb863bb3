#!/usr/bin/env bash
# Session 28's device call: its steps (tests, kbench, flow, cpuwarm) live on, unchanged, in bench/gpu_session29.sh
# (which adds the "busy" and "idle" steps and samples nvidia-smi during the flow).
#   LIMIT=570 STEPS="tests kbench flow cpuwarm" RUNS=4 bash bench/gpu_session28.sh
exec bash "$(dirname "$0")/gpu_session29.sh" "$@"
