#!/usr/bin/env bash
# One prepared GPU run: everything a lent GPU should tell us, in one command of at most
# 9 minutes, each step's log written as it goes (a timeout loses nothing).
#   bash shtools/gpu_run.sh OUTDIR            # on one H100/H200
#   bash shtools/gpu_run.sh OUTDIR --dry-run  # the same steps on CPU with tiny sizes
# OUTDIR gets at most 8 files (what a lent machine sends back): summary.txt (each step, its
# exit code and time, then the figures), machine.log, bench_fp8.log (bench/fp8_step.py: each
# FP8 recipe against bf16), tests.log, tests.xml,
# bench_eager.log, bench_compile.log, pretrain.log (the same model through torchrun
# pretrain_llama.py on CUDA's default compiled path: the training log's own throughput and
# memory). A dry run skips the compiled bench (tests/unit/test_torch_compile.py compiles on
# CPU). GPU_RUN_BUDGET_S (default 530) caps the whole run; a step that would start with under
# 20 s left is skipped and says so.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DRY=0
OUTDIR=
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        -*) echo "error: unknown option $arg; usage: bash shtools/gpu_run.sh OUTDIR [--dry-run]" >&2
            exit 2 ;;
        *) OUTDIR=$arg ;;
    esac
done
if [ -z "$OUTDIR" ]; then
    echo "error: no output directory; usage: bash shtools/gpu_run.sh OUTDIR [--dry-run]" >&2
    exit 2
fi
mkdir -p "$OUTDIR"
SUMMARY=$OUTDIR/summary.txt
BUDGET=${GPU_RUN_BUDGET_S:-530}
START=$(date +%s)
export PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then
    export MEGATRON_DEVICE=cpu OMP_NUM_THREADS=1
    BENCH=(--tiny --steps 2 --warmup 1 --threads 1)
    MODE="dry run (CPU, tiny sizes)"
else
    BENCH=(--steps 10 --warmup 3)
    MODE="GPU"
fi
# The sources' own hash: a lent machine's copy of the tree can carry a stale .git.
SOURCES=$(find megatron bench tests shtools -type f \( -name '*.py' -o -name '*.sh' \) | sort |
          xargs cat | sha1sum | cut -c1-12)
echo "gpu_run.sh $MODE, budget ${BUDGET}s, started $(date -u +%FT%TZ), sources $SOURCES" > "$SUMMARY"

# step NAME LIMIT_S COMMAND...: run with a time limit (SIGINT first, so pytest and Python
# print what they have), output to NAME.log, one summary line.
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped, ${left}s of the budget left" >> "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    t0=$(date +%s)
    timeout -s INT -k 15 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc$([ $rc = 124 ] && echo ' (timed out)') in $(( $(date +%s) - t0 ))s (limit ${limit}s)" >> "$SUMMARY"
}

# The machine's versions and the kernel probes (a CPU run fails the CUDA-only probes).
MACHINE='nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"; "$0" bench/gpu_probes.py'

# The files whose paths have never run on a GPU first (FP8, sliding windows): a short budget
# gives up the ones measured on earlier runs. The compile-heavy file last.
TIER=(tests/gpu/test_fp8_gpu.py tests/gpu/test_attention_gpu.py
      tests/gpu/test_device_gpu.py tests/gpu/test_parallel_gpu.py
      tests/gpu/test_resume_gpu.py tests/gpu/test_data_path_gpu.py
      tests/gpu/test_async_save_gpu.py tests/gpu/test_kernels_gpu.py)
TIER_FLAGS=(-v --tb=short -p no:cacheprovider --junitxml "$OUTDIR/tests.xml")
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    TIER_FLAGS+=(--timeout 120)
fi

step machine 90 bash -c "$MACHINE" "$PYTHON"
# FP8's figures first (each recipe against bf16 on the default path: the newest work), then
# the tier, the training log, the default path against HF and the eager baseline (both
# measured on three earlier runs: the steps a short budget gives up first).
step bench_fp8 300 "$PYTHON" bench/fp8_step.py "${BENCH[@]}" --num-microbatches 4 --profile
step tests 300 "$PYTHON" -m pytest "${TIER[@]}" "${TIER_FLAGS[@]}"
# shellcheck disable=SC2207
# The training log's figures on the path CUDA runs by default (compiled element-wise regions;
# a dry run stays eager: compiling on CPU is the unit tier's).
COMPILE=(--torch-compile)
[ $DRY = 1 ] && COMPILE=()
FLAGS=($("$PYTHON" bench/gpu_step.py "${BENCH[@]}" --num-microbatches 4 "${COMPILE[@]}" \
         --print-flags))
step pretrain 120 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    pretrain_llama.py "${FLAGS[@]}" --train-iters 20 --log-interval 5 --log-throughput \
    --peak-tflops 989
if [ $DRY = 0 ]; then
    step bench_compile 240 "$PYTHON" bench/gpu_step.py "${BENCH[@]}" --num-microbatches 4 \
        --torch-compile --profile
else
    echo "bench_compile: skipped in a dry run" >> "$SUMMARY"
fi
step bench_eager 150 "$PYTHON" bench/gpu_step.py "${BENCH[@]}" --num-microbatches 4 --profile

{
    echo "--- figures"
    grep -h "^probes:\|^FAIL" "$OUTDIR/machine.log" 2>/dev/null
    tail -n 3 "$OUTDIR/tests.log" 2>/dev/null | grep -E "passed|failed|error|skipped" || true
    grep -h "iteration *20/" "$OUTDIR/pretrain.log" 2>/dev/null | sed 's/^/pretrain: /'
    if [ -f "$OUTDIR/bench_fp8.log" ]; then
        echo "bench_fp8:"
        grep -E "^config:|baseline medians|median step|^profile of|^error|Error" "$OUTDIR/bench_fp8.log"
    fi
    for log in bench_eager bench_compile; do
        [ -f "$OUTDIR/$log.log" ] || continue
        echo "$log:"
        grep -E "^config:|^initial loss|^model FLOPs|^ *(ours|HF):|^ratio|^profile of|^error" \
            "$OUTDIR/$log.log"
    done
    echo "total: $(( $(date +%s) - START ))s"
} >> "$SUMMARY"
cat "$SUMMARY"
