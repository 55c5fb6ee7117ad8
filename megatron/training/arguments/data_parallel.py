"""The data-parallel flags (Megatron's names): how gradients are reduced and the optimizer
sharded over DP x CP: the distributed optimizer (and Megatron-LLaMA's overlapped one), ZeRO-2,
HSDP's optimizer instances, torch FSDP2, and DDP's buckets and overlap."""
import argparse


def _int_from_float(text: str) -> int:
    """Integers also written like '2e8' (Megatron-LLaMA's --reduce-bucket-size=2e8)."""
    value = float(text)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def add_data_parallel_args(parser) -> None:
    g = parser.add_argument_group("data parallelism and optimizer sharding")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlapped-distributed-optimizer", action="store_true",
                   help="Megatron-LLaMA's: distributed optimizer, reduce-scatter and all-gather "
                        "overlapped in buckets of --reduce-bucket-size elements.")
    g.add_argument("--reduce-bucket-size", type=_int_from_float, default=500_000_000)
    g.add_argument("--shard-gradients", action="store_true",
                   help="ZeRO-2 for the distributed optimizer (needs "
                        "--use-distributed-optimizer or --overlapped-distributed-optimizer): "
                        "the optimizer step keeps only this rank's 1/DP of the reduced fp32 "
                        "gradients and frees the full gradient buffer until the next "
                        "iteration (still reduced once per iteration; the forward/backward "
                        "peak is unchanged).")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="HSDP: cut the DP x CP ranks into this many instances (consecutive "
                        "ranks: a node's), each sharding the distributed optimizer or FSDP2 "
                        "over its ranks, with the reduced gradient shards all-reduced across "
                        "instances (N copies of the optimizer state; 1/(DP x CP / N) of the "
                        "gradients crosses nodes).")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=_int_from_float, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Shard parameters, gradients and optimizer state over DP with torch's "
                        "FSDP2 (fully_shard per transformer layer); composes with TP/SP, CP, "
                        "every PP schedule, EP, HSDP, --fp16 and --optimizer-cpu-offload, not "
                        "with --use-distributed-optimizer, --optimizer muon or --ckpt-format "
                        "torch (checkpoints: the sharded format).")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                   action="store_false",
                   help="With --use-torch-fsdp2: keep each layer's gathered parameters from "
                        "forward to backward (ZeRO-2; default: free them, ZeRO-3).")
    g.add_argument("--fsdp2-reduce-gradients-once", action="store_true",
                   help="With --use-torch-fsdp2: reduce-scatter each layer's gradients once "
                        "per step, after the last microbatch, holding them unsharded in "
                        "between (+4 bytes per parameter in fp32; 12-15%% faster steps on "
                        "CPU, BENCHMARKS.md); default: once per microbatch, the least memory.")
