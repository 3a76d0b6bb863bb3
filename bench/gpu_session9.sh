#!/usr/bin/env bash
# Session 9's H200 script, now one with session 10's (the same steps and options, plus "cpuwarm" and
# "gpuflow"): the commands in bench/RESULTS.md still run as written.
#   BUDGET=540 [STEPS="maxreg capture tests segment mitdb ncu flow cpu16"] bash bench/gpu_session9.sh
exec bash "$(dirname "$0")/gpu_session10.sh" "$@"
