# shellcheck shell=bash
# LLaMA-2 7B pretraining: 32 layers, hidden 4096, 32 heads (no GQA), FFN 11008, context 4096,
# RMSNorm (eps 1e-5), SwiGLU, RoPE (theta 10000), no biases, untied output layer, vocabulary
# from a local Hugging Face tokenizer directory (LLaMA-2's: 32000 tokens), bf16, the distributed
# optimizer (ZeRO-1) with overlapped gradient reduce and parameter gather (no selective
# recomputation: flash attention keeps no s x s softmax to drop); AdamW (0.9, 0.95, eps 1e-5), lr 3e-4 cosine to 3e-5 after 2000 warmup steps,
# weight decay 0.1, gradient clipping 1.0, 4M tokens per step (1024 x 4096), as in the paper.
#
# Layout for one node of 8 x 80 GB GPUs (default): TP=2 (with sequence parallelism), PP=1,
# data parallel 4. TP=1 (data parallel 8) also fits in 80 GB and is
# faster if it does on your cluster; on more nodes keep TP=2 (within a node) and let the data
# parallel size grow. GLOBAL_BATCH must be a multiple of MICRO_BATCH x data-parallel size.
#
# A config is sourced by shtools/launch/*.sh (CONFIG=shtools/configs/llama2_7b.sh) and defines
# ENTRY_POINT, TRAIN_ITERS and the array CONFIG_FLAGS (see shtools/configs/gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_PATH       Megatron dataset prefix(es), 'prefix' or 'w1 prefix1 w2 prefix2 ...', written
#                   by tools/preprocess_data.py --tokenizer-type PretrainedFromHF with the same
#                   tokenizer (default ./data/llama2/corpus_text_document)
#   TOKENIZER_DIR   local Hugging Face tokenizer directory, e.g. a Llama-2-7b-hf download
#                   (default ./tokenizers/llama2); nothing is downloaded
#   CHECKPOINT_DIR  --save and --load: the same directory, so a restarted or requeued job resumes
#                   from its latest complete checkpoint (default ./runs/llama2_7b/checkpoints)
#   TENSORBOARD_DIR TensorBoard events (default ./runs/llama2_7b/tensorboard)
#   TP, PP          tensor / pipeline model-parallel sizes (default 2, 1)
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 1)
#   GLOBAL_BATCH    sequences per optimizer step (default 1024 = 4M tokens)
#   TRAIN_ITERS     optimizer steps (default 500000 = 2T tokens)
#   WARMUP_ITERS    learning-rate warmup steps (default 2000)
#   SAVE_INTERVAL   iterations between checkpoints (default 1000)

DATA_PATH=${DATA_PATH:-./data/llama2/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/llama2}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/llama2_7b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/llama2_7b/tensorboard}
TP=${TP:-2}
PP=${PP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
WARMUP_ITERS=${WARMUP_ITERS:-2000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    # model: LLaMA-2 7B
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 10000
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
    # tokenizer (32000 tokens: a multiple of 128 x TP, so no padding and HF-compatible shapes)
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --make-vocab-size-divisible-by 128
    # parallelism, precision, memory
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
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
    --tensorboard-dir "$TENSORBOARD_DIR" --log-validation-ppl-to-tensorboard
)
if (( TP > 1 )); then
    CONFIG_FLAGS+=(--sequence-parallel)  # needs TP > 1
fi
