#!/usr/bin/env bash
# Convert a Hugging Face LLaMA / Mistral / GPT-2 / Mixtral / Qwen2-MoE / Qwen3-MoE model
# directory into a Megatron checkpoint ('release', loadable with --load by pretrain_llama.py /
# pretrain_gpt.py at any TP/PP/VPP/EP).
#
#   HF_DIR=/models/Meta-Llama-3-8B SAVE=/ckpt/llama3-8b TP=2 PP=2 \
#       bash shtools/checkpoint_conversion/hf_to_megatron.sh
#   bash shtools/checkpoint_conversion/hf_to_megatron.sh HF_DIR SAVE [TP [PP [VPP_LAYERS]]] \
#       [-- extra tools/checkpoint/convert.py hf-to-megatron flags]
#
# Settings (environment variables, or positional arguments in this order):
#   HF_DIR      the Hugging Face directory: config.json + model*.safetensors or
#               pytorch_model*.bin (+ tokenizer files); local, nothing is downloaded
#   SAVE        output directory, new or empty
#   TP          tensor-parallel size (default 1); must divide the heads and query groups
#   PP          pipeline-parallel size (default 1); must divide the layers
#   VPP_LAYERS  layers per virtual pipeline stage (--num-layers-per-virtual-pipeline-stage;
#               default: no interleaving)
#   EP          MoE models: expert-parallel size (default 1); must divide the experts
#   ETP         MoE models: expert tensor-parallel size (default: TP)
#   MAKE_VOCAB_SIZE_DIVISIBLE_BY  vocabulary padding unit, as in training (default 128)
#   CKPT_FORMAT torch_dist (default, the sharded format training saves: SAVE/release/
#               metadata.json + shard_00000.safetensors, every tensor whole, loads at any
#               layout; TP/PP/VPP then only set the flags) or torch (SAVE/release/mp_rank_*/
#               model_optim_rng.pt cut for TP x PP)
#   PYTHON      interpreter (default python3)
# Writes SAVE/release/, SAVE/latest_checkpointed_iteration.txt, SAVE/tokenizer/ and
# SAVE/megatron_flags.txt (the flags that train from it). A failed run leaves nothing behind.
# Runs on CPU; needs about twice the model's size in memory.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
positional=()
while [[ $# -gt 0 && $1 != -* ]]; do positional+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
HF_DIR=${positional[0]:-${HF_DIR:-}}
SAVE=${positional[1]:-${SAVE:-}}
TP=${positional[2]:-${TP:-1}}
PP=${positional[3]:-${PP:-1}}
VPP_LAYERS=${positional[4]:-${VPP_LAYERS:-}}
MAKE_VOCAB_SIZE_DIVISIBLE_BY=${MAKE_VOCAB_SIZE_DIVISIBLE_BY:-128}
CKPT_FORMAT=${CKPT_FORMAT:-torch_dist}
EP=${EP:-}
ETP=${ETP:-}
if [[ -z $HF_DIR || -z $SAVE ]]; then
    echo "usage: HF_DIR=... SAVE=... [TP=1 PP=1 VPP_LAYERS=] $0" >&2
    echo "   or: $0 HF_DIR SAVE [TP [PP [VPP_LAYERS]]] [-- convert.py flags]" >&2
    exit 2
fi

args=(hf-to-megatron --load "$HF_DIR" --save "$SAVE"
      --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --make-vocab-size-divisible-by "$MAKE_VOCAB_SIZE_DIVISIBLE_BY" --ckpt-format "$CKPT_FORMAT")
[[ -n $VPP_LAYERS ]] && args+=(--num-layers-per-virtual-pipeline-stage "$VPP_LAYERS")
[[ -n $EP ]] && args+=(--expert-model-parallel-size "$EP")
[[ -n $ETP ]] && args+=(--expert-tensor-parallel-size "$ETP")
exec "$PYTHON" "$ROOT/tools/checkpoint/convert.py" "${args[@]}" "$@"
