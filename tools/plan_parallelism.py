"""Plan the parallel layout of a training run: which TP / CP / PP / VPP / DP, micro batch,
recomputation and optimizer sharding fit the GPUs, and which is fastest by an estimate.
Context parallelism (--context-parallel-size N --cp-comm-type p2p in a row's flags) is
considered for sequences of 8192 tokens and more, or when nothing fits without it.

    python3 tools/plan_parallelism.py --num-gpus 32 --global-batch-size 1024 --vocab-size 32000 \\
        --config-file shtools/configs/llama2_7b.sh
    python3 tools/plan_parallelism.py --num-gpus 8 --global-batch-size 512 \\
        --hf-config path/to/config.json --json
    python3 tools/plan_parallelism.py --num-gpus 8 --global-batch-size 64 -- \\
        --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \\
        --ffn-hidden-size 11008 --swiglu --normalization RMSNorm \\
        --position-embedding-type rope --disable-bias-linear \\
        --untie-embeddings-and-output-weights --vocab-size 32000

The model comes from Megatron flags after ``--``, a shtools/configs/*.sh file (its
CONFIG_FLAGS, sourced in bash), or a Hugging Face config.json (LLaMA, Mistral, GPT-2). Their
parallelism, batch, recomputation, optimizer-sharding and precision flags are ignored: those
are what the planner chooses, and so are the flags that mean something only with one of them
(``--reduce-bucket-size`` with ``--overlapped-distributed-optimizer``: the dependency table,
megatron/training/arguments/dependencies.py). Memory per GPU is
``megatron.training.memory.estimate``'s estimate; the step-time model and its assumptions are in
``megatron/training/planner/step_time.py``. Prints a ranked table with the flags of each row,
or the same rows as JSON with --json. Bad input: one message on stderr, exit 1. A Hugging
Face config's context longer than 4096 (the conversion's default --seq-length cap) is planned
at 4096 unless --seq-length says otherwise, with a warning on stderr naming both.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import List

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "checkpoint"))  # hf_io, megatron_args
sys.path.insert(1, os.path.join(_HERE, os.pardir))

from megatron_args import DEFAULT_MAX_SEQ_LENGTH  # noqa: E402

from megatron.training.planner import Cluster, plan, workload_from_flags  # noqa: E402
from megatron.training.planner.step_time import EAGER_EFFICIENCY  # noqa: E402
from megatron.training.planner.report import format_table, plan_dict  # noqa: E402
from megatron.training.training_config import ConfigError  # noqa: E402

A100 = Cluster(num_gpus=1)  # the defaults


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def get_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan_parallelism.py", allow_abbrev=False,
                description=__doc__.split("\n\n")[0],
                epilog="Megatron model flags go after --.")
    model = p.add_argument_group("the model (one of these, or Megatron flags after --)")
    model.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    model.add_argument("--config-file", help="a shtools/configs/*.sh defining CONFIG_FLAGS")
    run = p.add_argument_group("the run (default: the model flags' own)")
    run.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    run.add_argument("--seq-length", type=int,
                     help="default: the model flags' own; for --hf-config its "
                          f"max_position_embeddings, at most {DEFAULT_MAX_SEQ_LENGTH} (a "
                          "warning says so)")
    run.add_argument("--vocab-size", type=int, help="the tokenizer's (LLaMA: 32000)")
    run.add_argument("--bf16-grads", action="store_true",
                     help="reduce gradients in bf16 (--grad-reduce-in-bf16; default fp32, "
                          "as Megatron-LM does with bf16)")
    run.add_argument("--max-micro-batch-size", type=int, default=16)
    hw = p.add_argument_group("the cluster (defaults: A100-SXM4-80GB, 8 per node)")
    hw.add_argument("--num-gpus", type=int, required=True)
    hw.add_argument("--gpus-per-node", type=int, default=A100.gpus_per_node)
    hw.add_argument("--gpu-memory-gib", type=float, default=A100.gpu_memory_gib)
    hw.add_argument("--memory-reserve-gib", type=float, default=A100.memory_reserve_gib,
                    help="left out of the estimate: CUDA context, NCCL buffers, allocator "
                         "fragmentation, single-kernel temporaries (default %(default)s)")
    hw.add_argument("--peak-tflops", type=float, default=A100.peak_tflops,
                    help="dense bf16 peak per GPU (default %(default)s: A100; H100 SXM 989)")
    hw.add_argument("--compute-efficiency", type=float, default=None,
                    help=f"fraction of the peak the model's FLOPs run at (default: as measured "
                         f"on one GPU, {A100.compute_efficiency} on the compiled element-wise "
                         f"path that CUDA runs by default, {EAGER_EFFICIENCY} when the model "
                         f"flags hold --no-torch-compile)")
    hw.add_argument("--intra-node-bandwidth-gbs", type=float,
                    default=A100.intra_node_bandwidth_gbs, help="per GPU, GB/s (NVLink)")
    hw.add_argument("--inter-node-bandwidth-gbs", type=float,
                    default=A100.inter_node_bandwidth_gbs,
                    help="per GPU, GB/s (InfiniBand: 25 for one 200 Gb/s port per GPU)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows to print (default %(default)s)")
    out.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p


def flags_of_config_file(path: str) -> List[str]:
    """CONFIG_FLAGS of a shtools/configs/*.sh, sourced in bash (its variables' defaults or the
    environment's values)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config-file {path}: no such file.")
    proc = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$1"; (( ${#CONFIG_FLAGS[@]} )); '
                       'printf "%s\\0" "${CONFIG_FLAGS[@]}"',
         "bash", path], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or ["CONFIG_FLAGS is empty or unset"]
        raise ConfigError(f"--config-file {path}: sourcing it in bash failed ({detail[0]}); it "
                          f"must define the array CONFIG_FLAGS, as shtools/configs/*.sh do.")
    return proc.stdout.split("\0")[:-1]


def flags_of_hf_config(path: str, seq_length) -> List[str]:
    """Megatron flags of a Hugging Face model (the conversion tool's mapping)."""
    import hf_io
    import megatron_args
    from conversion_utils import ConversionError

    if not os.path.exists(path):
        raise ConfigError(f"--hf-config {path}: no such file or directory.")
    try:
        config = hf_io.read_config(path) if os.path.isdir(path) else hf_io.read_config_file(path)
        args = megatron_args.args_from_hf(config, None, seq_length)
    except ConversionError as exc:
        raise ConfigError(f"--hf-config: {exc}") from None
    if seq_length is None and args["seq_length"] < args["max_position_embeddings"]:
        _warn(f"--hf-config {path}: the model's context is {args['max_position_embeddings']} "
              f"positions (max_position_embeddings), but the plan is for sequences of "
              f"{args['seq_length']}, the default cap (memory and step time grow with the "
              f"sequence, and long-context models are mostly pretrained shorter); pass "
              f"--seq-length {args['max_position_embeddings']} to plan for the full context.")
    flags = [word for group in megatron_args.architecture_flags(args)
             for word in shlex.split(group)]
    return flags + ["--vocab-size", str(args["vocab_size"])]


def _warn(message: str) -> None:
    """One line on stderr (stdout stays the table or the JSON)."""
    print(f"plan_parallelism.py: warning: {message}", file=sys.stderr, flush=True)


def model_flags(a, extra: List[str]) -> List[str]:
    given = [name for name, on in (("--hf-config", a.hf_config), ("--config-file", a.config_file),
                                   ("Megatron flags after --", extra)) if on]
    if len(given) != 1:
        raise ConfigError("give the model once: --hf-config, --config-file or Megatron flags "
                          "after --" + (f" (got {' and '.join(given)})." if given else "."))
    if a.hf_config:
        return flags_of_hf_config(a.hf_config, a.seq_length)
    if a.config_file:
        return flags_of_config_file(a.config_file)
    return extra


def run(argv: List[str]) -> str:
    """The text (or JSON) to print; ConfigError on bad input."""
    cut = argv.index("--") if "--" in argv else len(argv)
    a = get_parser().parse_args(argv[:cut])
    flags = model_flags(a, argv[cut + 1:])
    workload = workload_from_flags(flags, seq_length=a.seq_length,
                                   global_batch_size=a.global_batch_size,
                                   vocab_size=a.vocab_size)
    efficiency = a.compute_efficiency
    if efficiency is None:
        # The GPUs planned for run the compiled path unless the flags turn it off.
        efficiency = A100.compute_efficiency if workload.args.torch_compile else \
            EAGER_EFFICIENCY
    cluster = Cluster(a.num_gpus, a.gpus_per_node, a.gpu_memory_gib, a.memory_reserve_gib,
                      a.peak_tflops, efficiency, a.intra_node_bandwidth_gbs,
                      a.inter_node_bandwidth_gbs)
    if a.top < 1:
        raise ConfigError(f"--top must be >= 1, got {a.top}.")
    result = plan(workload, cluster, top=a.top, max_micro_batch_size=a.max_micro_batch_size,
                  grad_reduce_in_fp32=not a.bf16_grads)
    if a.json:
        return json.dumps(plan_dict(result, cluster, workload), indent=1)
    return format_table(result, cluster, workload)


def main(argv=None) -> int:
    try:
        text = run(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        print(f"plan_parallelism.py: error: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
