#!/usr/bin/env bash
# The first run (README): a virtualenv in .venv with envtool and its `train` extra, the tiny local model that
# examples/tiny-cpu.yml trains (no download), then `envtool train examples/tiny-cpu.yml --gpu cpu`.
# No root, no Docker, no npm: only Python >= 3.10 with venv and pip, and a package index.
# Safe to run again: the venv is reused, and the example continues from its last checkpoint.
#
# torch first, alone, as its CPU build (scripts/install-torch.sh: from wherever pip finds the CPU build, else from
# PyTorch's CPU index, TORCH_INDEX_URL, for torch alone); TORCH (default torch==2.13.0) picks the release.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:-torch==2.13.0}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "quickstart: error: envtool needs Python >= 3.10; $PYTHON is $("$PYTHON" -V 2>&1 || echo missing): set PYTHON=python3.11" >&2
    exit 2
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# uv installs: it fetches in parallel and keeps a cache, so a second run installs from disk (pip keeps no cache
# where the index forbids it, as this project's CI proxy does: 7.5 minutes for pip, every time). uv is one of
# envtool's own dependencies; without one on PATH, pip installs it into the venv first.
if command -v uv >/dev/null 2>&1; then
    UV=uv
else
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.9"
    UV="$VENV/bin/uv"
fi
# uv reads UV_* settings, not pip's: scripts/uv-from-pip.sh carries pip's over, to resolve as pip does.
source scripts/uv-from-pip.sh "$VENV/bin/python"

torch_version=${TORCH#torch==}
TORCH=$TORCH bash scripts/install-torch.sh "$VENV/bin/python"

echo "quickstart: installing envtool[train] into $VENV" >&2
# (the installed torch pinned on the same line: the resolver keeps that build instead of swapping it for another)
"$UV" pip install --quiet --python "$VENV/bin/python" -e ".[train]" "torch==$torch_version"

# One thread: the tiny model gains nothing from more, and on a busy machine several spinning OpenMP threads make
# each step many times slower (measured on the 2-core CI machine: 12 steps 3m08s with torch's default, 1m37s with 1).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f outputs/tiny-model/config.json ] || "$VENV/bin/python" -m trainer make-tiny-model outputs/tiny-model >/dev/null
"$VENV/bin/envtool" train examples/tiny-cpu.yml --gpu cpu
echo "quickstart: done. The trained model is in outputs/tiny-cpu/final; next: source $VENV/bin/activate" >&2
