"""The layouts the planner tries, as the flags that select them.

A layout fixes tensor parallelism (within a node, with sequence parallelism when > 1),
context parallelism (the ring, ``--cp-comm-type p2p``), pipeline parallelism (and
interleaving), the data-parallel size that fills the GPUs (world = TP x CP x DP x PP), the
micro batch, recomputation and whether the optimizer is sharded. Each is applied to the parsed
model flags exactly as its printed flags would be, so a planned layout is what those flags
build.

Context parallelism is searched only for long sequences, ``seq_length >= CP_MIN_SEQ_LENGTH``
(8192), and at any length only when nothing fits without it (``plan``). Below 8K a sequence's
activations fit one rank with TP + SP (and recomputation) for the models this plans, and CP
buys nothing the step-time model can see: it splits the same FLOPs over more GPUs as DP does,
while its costs (smaller GEMMs and attention blocks, the ring's latency) are not modelled, so
at short sequences its rows would tie with DP's and win on memory alone. CP sizes divide the
GPUs and make ``seq_length`` a multiple of 2 x CP (the head-tail layout's 2 x CP chunks).
"""
import argparse
from dataclasses import dataclass
from typing import Iterator, List, Optional

from megatron.core.distributed.distributed_data_parallel_config import ddp_config_for_optimizer
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.pipeline_parallel.schedule_order import check_schedule_settings
from megatron.training.memory.base import OptimizerSetup
from megatron.training.memory.estimate import optimizer_setup_from

RECOMPUTE_CHOICES = (None, "selective", "full")
CP_MIN_SEQ_LENGTH = 8192
CP_COMM_TYPE = "p2p"  # the ring: only one K/V block in flight, where all_gather saves all s
# Memory modes, tried only when nothing fits without one, cheapest first: FSDP2 ZeRO-2, then
# ZeRO-3 (the parameters gathered per layer, once / twice a step), then optimizer CPU offload
# (host transfers and the step on the host every iteration). The distributed optimizer's
# ZeRO-2 (--shard-gradients, "zero2") is not among them: with gradient accumulation its device
# peak is the distributed optimizer's plus the gradient shards (the full buckets live from the
# first backward to the reduction), so it fits nowhere the distributed optimizer does not.
MEMORY_MODES = ("fsdp2-zero2", "fsdp2", "cpu-offload", "fsdp2-cpu-offload")
MODE_FLAGS = {"zero2": ["--shard-gradients"], "fsdp2": ["--use-torch-fsdp2"],
              "fsdp2-zero2": ["--use-torch-fsdp2", "--no-reshard-after-forward"],
              "cpu-offload": ["--optimizer-cpu-offload"],
              # FSDP2 ZeRO-3 with its shards, gradients and optimizer on the host: the least
              # device memory of all, the last resort
              "fsdp2-cpu-offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"]}
FSDP2_MODES = ("fsdp2", "fsdp2-zero2", "fsdp2-cpu-offload")
OFFLOAD_MODES = ("cpu-offload", "fsdp2-cpu-offload")


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    virtual_pipeline: Optional[int]  # model chunks per pipeline rank (None: not interleaved)
    data_parallel: int
    micro_batch_size: int
    global_batch_size: int
    recompute: Optional[str]  # None, "selective" or "full" (uniform, one layer per span)
    distributed_optimizer: bool
    grad_reduce_in_fp32: bool = True
    context_parallel: int = 1  # ranks a sequence is split over (the ring, --cp-comm-type p2p)
    memory_mode: Optional[str] = None  # one of MEMORY_MODES
    schedule: Optional[str] = None  # None: 1F1B/interleaved by virtual_pipeline; zb-h1; zbv
    expert_parallel: int = 1  # EP: ranks the routed experts are split over (MoE models)
    # HSDP (--num-distributed-optimizer-instances): the sharded optimizer (or FSDP2) once
    # per node, all-reduced across nodes (instance_choices)
    instances: int = 1

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.schedule == "zbv" else (self.virtual_pipeline or 1)

    @property
    def fsdp2(self) -> bool:
        return self.memory_mode in FSDP2_MODES

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel)

    def flags(self, num_layers: int) -> List[str]:
        """The Megatron flags of this layout (gradient reduction always overlapped)."""
        t, p, v = self.tensor_parallel, self.pipeline_parallel, self.virtual_pipeline
        flags = ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p)]
        if self.context_parallel > 1:
            flags += ["--context-parallel-size", str(self.context_parallel),
                      "--cp-comm-type", CP_COMM_TYPE]
        if v:
            flags += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (p * v))]
        if self.schedule:
            flags += ["--pipeline-schedule", self.schedule]
        if t > 1:
            flags.append("--sequence-parallel")
        if self.expert_parallel > 1:
            flags += ["--expert-model-parallel-size", str(self.expert_parallel)]
        flags += ["--micro-batch-size", str(self.micro_batch_size),
                  "--global-batch-size", str(self.global_batch_size)]
        if self.recompute == "selective":
            flags += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]
        if self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        if not self.fsdp2:  # FSDP2 overlaps its own collectives
            flags.append("--overlap-grad-reduce")
        if self.distributed_optimizer:
            flags.append("--overlap-param-gather")
        flags += MODE_FLAGS.get(self.memory_mode, [])
        if self.instances > 1:
            flags += ["--num-distributed-optimizer-instances", str(self.instances)]
        flags.append("--bf16")  # gradients in fp32 by default, as in Megatron-LM
        if not self.grad_reduce_in_fp32:
            flags.append("--grad-reduce-in-bf16")
        return flags


def overlapped_optimizer_flags(reduce_bucket_size: int) -> List[str]:
    """Megatron-LLaMA's spelling of the sharded optimizer with both collectives overlapped, in
    place of --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather."""
    return ["--overlapped-distributed-optimizer", f"--reduce-bucket-size={reduce_bucket_size}"]


def apply_layout(args: argparse.Namespace, layout: Layout) -> argparse.Namespace:
    """A copy of the (layout-free) parsed flags as ``parse_args`` would give them with
    ``layout``'s flags added (tests/unit/test_plan_parallelism.py checks the round trip)."""
    new = argparse.Namespace(**vars(args))
    t, p, v = layout.tensor_parallel, layout.pipeline_parallel, layout.virtual_pipeline
    new.tensor_model_parallel_size, new.pipeline_model_parallel_size = t, p
    new.context_parallel_size, new.cp_comm_type = layout.context_parallel, CP_COMM_TYPE
    new.num_layers_per_virtual_pipeline_stage = args.num_layers // (p * v) if v else None
    new.virtual_pipeline_model_parallel_size = 2 if layout.schedule == "zbv" else v
    new.pipeline_schedule = layout.schedule
    new.sequence_parallel = t > 1
    new.expert_model_parallel_size = layout.expert_parallel
    new.micro_batch_size, new.global_batch_size = layout.micro_batch_size, layout.global_batch_size
    new.recompute_granularity = layout.recompute
    full = layout.recompute == "full"
    new.recompute_method, new.recompute_num_layers = ("uniform", 1) if full else (None, None)
    new.use_distributed_optimizer = layout.distributed_optimizer
    new.overlap_grad_reduce = not layout.fsdp2
    new.overlap_param_gather = layout.distributed_optimizer
    new.shard_gradients = layout.memory_mode == "zero2"
    new.use_torch_fsdp2 = layout.fsdp2
    new.reshard_after_forward = layout.memory_mode != "fsdp2-zero2"
    new.optimizer_cpu_offload = layout.memory_mode in OFFLOAD_MODES
    new.num_distributed_optimizer_instances = layout.instances
    new.fsdp2_reduce_gradients_once = False  # per microbatch: the planner's FSDP2 (fsdp.py)
    new.bf16, new.fp16 = True, False
    new.grad_reduce_in_bf16 = not layout.grad_reduce_in_fp32
    new.accumulate_allreduce_grads_in_fp32 = layout.grad_reduce_in_fp32
    return new


def optimizer_setup(args: argparse.Namespace, layout: Layout,
                    overlapped_optimizer: bool = False) -> OptimizerSetup:
    """What the DDP/optimizer flags of ``layout`` give ``estimate_memory``, through the same
    configs a run builds (``overlapped_optimizer``: Megatron-LLaMA's variant, sharded rows)."""
    sharded = layout.distributed_optimizer
    optimizer = OptimizerConfig(
        optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
        use_distributed_optimizer=sharded and not overlapped_optimizer,
        overlapped_distributed_optimizer=sharded and overlapped_optimizer,
        optimizer_cpu_offload=layout.memory_mode in OFFLOAD_MODES)
    if layout.fsdp2:
        ddp = TorchFSDP2Config(grad_reduce_in_fp32=layout.grad_reduce_in_fp32,
                               reshard_after_forward=layout.memory_mode != "fsdp2-zero2",
                               cpu_offload=layout.memory_mode in OFFLOAD_MODES,
                               num_distributed_optimizer_instances=layout.instances)
    else:
        ddp = ddp_config_for_optimizer(
            optimizer, grad_reduce_in_fp32=layout.grad_reduce_in_fp32,
            overlap_grad_reduce=True, bucket_size=args.ddp_bucket_size,
            reduce_bucket_size=args.reduce_bucket_size,
            shard_gradients=layout.memory_mode == "zero2",
            num_distributed_optimizer_instances=layout.instances)
    return optimizer_setup_from(ddp, optimizer, layout.data_parallel, layout.context_parallel)


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_parallel_sizes(args: argparse.Namespace, num_gpus: int,
                          gpus_per_node: int) -> List[int]:
    """TP sizes within a node that split the heads, query groups and FFN evenly."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    return [t for t in _divisors(gpus_per_node) if num_gpus % t == 0
            and args.num_attention_heads % t == 0 and groups % t == 0
            and args.ffn_hidden_size % t == 0]


def context_parallel_sizes(args: argparse.Namespace, num_gpus: int, tensor_parallel: int,
                           with_cp: bool) -> List[int]:
    """CP sizes beside TP ``tensor_parallel``: 1, and with ``with_cp`` every divisor of the
    GPUs left that cuts the sequence into 2 x CP equal chunks, each rank's s/CP tokens split
    evenly again by sequence parallelism (arguments/parse.py checks the same). None with
    --allow-math-attention (the math kernel cannot be split over CP ranks)."""
    if not with_cp or args.allow_math_attention:
        return [1]
    s, t = args.seq_length, tensor_parallel
    return [c for c in _divisors(num_gpus // t)
            if c == 1 or (s % (2 * c) == 0 and (s // c) % t == 0)]


def is_moe(args: argparse.Namespace) -> bool:
    return getattr(args, "num_experts", None) is not None


def expert_parallel_sizes(args: argparse.Namespace, stage_ranks: int, tensor_parallel: int
                          ) -> List[int]:
    """EP sizes of an MoE model: divisors of the experts whose EP x expert TP (default the TP
    size) divides a pipeline stage's ranks (TP x CP x DP); [1] for a dense model."""
    if not is_moe(args):
        return [1]
    etp = args.expert_tensor_parallel_size or tensor_parallel
    return [ep for ep in _divisors(args.num_experts) if stage_ranks % (ep * etp) == 0]


def layout_families(args: argparse.Namespace, num_gpus: int, gpus_per_node: int,
                    global_batch_size: int, max_micro_batch_size: int,
                    grad_reduce_in_fp32: bool = True, with_cp: bool = False,
                    memory_mode: Optional[str] = None) -> Iterator[List[Layout]]:
    """Every layout, grouped into families that differ only in the micro batch (ascending):
    memory grows with the micro batch, so a family can stop at its first misfit. CP > 1
    only with ``with_cp`` (see the module's docstring). With ``memory_mode`` only the
    layouts it composes with (FSDP2: DP x CP > 1; ZeRO-2: the distributed optimizer)."""
    micro_batches = [1 << k for k in range(max_micro_batch_size.bit_length())
                     if 1 << k <= max_micro_batch_size]
    for t in tensor_parallel_sizes(args, num_gpus, gpus_per_node):
        for c in context_parallel_sizes(args, num_gpus, t, with_cp):
            yield from _families(args, num_gpus, t, c, global_batch_size, micro_batches,
                                 grad_reduce_in_fp32, memory_mode, gpus_per_node)


def _families(args: argparse.Namespace, num_gpus: int, t: int, c: int, global_batch_size: int,
              micro_batches: List[int], grad_reduce_in_fp32: bool,
              mode: Optional[str] = None, gpus_per_node: Optional[int] = None
              ) -> Iterator[List[Layout]]:
    """The families of TP ``t`` and CP ``c``: every PP, VPP, recomputation and sharding."""
    num_layers = args.num_layers
    for p in [p for p in _divisors(num_layers) if num_gpus % (t * c * p) == 0]:
        d = num_gpus // (t * c * p)
        fitting = [b for b in micro_batches if global_batch_size % (b * d) == 0]
        for v, schedule in _schedules(num_layers, p):
            batches = [b for b in fitting
                       if _schedule_takes(p, v, schedule, global_batch_size // (b * d))]
            for recompute, sharded, ep, n in _choices(args, mode, t, p, c, d, gpus_per_node):
                family = [Layout(t, p, v, d, b, global_batch_size, recompute, sharded,
                                 grad_reduce_in_fp32, c, mode, schedule, ep, n)
                          for b in batches]
                if family:
                    yield family


def _choices(args, mode: Optional[str], t: int, p: int, c: int, d: int,
             gpus_per_node: Optional[int]):
    """(recomputation, distributed optimizer, EP, optimizer instances) of a TP/PP/CP/DP
    layout."""
    shardings = _sharding_choices(mode, p, c, d)
    for recompute in RECOMPUTE_CHOICES:
        for sharded in shardings:
            for ep in expert_parallel_sizes(args, t * c * d, t):
                etp = (args.expert_tensor_parallel_size or t) if is_moe(args) else 1
                shards = sharded or mode in FSDP2_MODES
                for n in instance_choices(shards, t, c, d, ep * etp, gpus_per_node):
                    yield recompute, sharded, ep, n


def instance_choices(sharded: bool, t: int, c: int, d: int, expert_ranks: int,
                     gpus_per_node: Optional[int]) -> List[int]:
    """1, and for a sharded optimizer whose DP x CP ranks span several whole nodes, HSDP
    with one instance per node: each node shards the optimizer over its own ranks (its
    reduce-scatter and all-gather on the node's links) and only 1 / (its DP x CP ranks) of the
    gradients crosses nodes, for one copy of the optimizer state per node. Routed experts
    (``expert_ranks`` = EP x expert TP) need their expert-DP ranks cut the same way."""
    stage = t * c * d
    if not sharded or gpus_per_node is None or stage <= gpus_per_node or \
            stage % gpus_per_node:
        return [1]
    n = stage // gpus_per_node
    edp = stage // expert_ranks
    return [1, n] if (d * c) % n == 0 and edp % n == 0 else [1]


def _schedules(num_layers: int, p: int):
    """(virtual pipeline size, --pipeline-schedule) pairs a pipeline of ``p`` ranks can run:
    1F1B, interleaved by every virtual size, ZB-H1, and ZB-V where the layers cut into 2 p."""
    if p == 1:
        return [(None, None)]
    pairs = [(None, None)] + [(v, None) for v in _divisors(num_layers // p) if v > 1]
    pairs.append((None, "zb-h1"))
    if num_layers % (2 * p) == 0:
        pairs.append((None, "zbv"))
    return pairs


def _schedule_takes(p: int, v: Optional[int], schedule: Optional[str], microbatches: int):
    """The schedules' microbatch rules (schedule_order.check_schedule_settings)."""
    try:
        check_schedule_settings(p, microbatches, 2 if schedule == "zbv" else v, schedule)
    except ValueError:
        return False
    return True


def _sharding_choices(mode: Optional[str], p: int, c: int, d: int):
    """Distributed optimizer or not, for ``mode`` at PP ``p``, CP ``c`` and DP ``d``. The
    distributed optimizer shards over DP x CP."""
    if mode in FSDP2_MODES:  # FSDP2 shards itself, over DP x CP
        return (False,) if d * c > 1 else ()
    if mode == "zero2":
        return (True,) if d * c > 1 else ()
    return (False, True) if d * c > 1 else (False,)
