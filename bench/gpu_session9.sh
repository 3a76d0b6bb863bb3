#!/usr/bin/env bash
# Session 9's H200 script: now bench/gpu_session11.sh (a superset).
exec bash "$(dirname "$0")/gpu_session11.sh" "$@"
