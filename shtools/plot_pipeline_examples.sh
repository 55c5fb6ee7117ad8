#!/usr/bin/env bash
# Draw pipeline_1f1b.png and pipeline_interleaved.png from real CPU runs: torchrun on $PP
# processes (default 2), one pipeline stage each, of a small GPT (8 layers, hidden 512,
# sequence 256, mock data, 8 microbatches), traced at iteration 2 (--pipeline-trace-dir) and
# drawn by tools/plot_pipeline.py; once with 1F1B, once interleaved (2 model chunks per rank).
#   bash shtools/plot_pipeline_examples.sh          # under a minute on 2 CPU cores
#   OUT_DIR=docs bash shtools/plot_pipeline_examples.sh   # refresh the tracked docs/ images
# The images go to $OUT_DIR, default ./pipeline_examples (not the tracked docs/: only when
# asked). The traces are kept under $TRACE_DIR (default: a temporary directory, removed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-pipeline_examples}
mkdir -p "$OUT_DIR"
PP=${PP:-2}  # pipeline stages = processes: 2 keeps one per core here; PP=4 shares them
if [[ -z "${TRACE_DIR:-}" ]]; then
    TRACE_DIR=$(mktemp -d)
    trap 'rm -rf "$TRACE_DIR"' EXIT
fi
# CPU and gloo, one thread per process: the stages' compute does not fight over threads.
export MEGATRON_DEVICE=cpu OMP_NUM_THREADS=1
FLAGS=(--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 256
       --max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8
       --train-iters 2 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
       --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 1000
       --eval-iters 1 --pipeline-model-parallel-size "$PP" --pipeline-trace-iteration 2)

trace_and_plot() {  # NAME [extra flags]
    local name=$1
    shift
    rm -rf "${TRACE_DIR:?}/$name"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$PP" pretrain_gpt.py \
        "${FLAGS[@]}" --pipeline-trace-dir "$TRACE_DIR/$name" "$@"
    "$PYTHON" tools/plot_pipeline.py "$TRACE_DIR/$name" --out "$OUT_DIR/pipeline_$name.png"
}

trace_and_plot 1f1b
trace_and_plot interleaved --num-layers-per-virtual-pipeline-stage $((8 / PP / 2))
echo "wrote $OUT_DIR/pipeline_1f1b.png and $OUT_DIR/pipeline_interleaved.png"
