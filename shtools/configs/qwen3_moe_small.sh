# shellcheck shell=bash
# A small Qwen3-MoE (Qwen3-30B-A3B's shape: 48 layers, hidden 2048, 32 heads of dim 128 with 4
# key/value groups, q/k RMSNorm per head, every layer an MoE of 128 SwiGLU experts (FFN 768)
# with top-8 routing: softmax over all experts, top-8, renormalised (norm_topk_prob), aux loss
# 0.001, RMSNorm (eps 1e-6), RoPE (theta 1e6), no biases, untied output layer, Qwen's
# 151936-token vocabulary from a local Hugging Face tokenizer directory, bf16, the distributed
# optimizer, context 4096. Converted to/from HF Qwen3MoeForCausalLM by tools/checkpoint/convert.py.
#
# Layout (default): TP=1, PP=2, EP=8 on 2+ nodes of 8 x 80 GB GPUs (data parallel 8 at 16
# GPUs). Check memory with tools/plan_parallelism.py. GLOBAL_BATCH must be a multiple of
# MICRO_BATCH x data-parallel size.
#
# Sourced by shtools/launch/*.sh (CONFIG=shtools/configs/qwen3_moe_small.sh); defines
# ENTRY_POINT, TRAIN_ITERS and CONFIG_FLAGS (see shtools/configs/gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH, TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR   as in llama2_7b.sh
#   TP, PP, EP      tensor / pipeline / expert model-parallel sizes (default 1, 2, 8)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 1024 = 4M tokens)
#   TRAIN_ITERS, WARMUP_ITERS, SAVE_INTERVAL   (default 500000, 2000, 1000)

DATA_PATH=${DATA_PATH:-./data/qwen3/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/qwen3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/qwen3_moe_small/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/qwen3_moe_small/tensorboard}
TP=${TP:-1}
PP=${PP:-2}
EP=${EP:-8}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
WARMUP_ITERS=${WARMUP_ITERS:-2000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: Qwen3-30B-A3B's shape
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
    --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 1000000
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
    # experts
    --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
    --moe-router-pre-softmax --moe-router-topk-norm
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    # tokenizer
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --make-vocab-size-divisible-by 128
    # parallelism, precision, memory
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --bf16 --use-distributed-optimizer --overlap-grad-reduce
    # optimizer and schedule
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    # data
    --data-path "$DATA_PATH" --split 99,1,0
    # checkpoints: --save and --load the same directory = auto-resume
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
    # logging and evaluation
    --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR"
)
if (( TP > 1 )); then
    CONFIG_FLAGS+=(--sequence-parallel)  # MoE with TP needs it
fi
