# shellcheck shell=bash
# Qwen2.5-7B continued pretraining (its published shape): 28 layers, hidden 3584, 28 heads of
# dim 128 with 4 key/value groups, biases on Q, K and V only, FFN 18944, RMSNorm (eps 1e-6),
# SwiGLU, RoPE (theta 1e6), untied output layer, Qwen's tokenizer from a local Hugging Face
# directory with the checkpoint's 152064 embedding rows kept (--padded-vocab-size), bf16, the
# distributed optimizer, context 4096 (its table holds 32768). 7,615,616,512 parameters.
# Start from Hugging Face weights: tools/checkpoint/convert.py hf-to-megatron --load Qwen2.5-7B
# --save "$CHECKPOINT_DIR" (its megatron_flags.txt matches these model flags).
#
# Layout (default): TP=2 (with sequence parallelism), PP=1, data parallel 4 on one node of
# 8 x 80 GB GPUs. Check memory with tools/plan_parallelism.py. GLOBAL_BATCH must be a multiple
# of MICRO_BATCH x data-parallel size.
#
# Sourced by shtools/launch/*.sh (CONFIG=shtools/configs/qwen2_5_7b.sh); defines ENTRY_POINT,
# TRAIN_ITERS and CONFIG_FLAGS (see shtools/configs/gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH, TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR   as in llama2_7b.sh
#   TP, PP          tensor / pipeline model-parallel sizes (default 2, 1)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 512 = 2M tokens)
#   TRAIN_ITERS, WARMUP_ITERS, SAVE_INTERVAL   (default 100000, 500, 1000)

DATA_PATH=${DATA_PATH:-./data/qwen2_5/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/qwen2_5}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/qwen2_5_7b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/qwen2_5_7b/tensorboard}
TP=${TP:-2}
PP=${PP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-100000}
WARMUP_ITERS=${WARMUP_ITERS:-500}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: Qwen2.5-7B
    --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28
    --group-query-attention --num-query-groups 4 --kv-channels 128 --add-qkv-bias
    --seq-length 4096 --max-position-embeddings 32768
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 1000000
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
    # tokenizer: ~151.7K tokens in the checkpoint's 152064 rows
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --padded-vocab-size 152064
    # parallelism, precision, memory
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
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
    CONFIG_FLAGS+=(--sequence-parallel)  # needs TP > 1
fi
