# shellcheck shell=bash
# A DeepSeek-V3-shaped model that fits one node (9.4B parameters, 1.5B active): 16 layers,
# hidden 2048, 16 heads of multi-latent attention (no query latent, key/value latent 512, head
# dims 128 + 64 rotated, values 128, latent RMSNorms, interleaved RoPE), the first layer dense
# (FFN 10944), then 64 routed experts (FFN 1408) and 2 shared ones per layer, top-6 of sigmoid
# scores within the best 4 of 8 groups with the aux-loss-free bias, renormalised, one
# multi-token prediction depth (loss weight 0.3), RMSNorm (eps 1e-6), untied output layer,
# DeepSeek-V3's 129280 vocabulary rows, bf16, the distributed optimizer, context 4096.
# 9,383,258,112 parameters besides the MTP depth (HF's DeepseekV3ForCausalLM of this shape).
#
# Layout (default): TP=1, PP=1, EP=8 on one node of 8 x 80 GB GPUs (data parallel 8, each
# rank holds 8 experts per layer). Check memory with tools/plan_parallelism.py.
# GLOBAL_BATCH must be a multiple of MICRO_BATCH x data-parallel size.
#
# Sourced by shtools/launch/*.sh (CONFIG=shtools/configs/deepseek_v3_small.sh); defines
# ENTRY_POINT, TRAIN_ITERS and CONFIG_FLAGS (see shtools/configs/gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH, TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR   as in llama2_7b.sh
#   TP, PP, EP      tensor / pipeline / expert model-parallel sizes (default 1, 1, 8)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 512 = 2M tokens)
#   TRAIN_ITERS, WARMUP_ITERS, SAVE_INTERVAL   (default 100000, 1000, 1000)

DATA_PATH=${DATA_PATH:-./data/deepseek_v3/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/deepseek_v3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/deepseek_v3_small/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/deepseek_v3_small/tensorboard}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-8}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-100000}
WARMUP_ITERS=${WARMUP_ITERS:-1000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: DeepSeek-V3's design at 9.4B
    --num-layers 16 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16
    --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --rotary-interleaved
    --seq-length 4096 --max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 10000
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.006
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
    # experts: 1 dense layer, then 64 routed + 2 shared
    --num-experts 64 --moe-ffn-hidden-size 1408 --moe-router-topk 6
    --moe-layer-freq "[0]*1+[1]*15" --moe-shared-expert-intermediate-size 2816
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-norm
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    # tokenizer: DeepSeek-V3's 129280 rows
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --padded-vocab-size 129280
    # parallelism, precision, memory
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
    --bf16 --use-distributed-optimizer --overlap-grad-reduce
    # optimizer and schedule
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
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
