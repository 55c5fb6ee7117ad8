#!/usr/bin/env bash
# Install what this project needs into the current Python, changing nothing already there.
# torch is installed only when missing or older than setup.py's floor (2.11): a bare 'torch'
# requirement would pull several GB of CUDA packages of whatever release pip picks. Override
# the version with TORCH_VERSION, and add pip options (an index URL for CPU or CUDA wheels)
# with TORCH_PIP_ARGS.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-dev}  # "dev" adds pytest

TORCH_OK='import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 11))'
if ! "$PYTHON" -c "$TORCH_OK" >/dev/null 2>&1; then
    echo "[install] torch missing or older than 2.11: installing torch==${TORCH_VERSION:-2.13.0}"
    # shellcheck disable=SC2086
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet ${TORCH_PIP_ARGS:-} "torch==${TORCH_VERSION:-2.13.0}"
fi
# Nothing changed since the last install here (the same interpreter, extras and setup.py, and
# this checkout is what the interpreter imports): skip pip, which takes seconds even then.
# INSTALL_DEPS_FORCE=1 runs pip anyway.
STAMP=build/.install-stamp
WANT="$("$PYTHON" -c 'import sys; print(sys.executable)') [$EXTRAS] $(sha1sum setup.py | cut -c1-40)"
HERE='import os, sys, megatron; sys.exit(os.path.dirname(os.path.dirname(megatron.__file__)) != sys.argv[1])'
if [ -z "${INSTALL_DEPS_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && \
        (cd / && "$PYTHON" -c "$HERE" "$OLDPWD") >/dev/null 2>&1; then
    echo "[install] nothing changed since the last install ($STAMP)"
    exit 0
fi
echo "[install] this package (editable) with extras [$EXTRAS]"
if ! PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check \
        -e ".[$EXTRAS]"; then
    # A machine without a package index (a lent GPU machine) cannot even build the editable
    # install; the checkout still runs from its root when every requirement is already there.
    # Only what training imports: pyarrow (.parquet), zstandard (.jsonl.zst) and wandb
    # (--wandb-project) are imported when used, and their tests skip without them.
    NEEDED="torch, numpy, tokenizers, sentencepiece, transformers, safetensors, tensorboard, matplotlib"
    NEEDED="$NEEDED, tiktoken"  # megatron.training.tokenizer imports it unconditionally
    [ "$EXTRAS" = dev ] && NEEDED="$NEEDED, pytest"
    if "$PYTHON" -c "import $NEEDED" >/dev/null 2>&1; then
        echo "[install] pip could not install (no package index?); every requirement is" \
             "already importable, so running from the checkout"
        ABSENT='import importlib.util as u, sys; print(*[p for p in sys.argv[1:] if not u.find_spec(p)])'
        OPTIONAL_ABSENT="$("$PYTHON" -c "$ABSENT" pyarrow zstandard wandb)"
        if [ -n "$OPTIONAL_ABSENT" ]; then
            echo "[install] not installed (optional, their tests skip): $OPTIONAL_ABSENT"
        fi
    else
        echo "error: pip could not install this package and some of ($NEEDED) is missing;" \
             "install them (or carry their wheels) and run again" >&2
        exit 1
    fi
fi
mkdir -p build && echo "$WANT" > "$STAMP"
