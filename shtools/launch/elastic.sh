#!/usr/bin/env bash
# Fault-tolerant (elastic) training: run this script on every node that may take part. torchrun
# starts as soon as MIN_NODES nodes have joined the c10d rendezvous at MASTER_ADDR:MASTER_PORT
# (waiting a little for up to MAX_NODES), and when a worker process dies or a node is lost or
# added it stops all workers and starts them again, up to MAX_RESTARTS times, with a new
# rendezvous (the world size may change between MIN_NODES and MAX_NODES x GPUS_PER_NODE).
#
# Auto-resume is what makes a restart lose no more than the work since the last checkpoint:
# the configs pass --save and --load the SAME directory (CHECKPOINT_DIR), so every (re)start
# loads the latest complete checkpoint (latest_checkpointed_iteration.txt names it; a save cut
# short never becomes latest) and continues with the same data order, RNG streams, optimizer
# and learning-rate state; the first start, with an empty directory, starts fresh. A checkpoint
# loads at any data-parallel size, so a restart with fewer nodes continues too; keep
# GLOBAL_BATCH a multiple of MICRO_BATCH x data-parallel size for every node count in
# MIN_NODES..MAX_NODES (the global batch, and so the run, is then the same). Work lost per fault:
# at most SAVE_INTERVAL iterations, plus the restart time. Keep the schedule flags (TRAIN_ITERS,
# lr, warmup, decay) as they were: a checkpoint whose schedule differs from the flags is refused
# unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says which wins.
#
#   MIN_NODES=2 MAX_NODES=4 MASTER_ADDR=node0.cluster JOB_ID=run42 \
#       CONFIG=shtools/configs/llama2_7b.sh CHECKPOINT_DIR=/shared/ckpt/run42 SAVE_INTERVAL=200 \
#       bash shtools/launch/elastic.sh
#   # one machine, restarts only (as the fault-injection tests run it):
#   MIN_NODES=1 MAX_NODES=1 GPUS_PER_NODE=2 MEGATRON_DEVICE=cpu CHECKPOINT_DIR=/tmp/ck \
#       bash shtools/launch/elastic.sh --num-layers 2 --hidden-size 64 --device cpu
#
# ---- variables (environment variables override them) ----
#   CONFIG         config file, relative to the current directory or the repository root
#                  (default shtools/configs/gpt_small.sh); it must set --save/--load (its
#                  CHECKPOINT_DIR) or a restart starts from scratch
#   MIN_NODES      nodes needed to start or continue (default 1)
#   MAX_NODES      most nodes used (default MIN_NODES)
#   GPUS_PER_NODE  processes per node (default 8)
#   MAX_RESTARTS   how many times torchrun restarts the workers before giving up (default 3)
#   MASTER_ADDR    host running the rendezvous store, reachable from all (default localhost)
#   MASTER_PORT    a free TCP port there (default 29500)
#   JOB_ID         rendezvous id, the same on every node, new for every job
#                  (default megatron-elastic)
#   MONITOR_INTERVAL  seconds between torchrun's checks of its workers (default 5)
#   TORCHRUN       the launcher command (default torchrun)
#   DRY_RUN        1: print the command instead of running it
set -euo pipefail
# One hardware queue per GPU: kernels run in issue order, so a tensor-parallel collective
# issued before a GEMM overlaps it (Megatron requires it for TP; pretrain checks it on CUDA).
export CUDA_DEVICE_MAX_CONNECTIONS=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONFIG=${CONFIG:-shtools/configs/gpt_small.sh}
MIN_NODES=${MIN_NODES:-1}
MAX_NODES=${MAX_NODES:-$MIN_NODES}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
JOB_ID=${JOB_ID:-megatron-elastic}
MONITOR_INTERVAL=${MONITOR_INTERVAL:-5}
read -r -a LAUNCHER <<< "${TORCHRUN:-torchrun}"
DRY_RUN=${DRY_RUN:-0}

[[ -f $CONFIG ]] || CONFIG=$ROOT/$CONFIG
# shellcheck source=/dev/null
source "$CONFIG"  # sets ENTRY_POINT, TRAIN_ITERS, CONFIG_FLAGS

ALL_FLAGS=("${CONFIG_FLAGS[@]}" "$@")
if [[ " ${ALL_FLAGS[*]} " != *" --load "* && " ${ALL_FLAGS[*]} " != *" --load="* ]]; then
    echo "warning: no --load in the flags (set CHECKPOINT_DIR): a restart starts from scratch" >&2
fi

CMD=("${LAUNCHER[@]}" --nnodes "$MIN_NODES:$MAX_NODES" --nproc-per-node "$GPUS_PER_NODE"
     --max-restarts "$MAX_RESTARTS" --monitor-interval "$MONITOR_INTERVAL"
     --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID"
     "$ROOT/$ENTRY_POINT" "${ALL_FLAGS[@]}")
if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
echo "elastic: $MIN_NODES..$MAX_NODES nodes x $GPUS_PER_NODE processes, up to $MAX_RESTARTS" \
     "restarts, rendezvous $MASTER_ADDR:$MASTER_PORT (id $JOB_ID), config $CONFIG" >&2
exec "${CMD[@]}"
