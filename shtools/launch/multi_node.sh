#!/usr/bin/env bash
# Train on several machines: run this script once on EVERY node (same command, same variables);
# each starts one torchrun with GPUS_PER_NODE processes, and the torchruns meet through torchrun's
# c10d rendezvous at MASTER_ADDR:MASTER_PORT (a TCP store hosted by the torchrun on that
# machine), which assigns node ranks itself: no NODE_RANK to set. Extra arguments are appended
# to the config's flags and, coming last, override them.
#
#   # on node 0 (node0.cluster) and on node 1, the same line:
#   NNODES=2 MASTER_ADDR=node0.cluster JOB_ID=run42 CONFIG=shtools/configs/llama2_7b.sh \
#       DATA_PATH=/data/corpus_text_document TOKENIZER_DIR=/models/Llama-2-7b-hf \
#       CHECKPOINT_DIR=/shared/ckpt/run42 bash shtools/launch/multi_node.sh
#   DRY_RUN=1 NNODES=2 MASTER_ADDR=node0 bash shtools/launch/multi_node.sh   # print the command
#
# Paths (data, tokenizer, CHECKPOINT_DIR) must name the same files on every node: a shared file
# system. The world size is NNODES x GPUS_PER_NODE; it must be a multiple of the config's TP x PP,
# and the config's GLOBAL_BATCH a multiple of MICRO_BATCH x data-parallel size. With --save and
# --load the same directory (the configs' CHECKPOINT_DIR), rerunning the command after a failure
# continues from the latest complete checkpoint. For automatic restarts see elastic.sh; on
# Slurm use slurm.sbatch.
#
# ---- variables (environment variables override them) ----
#   CONFIG         config file, relative to the current directory or the repository root
#                  (default shtools/configs/llama2_7b.sh); its variables are documented at its top
#   NNODES         number of nodes (default 2)
#   GPUS_PER_NODE  processes per node (default 8)
#   MASTER_ADDR    host name or address of one of the nodes, reachable from all (default
#                  localhost: every "node" on this machine, for trying it out)
#   MASTER_PORT    a free TCP port there (default 29500)
#   JOB_ID         rendezvous id, the same on every node and new for every job (default
#                  megatron-$NNODES-nodes); stale agents of another job with the same id would join
#   TORCHRUN       the launcher command (default torchrun)
#   DRY_RUN        1: print the command instead of running it
set -euo pipefail
# One hardware queue per GPU: kernels run in issue order, so a tensor-parallel collective
# issued before a GEMM overlaps it (Megatron requires it for TP; pretrain checks it on CUDA).
export CUDA_DEVICE_MAX_CONNECTIONS=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONFIG=${CONFIG:-shtools/configs/llama2_7b.sh}
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
JOB_ID=${JOB_ID:-megatron-$NNODES-nodes}
read -r -a LAUNCHER <<< "${TORCHRUN:-torchrun}"
DRY_RUN=${DRY_RUN:-0}

[[ -f $CONFIG ]] || CONFIG=$ROOT/$CONFIG
# shellcheck source=/dev/null
source "$CONFIG"  # sets ENTRY_POINT, TRAIN_ITERS, CONFIG_FLAGS

CMD=("${LAUNCHER[@]}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID"
     "$ROOT/$ENTRY_POINT" "${CONFIG_FLAGS[@]}" "$@")
if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi

# On the rendezvous host, a port another program listens on makes every torchrun wait for a
# store that never answers (silently, for the whole join timeout). The first node of this job
# to start here finds it free; the others of the same job (all "nodes" on one machine) find
# its store, so a mark per port and job id tells them apart.
is_this_host() {
    case $1 in localhost|127.*|::1) return 0 ;; esac
    [[ $1 == "$(hostname)" || $1 == "$(hostname -f 2>/dev/null)" ]] && return 0
    hostname -I 2>/dev/null | tr ' ' '\n' | grep -qxF -- "$1"
}
port_taken() {
    python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)' "$1"
}
if is_this_host "$MASTER_ADDR"; then
    MARK=${TMPDIR:-/tmp}/megatron-rendezvous-$MASTER_PORT-$JOB_ID
    if [[ ! -e $MARK ]] && port_taken "$MASTER_PORT"; then
        echo "error: MASTER_PORT $MASTER_PORT on $MASTER_ADDR is already in use by another" \
             "program (an earlier job?): the rendezvous would wait for it forever; set" \
             "MASTER_PORT to a free port on every node" >&2
        exit 2
    fi
    touch "$MARK"
fi
echo "multi node: $NNODES nodes x $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT" \
     "(id $JOB_ID), config $CONFIG" >&2
exec "${CMD[@]}"
