#!/usr/bin/env bash
# install-torch.sh PYTHON: torch ($TORCH, default torch==2.13.0, the release the tests pin) into PYTHON's environment,
# first and alone, as its CPU build (a few hundred MB, not PyPI's multi-GB CUDA build):
#   - already there at that version: nothing to do;
#   - macOS: PyPI's build (CPU and MPS);
#   - pip finds the CPU build (`torch==X+cpu`) with its own settings (a wheel on local disk, a mirror): that;
#   - else PyTorch's CPU index (TORCH_INDEX_URL, default https://download.pytorch.org/whl/cpu) for torch and its own
#     requirements alone. That index is never an extra index for anything else: an installer would then take every
#     package it also hosts from it. TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 gives a CUDA build.
# Used by scripts/quickstart.sh and .ci/setup.
set -euo pipefail
python=$1
TORCH=${TORCH:-torch==2.13.0}
version=${TORCH#torch==}
pip=("$python" -m pip --disable-pip-version-check)

if "$python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" >/dev/null 2>&1; then
    exit 0
elif [ "$(uname -s)" = Darwin ]; then
    echo "install-torch: $TORCH (PyPI's macOS build: CPU and MPS)" >&2
    "${pip[@]}" install --quiet "$TORCH"
elif [ -z "${TORCH_INDEX_URL:-}" ] && "${pip[@]}" install --quiet --dry-run --no-deps "$TORCH+cpu" >/dev/null 2>&1; then
    echo "install-torch: $TORCH+cpu (pip finds the CPU build with its own settings)" >&2
    "${pip[@]}" install --quiet "$TORCH+cpu"
else
    index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
    echo "install-torch: $TORCH from $index (for torch alone)" >&2
    env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_NO_INDEX PIP_CONFIG_FILE=/dev/null \
        "${pip[@]}" install --quiet --index-url "$index" "$TORCH"
fi
