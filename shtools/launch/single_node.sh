#!/usr/bin/env bash
# Train on one machine: one torchrun, GPUS_PER_NODE processes (one per GPU), rendezvous on the
# machine itself (--standalone). The model, data and schedule come from a config file
# (shtools/configs/*.sh, sourced); extra arguments are appended to its flags and, coming last,
# override them.
#
#   CONFIG=shtools/configs/llama2_7b.sh DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_DIR=/models/Llama-2-7b-hf bash shtools/launch/single_node.sh
#   CONFIG=shtools/configs/gpt_small.sh GPUS_PER_NODE=2 MEGATRON_DEVICE=cpu \
#       bash shtools/launch/single_node.sh --num-layers 2 --hidden-size 64 --train-iters 2
#   DRY_RUN=1 bash shtools/launch/single_node.sh      # print the command, run nothing
#
# With the config's CHECKPOINT_DIR set, --save and --load are the same directory: running the
# same command again continues from the latest checkpoint (the first run starts fresh).
#
# ---- variables (environment variables override them) ----
#   CONFIG         config file, relative to the current directory or the repository root
#                  (default shtools/configs/gpt_small.sh); its own variables (data, tokenizer,
#                  checkpoint paths, TP/PP, batch sizes) are documented at its top
#   GPUS_PER_NODE  processes to start (default: the GPUs torch sees, else 1); on CPU
#                  (MEGATRON_DEVICE=cpu, or no GPU) each is a gloo process
#   TORCHRUN       the launcher command (default torchrun; e.g. "python3 -m torch.distributed.run")
#   DRY_RUN        1: print the command instead of running it
set -euo pipefail
# One hardware queue per GPU: kernels run in issue order, so a tensor-parallel collective
# issued before a GEMM overlaps it (Megatron requires it for TP; pretrain checks it on CUDA).
export CUDA_DEVICE_MAX_CONNECTIONS=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONFIG=${CONFIG:-shtools/configs/gpt_small.sh}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 1)')}
read -r -a LAUNCHER <<< "${TORCHRUN:-torchrun}"
DRY_RUN=${DRY_RUN:-0}

[[ -f $CONFIG ]] || CONFIG=$ROOT/$CONFIG
# shellcheck source=/dev/null
source "$CONFIG"  # sets ENTRY_POINT, TRAIN_ITERS, CONFIG_FLAGS

CMD=("${LAUNCHER[@]}" --standalone --nnodes 1 --nproc-per-node "$GPUS_PER_NODE"
     "$ROOT/$ENTRY_POINT" "${CONFIG_FLAGS[@]}" "$@")
if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
echo "single node: $GPUS_PER_NODE processes, config $CONFIG" >&2
exec "${CMD[@]}"
