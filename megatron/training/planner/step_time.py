"""Estimated time of one training step of a layout, and from it MFU and tokens/s.

The model, term by term (t TP, c CP, p PP, v model chunks per pipeline rank, d DP, b micro
batch, m = global batch / (b d) microbatches, s sequence, h hidden, e = 2 bytes (bf16); under
CP every per-microbatch activation below is that of s/c tokens):

- Compute: FLOPs as Megatron counts them (``logging.flops.num_floating_point_operations``: each
  GEMM once forward, twice backward; attention's full s x s), plus what recomputation redoes:
  full recomputation one more forward of every layer (a third of its FLOPs), selective the
  attention core's forward (4 b s^2 a d FLOPs per layer). They run at ``peak x efficiency``
  spread over the t x c GPUs of a stage (CP's head-tail layout gives each CP rank 1/c of the
  tokens and of the causal attention work); the efficiency is the one free constant, stated
  in the output, and it does not depend on GEMM shapes (a larger micro batch is not faster
  here, nor a CP block slower).
- Context parallelism (the ring, ``--cp-comm-type p2p``): per layer and microbatch each rank
  receives the c-1 other ranks' K/V blocks, (c-1) x 2 b (s/c) (g/t) d e bytes (g query
  groups), in the forward; in the backward the K/V blocks again and, one hop behind them,
  each block's dK/dV accumulator, in fp32 (2 b (s/c) (g/t) d x 4 bytes), c hops of which the
  last returns it to its owner after the last block's compute: nothing overlaps that one.
  All over the bandwidth of the CP group (t x c consecutive ranks); full recomputation runs
  the forward ring again. The other hops overlap the attention blocks' compute (4 b s^2 a d
  / (t c) FLOPs a GPU forward, twice that backward); only what exceeds it is added. So CP
  always costs something (the last dK/dV hop of every layer), and a layout without it wins
  where both fit and nothing else differs.
- Tensor parallelism (with sequence parallelism): per layer and microbatch the forward
  all-gathers and reduce-scatters two all-reduce volumes of the b x s x h activations
  (2(t-1)/t x b s h e bytes each), and the backward waits for one more (the row-parallel
  layers' output-gradient all-gathers); the column-parallel layers' input re-gathers and
  input-gradient reduce-scatters run under their GEMMs (``tensor_parallel/layers.py``) and
  are taken as hidden. So 3 volumes at the intra-node bandwidth, 5 with full recomputation
  (its extra forward). The embedding's and loss's small collectives are left out.
- Pipeline: each microbatch sends v activations forward and v gradients back per stage,
  b s h e / t bytes each (sequence-parallel shards), not overlapped; at the intra-node
  bandwidth on one node, else the inter-node one (ranks are ordered TP fastest, then CP,
  DP, then PP, so the pipeline crosses every node boundary).
- The slowest stage (usually the last: it also computes the logits) sets the microbatch time;
  the pipeline runs m microbatch times plus a bubble of (p-1)/v of them, a fraction
  (p-1)/(v m + p-1) of the pipeline's time.
- Data parallelism: each stage reduces its gradient buffer (at its dtype, fp32 by default)
  over the DP x CP group (n = d c ranks, t x c x d consecutive): an all-reduce,
  2(n-1)/n x bytes, or for the distributed optimizer a reduce-scatter of the gradients and
  an all-gather of the bf16 parameters, (n-1)/n x bytes each; over the
  intra-node bandwidth when the group is inside a node, else the inter-node one (per GPU,
  as a ring crossing nodes sees it). The reduction overlaps the backward of the last
  microbatch (buckets go as they fill) and the all-gather the forward of the next step's first
  microbatch; only what exceeds those windows adds to the step.
- Not modelled: the ring's merges of partial outputs and dQ/dK/dV accumulations (fp32
  element-wise passes, memory-bound), the optimizer step itself (memory bound, small next to these terms for
  these models), kernel launch gaps, contention between communication and compute, network
  latency and the last bucket's reduction that nothing hides.
"""
from dataclasses import dataclass

from megatron.core.pipeline_parallel.simulate import zero_bubble_idle
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.core.transformer.sliding_window import layer_windows
from megatron.training.logging.flops import (
    attention_pair_macs,
    latent_attention_of,
    mfu,
    num_floating_point_operations,
)
from megatron.training.memory.estimate import MemoryEstimate, dtype_bytes
from megatron.training.memory.params import chunk_span
from megatron.training.planner.layouts import Layout
from megatron.training.planner.moe_cost import (
    alltoall_seconds_per_layer,
    effective_ffn_hidden_size,
    moe_layers_in,
)
from megatron.training.training_config import ConfigError

GB = 1e9  # bandwidths in GB/s (10^9 bytes), as vendors quote them
# The fraction of the peak our model FLOPs ran at, measured on one GPU with no communication
# (bench/gpu_step.py, the 1.1B LLaMA, bf16, micro batch 4 x 4 microbatches, torch 2.11;
# BENCHMARKS.md, "The compiled head layout"): on an H100, CUDA's default compiled path
# 51.0 % (pretrain_llama.py's own log 50.5-51.2 %), --no-torch-compile 31.4-31.9 % over
# three runs (an H200 ran 49.5-50.7 % compiled before the head layout, and 34.4 % eager: its
# faster memory helps the eager element-wise work). It replaces an assumed 60 %, which put
# that step at 0.40 s against 0.76 s measured eager and 0.475 s compiled.
EAGER_EFFICIENCY = 0.32
COMPILED_EFFICIENCY = 0.51


@dataclass(frozen=True)
class Cluster:
    """The GPUs and links. Defaults: A100-SXM4-80GB nodes of 8 (312 TFLOP/s dense bf16,
    NVLink 3 at 300 GB/s per GPU and direction, one 200 Gb/s HDR InfiniBand port per GPU)."""
    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    # CUDA context, NCCL buffers, allocator fragmentation and single-kernel temporaries such
    # as the logits' gradient: what the memory estimate leaves out.
    memory_reserve_gib: float = 6.0
    peak_tflops: float = 312.0
    compute_efficiency: float = COMPILED_EFFICIENCY  # CUDA's default path
    intra_node_bandwidth_gbs: float = 300.0
    inter_node_bandwidth_gbs: float = 25.0

    def check(self) -> None:
        n, g = self.num_gpus, self.gpus_per_node
        if n < 1 or g < 1:
            raise ConfigError(f"--num-gpus ({n}) and --gpus-per-node ({g}) must be >= 1.")
        if n % g and g % n:
            raise ConfigError(f"--num-gpus {n} is not a multiple of --gpus-per-node {g}: plan "
                              f"for whole nodes ({(n // g + 1) * g} GPUs) or part of one node "
                              f"(a divisor of {g}).")
        for value, flag in ((self.gpu_memory_gib, "--gpu-memory-gib"),
                            (self.peak_tflops, "--peak-tflops"),
                            (self.intra_node_bandwidth_gbs, "--intra-node-bandwidth-gbs"),
                            (self.inter_node_bandwidth_gbs, "--inter-node-bandwidth-gbs")):
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}.")
        if not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"--compute-efficiency is a fraction of the peak in (0, 1], got "
                              f"{self.compute_efficiency}.")
        if not 0 <= self.memory_reserve_gib < self.gpu_memory_gib:
            raise ConfigError(f"--memory-reserve-gib {self.memory_reserve_gib} must be >= 0 and "
                              f"less than --gpu-memory-gib {self.gpu_memory_gib}.")

    @property
    def one_node(self) -> bool:
        return self.num_gpus <= self.gpus_per_node

    def group_bandwidth(self, span: int) -> float:
        """Bytes/s of a group of ``span`` consecutive ranks (from a multiple of ``span``)."""
        inside = self.one_node or (span <= self.gpus_per_node and self.gpus_per_node % span == 0)
        return (self.intra_node_bandwidth_gbs if inside else self.inter_node_bandwidth_gbs) * GB


@dataclass
class StepTime:
    compute_s: float  # one microbatch through the slowest stage: forward + backward (+ redo)
    tensor_parallel_s: float  # that stage's TP collectives for one microbatch
    pipeline_p2p_s: float  # one microbatch's sends between stages
    microbatch_s: float  # the sum: the pipeline's beat
    num_microbatches: int
    bubble_s: float
    data_parallel_s: float  # the DP collectives of the stage with the most left exposed
    data_parallel_exposed_s: float
    step_s: float
    bubble_fraction: float
    model_flops: int  # Megatron's count for the whole global batch (the MFU numerator)
    mfu: float
    tokens_per_s_per_gpu: float
    context_parallel_s: float = 0.0  # that stage's CP ring transfers for one microbatch
    context_parallel_exposed_s: float = 0.0  # the part its attention compute does not hide
    expert_parallel_s: float = 0.0  # that stage's MoE all-to-alls for one microbatch


def _count(config, seq_length: int, batch: int, layers: int, vocab: int, windows=(),
           mtp_num_layers: int = 0) -> int:
    return num_floating_point_operations(
        num_layers=layers, hidden_size=config.hidden_size,
        ffn_hidden_size=effective_ffn_hidden_size(config),
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups, seq_length=seq_length, vocab_size=vocab,
        batch_size=batch, swiglu=config.activation in GATED_ACTIVATIONS,
        kv_channels=config.kv_channels, windows=windows,
        latent_attention=latent_attention_of(config), mtp_num_layers=mtp_num_layers)


def _flops(config, seq_length: int, batch: int, num_layers: int, vocab: int) -> int:
    """FLOPs of ``num_layers`` transformer layers and a ``vocab``-row logits layer (with the
    multi-token prediction depths, which sit with it on the last stage). With sliding windows
    on some layers a layer's share is the mean over the model's layers: exact for the whole
    model (the MFU numerator), within one layer's window saving per stage."""
    mtp = (getattr(config, "mtp_num_layers", None) or 0) if vocab else 0
    logits = _count(config, seq_length, batch, 0, vocab, mtp_num_layers=mtp)
    if num_layers == 0:
        return logits
    all_layers = _count(config, seq_length, batch, config.num_layers, 0, layer_windows(config))
    return logits + all_layers * num_layers // config.num_layers


def _pair_macs(config) -> int:
    """One query-key pair's score and value MACs over a layer's heads (2 a d; MLA's
    a (d_qk + d_v))."""
    return attention_pair_macs(config.num_attention_heads, config.kv_channels,
                               latent_attention_of(config))


def weight_gradient_seconds(config, layout: Layout, seq_length: int, layers: int,
                            has_logits: bool, padded_vocab_size: int, flop_rate: float) -> float:
    """The W part of a microbatch's backward on a stage (zero-bubble schedules): the weight-
    gradient GEMMs, as many FLOPs as the linear layers' forward, i.e. a layer's forward less
    its attention core (Q K^T and softmax x V: 2 x 2 b s^2 a d), and the output layer's."""
    b, s = layout.micro_batch_size, seq_length
    core = 2 * b * s * s * _pair_macs(config)
    linear = _count(config, s, b, 1, 0) // 3 - core  # a full layer's: windows change the core
    logits = _flops(config, s, b, 0, padded_vocab_size) // 3 if has_logits else 0
    return (layers * linear + logits) / flop_rate


def zero_bubble_seconds(layout: Layout, forward_s: float, backward_s: float, comm_s: float,
                        weight_s: float) -> float:
    """Idle time of the zero-bubble schedules (simulate.zero_bubble_idle) with the slowest
    stage's costs: F the forward, W the weight-gradient GEMMs, B the rest of the backward.
    A microbatch's communication (TP, CP, p2p) goes 1:2 to F and B; W has none. A zbv chunk
    is half the stage. The formulas are exact for equal costs (tests/unit/
    test_zero_bubble_order.py); with unequal ones they are the schedules' design bound."""
    f = forward_s + comm_s / 3
    b = backward_s - weight_s + 2 * comm_s / 3
    chunks = layout.chunks_per_rank
    return zero_bubble_idle(layout.pipeline_parallel, layout.schedule, f / chunks, b / chunks,
                            weight_s / chunks)


def recompute_flops_per_layer(config, layout: Layout, seq_length: int) -> int:
    """Extra forward work of one layer and microbatch under the layout's recomputation."""
    b, s = layout.micro_batch_size, seq_length
    if layout.recompute == "full":
        return _flops(config, s, b, 1, 0) // 3
    if layout.recompute == "selective":  # Q K^T and softmax x V: 2 s^2 a d MACs a sequence
        return 2 * b * s * s * _pair_macs(config)
    return 0


def cp_ring_seconds(config, layout: Layout, cluster: Cluster, seq_length: int
                    ) -> "tuple[float, float]":
    """(transfer, exposed) seconds of one layer's CP ring for one microbatch, as
    ``context_parallel/ring.py`` runs it (module docstring): the forward's K/V hops, the
    backward's K/V hops and fp32 dK/dV hops (the last one waited for with nothing left to
    overlap), and the forward again under full recomputation."""
    t, c, b = layout.tensor_parallel, layout.context_parallel, layout.micro_batch_size
    if c == 1:
        return 0.0, 0.0
    groups, d = config.num_query_groups // t, config.kv_channels
    bandwidth = cluster.group_bandwidth(t * c)
    kv_hop = 2 * b * (seq_length // c) * groups * d * dtype_bytes(config.params_dtype) / bandwidth
    dkv_hop = 2 * b * (seq_length // c) * groups * d * 4 / bandwidth  # accumulated in fp32
    attention = 2 * b * seq_length ** 2 * _pair_macs(config) / (t * c)
    attention_s = attention / (cluster.peak_tflops * 1e12 * cluster.compute_efficiency)
    forward = (c - 1) * kv_hop
    forward_exposed = max(0.0, forward - attention_s)
    backward = (c - 1) * kv_hop + c * dkv_hop
    backward_exposed = max(0.0, backward - dkv_hop - 2 * attention_s) + dkv_hop
    forwards = 2 if layout.recompute == "full" else 1
    return (forwards * forward + backward,
            forwards * forward_exposed + backward_exposed)


def _collective_bytes(stage, layout: Layout, group: int, fp8_param_gather: bool = False):
    """(gradient bytes reduced, parameter bytes gathered) of a stage: the full buckets, also
    where the state after the step keeps a shard (ZeRO-2: those of backward; FSDP2: the fp32
    shards times the group, gathered in bf16 and reduced in the gradient dtype). CPU offload's
    host transfers and host step are not modelled. ``fp8_param_gather`` (the distributed
    optimizer's, fp8/param_gather.py): the FP8 weights gathered at one byte an element, not
    two; their count is half the bytes of their cached FP8 copies (two bytes an element; the
    scales, 4 bytes a weight or a 128 x 128 block, left in)."""
    state = stage.state
    if layout.fsdp2:  # (offloaded: the shards are on the host, copied in for the gather)
        full = (state.params or stage.host.params) // 4 * group
        return full * (4 if layout.grad_reduce_in_fp32 else 2), full * 2
    params = state.params - (state.fp8_weights // 2 if fp8_param_gather else 0)
    if layout.memory_mode == "zero2":
        return stage.transient_bytes, params  # the full buckets of backward
    return state.grads, params


def sharded_collective_seconds(layout: Layout, cluster: Cluster, grads: float, params: float):
    """(reduce-scatter, all-gather) seconds of a sharded optimizer's ``grads`` and ``params``
    bytes over DP x CP: a ring over all of them, or under HSDP a ring inside each instance
    (one node's consecutive ranks) plus the all-reduce of 1 / (instance size) of the
    gradients across the instances."""
    t, ranks, n = layout.tensor_parallel, layout.data_parallel * layout.context_parallel, \
        layout.instances
    size = ranks // n
    inside = cluster.group_bandwidth(t * size)
    reduce_s = (size - 1) / size * grads / inside
    gather_s = (size - 1) / size * params / inside
    if n > 1:  # the replicas of each shard: one rank per instance, across nodes
        reduce_s += 2 * (n - 1) / n * grads / size / cluster.group_bandwidth(t * ranks)
    return reduce_s, gather_s


def estimate_step_time(config, layout: Layout, cluster: Cluster, memory: MemoryEstimate,
                       seq_length: int, padded_vocab_size: int,
                       fp8_param_gather: bool = False) -> StepTime:
    """The step time of ``layout`` (``config`` is its TransformerConfig, ``memory`` its
    estimate, whose per-stage gradient and parameter buffers are what DP moves;
    ``fp8_param_gather``: its FP8 weights are gathered in FP8)."""
    t, p, d = layout.tensor_parallel, layout.pipeline_parallel, layout.data_parallel
    c = layout.context_parallel
    v, b, m = layout.chunks_per_rank, layout.micro_batch_size, layout.num_microbatches
    s, h, e = seq_length, config.hidden_size, dtype_bytes(config.params_dtype)
    flop_rate = t * c * cluster.peak_tflops * 1e12 * cluster.compute_efficiency
    intra = cluster.intra_node_bandwidth_gbs * GB
    layer_flops = _flops(config, s, b, 1, 0)
    redo_flops = recompute_flops_per_layer(config, layout, s)
    volumes = 5 if layout.recompute == "full" else 3  # exposed all-reduce volumes a layer
    tp_layer_s = volumes * 2 * (t - 1) / t * b * (s // c) * h * e / intra
    cp_layer_s, cp_layer_exposed_s = cp_ring_seconds(config, layout, cluster, s)
    a2a_layer_s = alltoall_seconds_per_layer(config, layout, cluster, s, e)

    stages = []  # (forward s, backward s, TP s, exposed CP s) of a microbatch, per PP rank
    stage_layers = []
    for rank in range(p):
        spans = [chunk_span(config, rank, chunk) for chunk in range(v)]
        layers = sum(span.end - span.start for span in spans)
        stage_layers.append(layers)
        last = any(span.post_process for span in spans)
        logits = _flops(config, s, b, 0, padded_vocab_size) if last else 0
        work = layers * layer_flops + logits
        # the MoE all-to-alls are exposed like TP's collectives: counted with them
        stages.append((work // 3 / flop_rate, (work - work // 3 + layers * redo_flops) / flop_rate,
                       layers * tp_layer_s + moe_layers_in(config, spans) * a2a_layer_s,
                       layers * cp_layer_exposed_s))
    slowest = max(range(p), key=lambda r: sum(stages[r]))
    forward_s, backward_s, tp_s, cp_exposed_s = stages[slowest]
    ep_s = a2a_layer_s * moe_layers_in(config, [chunk_span(config, slowest, k) for k in range(v)])
    cp_s = cp_layer_s * stage_layers[slowest]
    p2p_s = 0.0
    if p > 1:
        message = b * (s // c) * h * e / (t if t > 1 else 1)
        p2p_s = 2 * v * message / cluster.group_bandwidth(cluster.num_gpus)
    microbatch_s = forward_s + backward_s + tp_s + cp_exposed_s + p2p_s
    bubble_s = (p - 1) / v * microbatch_s
    if layout.schedule is not None:
        weight_s = weight_gradient_seconds(
            config, layout, s, stage_layers[slowest],
            any(chunk_span(config, slowest, k).post_process for k in range(v)),
            padded_vocab_size, flop_rate)
        bubble_s = zero_bubble_seconds(layout, forward_s, backward_s,
                                       tp_s + cp_exposed_s + p2p_s, weight_s)

    dp_s = dp_exposed_s = 0.0
    if d * c > 1:  # gradients are reduced (and the optimizer sharded) over DP x CP
        per_stage = []  # (exposed, total) seconds of each stage's DP collectives
        for stage, (forward_r, backward_r, _, _) in zip(memory.stages, stages):
            grads, params = _collective_bytes(stage, layout, d * c // layout.instances,
                                              fp8_param_gather)
            if layout.fsdp2:
                # Every microbatch: ZeRO-3 gathers the parameters for its forward and its
                # backward (ZeRO-2 for its forward) and reduce-scatters its gradients
                # (fsdp.py's no_sync holds nothing back), each hidden behind that
                # microbatch's compute. Zero-bubble schedules reduce once, after the last
                # W, with nothing left to hide it (as DDP's last bucket, exposed whole).
                gathers = 1 if layout.memory_mode == "fsdp2-zero2" else 2
                reduce_s, gather_s = sharded_collective_seconds(layout, cluster, grads, params)
                gather_s *= gathers
                if layout.schedule is not None:
                    exposed = reduce_s + m * max(0.0, gather_s - forward_r)
                    per_stage.append((exposed, reduce_s + m * gather_s))
                    continue
                exposed = m * (max(0.0, reduce_s - backward_r)
                               + max(0.0, gather_s - forward_r))
                per_stage.append((exposed, m * (reduce_s + gather_s)))
                continue
            if layout.distributed_optimizer:
                reduce_s, gather_s = sharded_collective_seconds(layout, cluster, grads, params)
            else:
                ranks = d * c
                reduce_s = 2 * (ranks - 1) / ranks * grads / cluster.group_bandwidth(t * ranks)
                gather_s = 0.0
            exposed = max(0.0, reduce_s - backward_r) + max(0.0, gather_s - forward_r)
            per_stage.append((exposed, reduce_s + gather_s))
        dp_exposed_s, dp_s = max(per_stage)

    step_s = m * microbatch_s + bubble_s + dp_exposed_s
    model_flops = _flops(config, s, layout.global_batch_size, config.num_layers,
                         padded_vocab_size)
    return StepTime(
        compute_s=forward_s + backward_s, tensor_parallel_s=tp_s, pipeline_p2p_s=p2p_s,
        microbatch_s=microbatch_s, num_microbatches=m, bubble_s=bubble_s,
        data_parallel_s=dp_s, data_parallel_exposed_s=dp_exposed_s, step_s=step_s,
        bubble_fraction=bubble_s / (m * microbatch_s + bubble_s) if p > 1 else 0.0,
        model_flops=model_flops,
        mfu=mfu(model_flops, step_s, cluster.num_gpus, cluster.peak_tflops),
        tokens_per_s_per_gpu=layout.global_batch_size * s / (step_s * cluster.num_gpus),
        context_parallel_s=cp_s, context_parallel_exposed_s=cp_exposed_s,
        expert_parallel_s=ep_s)
