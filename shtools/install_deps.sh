#!/usr/bin/env bash
# Install what this project needs into the current Python, changing nothing already there.
# torch is installed only when missing: a bare 'torch' requirement on a machine without it
# would pull several GB of CUDA packages. Override the version with TORCH_VERSION, and add
# pip options (an index URL for CPU or CUDA wheels) with TORCH_PIP_ARGS.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-dev}  # "dev" adds pytest

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[install] torch not found: installing torch==${TORCH_VERSION:-2.13.0}"
    # shellcheck disable=SC2086
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet ${TORCH_PIP_ARGS:-} "torch==${TORCH_VERSION:-2.13.0}"
fi
echo "[install] this package (editable) with extras [$EXTRAS]"
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
