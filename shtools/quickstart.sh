#!/usr/bin/env bash
# The quickest look at the framework, with nothing to download (a few minutes on 2 CPU cores):
#   1. install what is missing (shtools/install_deps.sh),
#   2. generate a small English-like corpus and train a byte-level BPE tokenizer on it,
#   3. tokenize it into Megatron .bin/.idx files (tools/preprocess_data.py),
#   4. pretrain a small LLaMA (RMSNorm, SwiGLU, RoPE, GQA, untied output) with
#      torchrun pretrain_llama.py on 4 processes: tensor parallel 2 x pipeline parallel 2,
#      CPU/gloo, fp32, with evaluation, checkpoints and TensorBoard,
#   5. convert the last checkpoint to a Hugging Face model (tools/checkpoint/convert.py) and
#      generate a few tokens from it with transformers (tools/checkpoint/generate.py),
#   6. print where everything went, and the final loss against the corpus's unigram entropy
#      (the loss of a model that knows only token frequencies).
# Everything goes under $QUICKSTART_DIR; a rerun regenerates it all (the same bytes: fixed seeds)
# and replaces the previous run's checkpoints and TensorBoard events.
#
#   bash shtools/quickstart.sh                        # everything in ./quickstart_run
#   QUICKSTART_DIR=/tmp/qs bash shtools/quickstart.sh --train-iters 400   # extra flags go to
#                                                     # pretrain_llama.py and override these
set -euo pipefail

# ---- settings (environment variables override them) ----
PYTHON=${PYTHON:-python3}
QUICKSTART_DIR=${QUICKSTART_DIR:-./quickstart_run}
NUM_DOCS=${NUM_DOCS:-6000}         # documents in the generated corpus
VOCAB_SIZE=${VOCAB_SIZE:-512}      # byte-level BPE vocabulary
NPROC=4 TP=2 PP=2                  # 4 processes = TP 2 x PP 2 (x DP 1)
TRAIN_ITERS=${TRAIN_ITERS:-200}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
MODEL_ARGS=(
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 176
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 128 --max-position-embeddings 128
    --normalization RMSNorm --swiglu --position-embedding-type rope
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.1 --clip-grad 1.0 --device cpu   # fp32: no --bf16 on CPU
)

# ---- paths ----
mkdir -p "$QUICKSTART_DIR"
RUN_DIR=$(cd "$QUICKSTART_DIR" && pwd)  # absolute, relative to where the script was started
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DATA_PREFIX=$RUN_DIR/data/quickstart
TOKENIZER=$RUN_DIR/tokenizer
CHECKPOINTS=$RUN_DIR/checkpoints
TENSORBOARD=$RUN_DIR/tensorboard
TRAIN_LOG=$RUN_DIR/train.log
HF_MODEL=$RUN_DIR/hf_model

echo "== 1/5 install check"
bash shtools/install_deps.sh dev

echo "== 2/5 corpus and tokenizer -> $RUN_DIR"
"$PYTHON" tools/make_quickstart_corpus.py --output-dir "$RUN_DIR" --num-docs "$NUM_DOCS" \
    --vocab-size "$VOCAB_SIZE"

echo "== 3/5 preprocess -> ${DATA_PREFIX}_text_document.bin/.idx"
mkdir -p "$RUN_DIR/data"
"$PYTHON" tools/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --output-prefix "$DATA_PREFIX" \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER" \
    --append-eod --workers 2 --log-interval 100000

echo "== 4/5 pretrain_llama.py: $NPROC processes, TP=$TP x PP=$PP (log: $TRAIN_LOG)"
# Start over: a previous run's checkpoints and TensorBoard events would mix with this run's.
rm -rf "$CHECKPOINTS" "$TENSORBOARD"
MEGATRON_DEVICE=cpu OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" pretrain_llama.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    --data-path "${DATA_PREFIX}_text_document" --split 98,2,0 \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER" \
    --log-interval 10 --eval-interval 100 --eval-iters 4 \
    --save "$CHECKPOINTS" --save-interval "$SAVE_INTERVAL" \
    --tensorboard-dir "$TENSORBOARD" --log-validation-ppl-to-tensorboard \
    "$@" 2>&1 | tee "$TRAIN_LOG"

echo "== 5/5 the last checkpoint as a Hugging Face model -> $HF_MODEL, and a few tokens from it"
rm -rf "$HF_MODEL"
"$PYTHON" tools/checkpoint/convert.py megatron-to-hf --load "$CHECKPOINTS" --save "$HF_MODEL"
"$PYTHON" tools/checkpoint/generate.py --hf-dir "$HF_MODEL" \
    --prompt "Mia lives in" --prompt "Count with me: three, four," --prompt "two plus two is"

# ---- summary ----
number() {  # number PATTERN FIELD head|tail: a value from the training log, 3 decimals
    local value
    value=$(grep -o "$1 [0-9.E+-]*" "$TRAIN_LOG" | "$3" -n 1 | cut -d' ' -f"$2") || true
    printf '%.3f' "${value:-nan}"
}
ENTROPY=$(grep -o '"unigram_entropy_nats": [0-9.]*' "$RUN_DIR/corpus_stats.json" | cut -d' ' -f2)
SAVED="(none saved)"
if [ -f "$CHECKPOINTS/latest_checkpointed_iteration.txt" ]; then
    SAVED="(latest: iteration $(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt"))"
fi
cat <<EOF

== quickstart done in ${SECONDS} s; everything is under $RUN_DIR
  corpus       $RUN_DIR/corpus.jsonl (stats: $RUN_DIR/corpus_stats.json)
  tokenizer    $TOKENIZER
  data         ${DATA_PREFIX}_text_document.bin/.idx
  checkpoints  $CHECKPOINTS $SAVED
  tensorboard  $TENSORBOARD   (tensorboard --logdir $TENSORBOARD)
  HF model     $HF_MODEL   (AutoModelForCausalLM.from_pretrained)
  train log    $TRAIN_LOG
  unigram token entropy of the corpus: $(printf '%.3f' "$ENTROPY") nats
  lm loss: first logged $(number 'lm loss:' 3 head), final $(number 'lm loss:' 3 tail), \
validation $(number 'lm loss value:' 4 tail) nats
EOF
