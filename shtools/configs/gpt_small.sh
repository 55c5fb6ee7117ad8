# shellcheck shell=bash
# GPT-2 small (124M parameters): 12 layers, hidden 768, 12 heads, learned absolute positions,
# LayerNorm, GeLU (tanh approximation, GPT-2's "gelu_new"), biases, tied input/output embedding.
# Runs anywhere: with no DATA_PATH it trains on --mock-data (random tokens) with NullTokenizer,
# so it needs no files; fp32, so it also runs on CPU (slowly at these sizes: shrink it with extra
# flags, which override these because the launch scripts pass "$@" last).
#
# A config is sourced by shtools/launch/*.sh (CONFIG=shtools/configs/gpt_small.sh) and defines
#   ENTRY_POINT   the training script, relative to the repository root
#   TRAIN_ITERS   the run's length (slurm.sbatch requeues until the checkpoint reaches it)
#   CONFIG_FLAGS  a bash array of Megatron flags
# Print its flags: bash -c 'source shtools/configs/gpt_small.sh; printf "%s\n" "${CONFIG_FLAGS[@]}"'
#
# Smoke test on CPU (2 processes, tiny sizes, 2 iterations, a few seconds):
#   MEGATRON_DEVICE=cpu GPUS_PER_NODE=2 CONFIG=shtools/configs/gpt_small.sh \
#     bash shtools/launch/single_node.sh --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
#     --seq-length 32 --vocab-size 128 --train-iters 2 --eval-iters 1 --device cpu
#
# ---- variables (environment variables override them) ----
#   TP, PP          tensor / pipeline model-parallel sizes (default 1, 1): the world size must be
#                   a multiple of TP x PP; the rest is data parallelism
#   MICRO_BATCH     sequences per microbatch per data-parallel rank (default 4)
#   GLOBAL_BATCH    sequences per optimizer step, all ranks (default 32); a multiple of
#                   MICRO_BATCH x data-parallel size
#   SEQ_LENGTH      tokens per sequence (default 1024, also the position-embedding table size)
#   TRAIN_ITERS     optimizer steps (default 2000)
#   DATA_PATH       Megatron dataset prefix(es) ('prefix' or 'w1 prefix1 w2 prefix2'), written by
#                   tools/preprocess_data.py; empty (default): --mock-data
#   VOCAB_FILE, MERGE_FILE   GPT-2 BPE vocab.json / merges.txt (needed with DATA_PATH)
#   MOCK_VOCAB_SIZE vocabulary of the mock data (default 50257, GPT-2's)
#   CHECKPOINT_DIR  --save and --load (the same directory: a restarted job resumes from its latest
#                   checkpoint); empty (default): no checkpoints
#   SAVE_INTERVAL   iterations between checkpoints (default 500)
#   TENSORBOARD_DIR TensorBoard event directory; empty (default): none

TP=${TP:-1}
PP=${PP:-1}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
SEQ_LENGTH=${SEQ_LENGTH:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-2000}
DATA_PATH=${DATA_PATH:-}
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
MOCK_VOCAB_SIZE=${MOCK_VOCAB_SIZE:-50257}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}

ENTRY_POINT=pretrain_gpt.py
CONFIG_FLAGS=(
    # model: GPT-2 small
    --num-layers 12 --hidden-size 768 --num-attention-heads 12
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute --normalization LayerNorm --openai-gelu
    --init-method-std 0.02 --attention-dropout 0.1 --hidden-dropout 0.1
    # parallelism
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    # optimizer and schedule (the warmup is a fraction, so shorter runs stay valid)
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    # logging and evaluation
    --log-interval 1 --eval-interval 200 --eval-iters 10
)
if [[ -n $DATA_PATH ]]; then
    CONFIG_FLAGS+=(--data-path "$DATA_PATH" --split 98,2,0
                   --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE"
                   --merge-file "$MERGE_FILE")
else
    CONFIG_FLAGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$MOCK_VOCAB_SIZE")
fi
if [[ -n $CHECKPOINT_DIR ]]; then
    CONFIG_FLAGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
                   --save-interval "$SAVE_INTERVAL")
fi
if [[ -n $TENSORBOARD_DIR ]]; then
    CONFIG_FLAGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi
