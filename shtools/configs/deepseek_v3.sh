# shellcheck shell=bash
# DeepSeek-V3 (671B) pretraining, its published shape: 61 layers, hidden 7168, 128 heads of
# multi-latent attention (query latent 1536, key/value latent 512, head dims 128 + 64 rotated,
# values 128, latent RMSNorms, interleaved RoPE with YaRN: factor 40 over 4096, mscale 1 /
# mscale_all_dim 1), the first 3 layers dense (FFN 18432), then 256 routed experts (FFN 2048)
# and 1 shared expert per layer, top-8 of sigmoid scores within the best 4 of 8 groups with
# the aux-loss-free bias, renormalised and scaled by 2.5, RMSNorm (eps 1e-6), untied output
# layer, 129280 vocabulary rows, bf16, the distributed optimizer, context 4096.
# 671,026,404,352 parameters (HF's DeepseekV3ForCausalLM of this shape), plus one multi-token
# prediction depth (loss weight 0.3, as published) on the last pipeline stage, which looks the
# tokens up in its own copy of the untied embedding.
# Convert from Hugging Face (bf16; the released FP8 weights must be dequantized first):
# tools/checkpoint/convert.py hf-to-megatron --load DeepSeek-V3 --save "$CHECKPOINT_DIR".
#
# Layout (default): TP=2 (with sequence parallelism), PP=16, EP=64 on 128 nodes of
# 8 x 80 GB GPUs (1024 GPUs: data parallel 32; each stage's 64 TP x DP ranks hold 4 of the
# 256 experts each, expert-data parallel 1); 61 layers over 16 stages: 3 (the dense ones,
# beside the embedding) on the first, 2 (beside the output layer) on the last, 4 on each
# other. Check memory
# with tools/plan_parallelism.py before a long run. GLOBAL_BATCH must be a multiple of
# MICRO_BATCH x data-parallel size.
#
# Sourced by shtools/launch/*.sh (CONFIG=shtools/configs/deepseek_v3.sh); defines ENTRY_POINT,
# TRAIN_ITERS and CONFIG_FLAGS (see shtools/configs/gpt_small.sh). With another PP, set
# FIRST_STAGE_LAYERS / LAST_STAGE_LAYERS so that the rest divide evenly (PP 1: unset them).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH, TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR   as in llama2_7b.sh
#   TP, PP, EP      tensor / pipeline / expert model-parallel sizes (default 2, 16, 64)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 4096 = 16M tokens)
#   TRAIN_ITERS, WARMUP_ITERS, SAVE_INTERVAL   (default 500000, 2000, 1000)

DATA_PATH=${DATA_PATH:-./data/deepseek_v3/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/deepseek_v3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/deepseek_v3/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/deepseek_v3/tensorboard}
TP=${TP:-2}
PP=${PP:-16}
EP=${EP:-64}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-4096}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
WARMUP_ITERS=${WARMUP_ITERS:-2000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
FIRST_STAGE_LAYERS=${FIRST_STAGE_LAYERS-3}
LAST_STAGE_LAYERS=${LAST_STAGE_LAYERS-2}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: DeepSeek-V3
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --rotary-interleaved
    --seq-length 4096 --max-position-embeddings 163840
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 10000
    --rope-type yarn --rotary-scaling-factor 40 --original-max-position-embeddings 4096
    --beta-fast 32 --beta-slow 1 --mscale 1 --mscale-all-dim 1
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.006
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
    # experts: 3 dense layers, then 256 routed + 1 shared
    --num-experts 256 --moe-ffn-hidden-size 2048 --moe-router-topk 8
    --moe-layer-freq "[0]*3+[1]*58" --moe-shared-expert-intermediate-size 2048
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-norm
    --moe-router-topk-scaling-factor 2.5 --moe-router-bias-update-rate 1e-3
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
if [[ -n $FIRST_STAGE_LAYERS ]]; then
    CONFIG_FLAGS+=(--decoder-first-pipeline-num-layers "$FIRST_STAGE_LAYERS")
fi
if [[ -n $LAST_STAGE_LAYERS ]]; then
    CONFIG_FLAGS+=(--decoder-last-pipeline-num-layers "$LAST_STAGE_LAYERS")
fi
