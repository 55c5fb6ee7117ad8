# shellcheck shell=bash
# LLaMA 13B with Megatron-LLaMA's flag set, flag for flag (Megatron-LLaMA's example 13B
# launch line, the one tests/unit/test_arguments.py LAUNCH checks), its paths as variables,
# less --recompute-activations (selective recomputation saves nothing with flash attention):
# 40 layers, hidden 5120, 40 heads, FFN 13824, context 2048, RMSNorm 1e-6, SwiGLU, rotary
# embeddings, no biases, bf16, TP=2 with sequence parallelism, PP=1, Megatron-LLaMA's
# overlapped distributed optimizer (buckets of 2e8); micro batch 2,
# global batch 64: 8 GPUs (data parallel 4) or any multiple of 2 GPUs that divides 32.
#
# It continues training a converted checkpoint (tools/checkpoint/convert.py hf-to-megatron):
# --finetune loads the weights only and starts at iteration 0, and --no-load-optim skips the
# optimizer state. Because --save and --load are the same directory, a RESTARTED job with these
# two flags would reload the latest weights but start over at iteration 0 with a fresh
# optimizer: for runs that must resume (Slurm requeue, elastic restarts), start once with them,
# then drop --finetune and --no-load-optim (edit the array below) so restarts resume exactly.
#
# A config is sourced by shtools/launch/*.sh (CONFIG=shtools/configs/llama_13b_megatron_llama.sh)
# and defines ENTRY_POINT, TRAIN_ITERS and the array CONFIG_FLAGS (see gpt_small.sh).
#
# ---- variables (environment variables override them) ----
#   DATA_DIR        directory holding the three datasets D1, D2, D3 (.bin/.idx, from
#                   tools/preprocess_data.py) (default ./data/llama_13b)
#   DATA_PATH       the blend (default "0.2 $DATA_DIR/D1 0.3 $DATA_DIR/D2 0.5 $DATA_DIR/D3")
#   TOKENIZER_DIR   local Hugging Face tokenizer directory (default ./tokenizers/llama)
#   CHECKPOINT_DIR  --save and --load (default ./runs/llama_13b/checkpoints); put the converted
#                   checkpoint here for the first start
#   TENSORBOARD_DIR TensorBoard events (default ./runs/llama_13b/tensorboard)
#   JOB_NAME        --job-name (default llama_13b)
#   TRAIN_ITERS     --train-iters (default 1000)

DATA_DIR=${DATA_DIR:-./data/llama_13b}
DATA_PATH=${DATA_PATH:-"0.2 $DATA_DIR/D1 0.3 $DATA_DIR/D2 0.5 $DATA_DIR/D3"}
TOKENIZER_DIR=${TOKENIZER_DIR:-./tokenizers/llama}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./runs/llama_13b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-./runs/llama_13b/tensorboard}
JOB_NAME=${JOB_NAME:-llama_13b}
TRAIN_ITERS=${TRAIN_ITERS:-1000}

ENTRY_POINT=pretrain_llama.py
CONFIG_FLAGS=(
    --finetune --sequence-parallel --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1 --num-layers 40 --hidden-size 5120 --num-attention-heads 40
    --seq-length 2048 --max-position-embeddings 2048 --no-position-embedding
    --use-rotary-position-embeddings --swiglu --ffn-hidden-size 13824 --disable-bias-linear
    --RMSNorm --attention-dropout 0 --hidden-dropout 0 --layernorm-epsilon 1e-6 --causal-lm
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_DIR"
    --make-vocab-size-divisible-by 1
    --init-method-std 0.01 --micro-batch-size 2 --global-batch-size 64
    --train-iters "$TRAIN_ITERS"
    --lr 6.0e-5 --lr-decay-iters 10 --lr-warmup-iters 5 --min-lr 6.0e-6
    --override-opt_param-scheduler --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
    --clip-grad 1.0 --weight-decay 0.1 --overlapped-distributed-optimizer
    --reduce-bucket-size=2e8
    --no-gradient-accumulation-fusion --dataloader-type cyclic --data-impl mmap
    --data-path "$DATA_PATH" --split 98,2,0 --eval-interval 1000
    --eval-iters 10 --save-interval 100 --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
    --no-load-optim --log-interval 1
    --tensorboard-dir "$TENSORBOARD_DIR" --tensorboard-queue-size 1000
    --log-timers-to-tensorboard
    --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --job-name "$JOB_NAME"
    --bf16 --use-flash-attn
)
