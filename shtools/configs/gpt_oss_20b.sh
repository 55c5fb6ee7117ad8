# shellcheck shell=bash
# gpt-oss-20b continued pretraining (its published shape): 24 layers, hidden 2880, 64 heads of
# dim 64 with 8 key/value groups, learned attention sinks, a 128-token sliding window on every
# other layer (layers 1, 3, ...; 2, 4, ... full), YaRN RoPE (theta 150000, factor 32 over 4096,
# unrounded correction range), biases on Q/K/V/O, every layer an MoE of 32 experts (FFN 2880,
# biases, clamped quick-GeGLU: limit 7, +1 on the up half) with a biased top-4 router, RMSNorm
# (eps 1e-5), untied output layer, the o200k tokenizer's 201088 rows kept
# (--padded-vocab-size), bf16, the distributed optimizer, context 4096 (its table holds
# 131072). 20,914,757,184 parameters (HF's num_parameters() of the bf16 model).
# Start from Hugging Face weights (bf16; the released MXFP4 experts must be dequantized
# first): tools/checkpoint/convert.py hf-to-megatron --load gpt-oss-20b --save
# "$CHECKPOINT_DIR" (its megatron_flags.txt matches these model flags).
#
# Layout (default): TP=1, PP=1, EP=8 on one node of 8 x 80 GB GPUs (data parallel 8, each rank
# holds 4 experts per layer; the biased experts need expert TP 1). Check memory with
# tools/plan_parallelism.py. GLOBAL_BATCH must be a multiple of MICRO_BATCH x data-parallel
# size.
#
# Sourced by shtools/launch/*.sh (CONFIG=shtools/configs/gpt_oss_20b.sh); defines ENTRY_POINT,
# TRAIN_ITERS and CONFIG_FLAGS (see shtools/configs/gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH, TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR   as in llama2_7b.sh
#   TP, PP, EP      tensor / pipeline / expert model-parallel sizes (default 1, 1, 8)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 512 = 2M tokens)
#   TRAIN_ITERS, WARMUP_ITERS, SAVE_INTERVAL   (default 100000, 500, 1000)

DATA_PATH=${DATA_PATH:-./data/gpt_oss/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/gpt_oss}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/gpt_oss_20b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/gpt_oss_20b/tensorboard}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-8}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-100000}
WARMUP_ITERS=${WARMUP_ITERS:-500}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: gpt-oss-20b
    --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --kv-channels 64
    --seq-length 4096 --max-position-embeddings 131072
    --normalization RMSNorm --norm-epsilon 1e-5
    --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7
    --position-embedding-type rope --rotary-base 150000
    --rope-type yarn --rotary-scaling-factor 32 --original-max-position-embeddings 4096
    --beta-fast 32 --beta-slow 1 --no-yarn-correction-range-round-to-int
    --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
    --add-qkv-bias --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
    # experts
    --num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4 --moe-router-bias
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    # tokenizer: o200k_harmony, 201088 rows in the checkpoint
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --padded-vocab-size 201088
    # parallelism, precision, memory
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
    --bf16 --use-distributed-optimizer --overlap-grad-reduce
    # optimizer and schedule (continued pretraining: a lower peak than from scratch)
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
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
