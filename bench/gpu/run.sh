#!/usr/bin/env bash
# The GPU acceptance kit in one command, offline (bench/gpu/README.md):
#   bash bench/gpu/run.sh            # a GPU host: install bench/gpu/wheels beside the machine's torch, run every step
#   bash bench/gpu/run.sh --cpu      # the CPU mode (tiny model; the GPU-only parts skipped with the reason)
# The report goes to $OUT when set, else bench/results/. PYTHON picks the interpreter (default: python3, the one
# whose torch the kit proves). Exit 0: no step failed; 1: a step failed (the report says which and why).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "run.sh: no $PYTHON on PATH (set PYTHON=/path/to/python)" >&2; exit 2; }
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
exec "$PYTHON" bench/gpu/kit.py "$@"
