#!/usr/bin/env bash
# The quickest look at the framework on this machine, with nothing to download.
# Until the training script lands, the job is the tensor-parallel self-check: a tiny language
# model trained at TP=2 (two processes, CPU/gloo or GPU/nccl) step by step against its
# unsharded twin.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-2}
bash shtools/install_deps.sh dev
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    tools/check_tensor_parallel.py "$@"
