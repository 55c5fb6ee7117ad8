#!/usr/bin/env bash
# Convert a Megatron checkpoint (any TP/PP/VPP, either format: the sharded torch_dist or the
# torch mp_rank_* files; written by training or by hf_to_megatron.sh)
# into a Hugging Face directory that transformers' AutoModelForCausalLM.from_pretrained loads:
# sharded safetensors, config.json, generation_config.json and the tokenizer files.
#
#   LOAD=/ckpt/llama3-8b-run SAVE=/models/llama3-8b-run-hf \
#       bash shtools/checkpoint_conversion/megatron_to_hf.sh
#   bash shtools/checkpoint_conversion/megatron_to_hf.sh LOAD SAVE [CKPT_STEP] \
#       [-- extra tools/checkpoint/convert.py megatron-to-hf flags]
#
# Settings (environment variables, or positional arguments in this order):
#   LOAD            the checkpoint directory (holding latest_checkpointed_iteration.txt)
#   SAVE            output directory, new or empty
#   CKPT_STEP       iteration to convert (default: the latest, or release)
#   MAX_SHARD_SIZE  largest safetensors file (default 5GB)
#   TOKENIZER_DIR   tokenizer files to ship (default: LOAD/tokenizer, else the tokenizer
#                   directory the checkpoint was trained with)
#   PYTHON          interpreter (default python3)
# The architecture (LLaMA or GPT-2) comes from the args stored in the checkpoint. A failed
# run leaves nothing behind. Runs on CPU; needs about twice the model's size in memory.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
positional=()
while [[ $# -gt 0 && $1 != -* ]]; do positional+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
LOAD=${positional[0]:-${LOAD:-}}
SAVE=${positional[1]:-${SAVE:-}}
CKPT_STEP=${positional[2]:-${CKPT_STEP:-}}
MAX_SHARD_SIZE=${MAX_SHARD_SIZE:-5GB}
TOKENIZER_DIR=${TOKENIZER_DIR:-}
if [[ -z $LOAD || -z $SAVE ]]; then
    echo "usage: LOAD=... SAVE=... [CKPT_STEP=N] $0   (or: $0 LOAD SAVE [CKPT_STEP])" >&2
    exit 2
fi

args=(megatron-to-hf --load "$LOAD" --save "$SAVE" --max-shard-size "$MAX_SHARD_SIZE")
[[ -n $CKPT_STEP ]] && args+=(--ckpt-step "$CKPT_STEP")
[[ -n $TOKENIZER_DIR ]] && args+=(--tokenizer-dir "$TOKENIZER_DIR")
exec "$PYTHON" "$ROOT/tools/checkpoint/convert.py" "${args[@]}" "$@"
