"""Activation memory: what autograd keeps for one microbatch, per layer and per stage, and how
many microbatches a pipeline stage holds at once.

The per-layer tally follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4): every tensor the backward pass needs, named, in bytes.
Their GPT-3 layer (fp16, 1-byte dropout masks, unfused attention) gives sbh(34 + 5as/h);
tensor parallelism divides the parts inside attention and the MLP by t, sequence parallelism
also the norms, dropouts and linear inputs (sbh/t (34 + 5as/h)); selective recomputation drops
the attention core (sbh/t x 34) where it is unfused (with flash there is nothing to drop, so
selective recomputes nothing there); full recomputation keeps only each checkpointed span's input.
The same terms here are those of this code base's layers, so the estimate tracks what really
stays alive:
- LayerNorm keeps its input in fp32 (statistics are computed in fp32) and its per-token mean
  and rstd; RMSNorm keeps its input as it is and its per-token rstd (it recomputes the rest);
- attention is SDPA: the flash/memory-efficient kernels (CUDA, and CPU without attention
  dropout) keep Q, K, V, the output and the log-sum-exp, no s x s matrix; CPU with attention
  dropout runs the unfused math path, which keeps Korthikanti's softmax, mask and dropout
  output (as^2b each);
- V is a view of the fused QKV output, so the whole QKV output stays alive; RoPE makes Q and
  K new tensors; grouped-query attention shrinks K and V; on the compiled path (outside CP,
  without QK norms) one compiled pass writes Q, K and V anew and the QKV output is freed;
- SwiGLU keeps the fc1 output (gate and up) and the product (3 f per token; SiLU's output is
  recomputed in backward); GeLU its input and output (2 f);
- dropout masks are 1 byte on CUDA (fused kernel) and a full-width tensor on CPU.

Context parallelism (``config.context_parallel_size`` = c > 1) gives each rank s/c tokens of
every microbatch (chunks r and 2c-1-r of 2c), so every per-token term above (norms, QKV, MLP,
dropout masks, the attention core, the embedding, the loss, cos/sin) is taken at s/c, and under
sequence parallelism at s/(c t). Attention then always keeps its log-sum-exp and no s x s
tensor (selective recomputation is a no-op) and its own output (the output projection keeps a
re-laid-out copy); with ``cp_comm_type`` "all_gather" it keeps the gathered K and V of the
whole sequence per layer instead of the local ones. Transient K/V buffers (the ring's block in
flight; all_gather's whole-sequence dK/dV) are not saved: ``cp_kv_in_flight_bytes``, added to
the peak once.
"""
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron.core.pipeline_parallel.schedule_order import FORWARD, schedule_order
from megatron.core.transformer.attention import compiled_head_layout, sdpa_kernel_for
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.training.memory.moe import dispatch_buffer_bytes, is_moe_layer, moe_layer_terms
from megatron.training.memory.params import chunk_span
from megatron.training.memory.schedules import (
    is_zero_bubble,
    pipeline_schedule,
    walk_peak,
    weight_grad_record_bytes,
)

FP32, INT64 = 4, 8
CP_KERNEL = "context_parallel"  # attention_kernel's name for the CP path (LSE-merging blocks)


@dataclass(frozen=True)
class ActivationSetup:
    seq_length: int
    micro_batch_size: int
    activation_bytes: int  # 2 for bf16/fp16, 4 for fp32
    padded_vocab_size: int
    device: str = "cuda"  # "cuda" or "cpu": which attention kernel and dropout masks
    training: bool = True

    def mask_bytes(self) -> int:
        return 1 if self.device == "cuda" else self.activation_bytes

    def local_seq_length(self, config) -> int:
        """Tokens of each sequence on one rank: s / CP."""
        return self.seq_length // config.context_parallel_size

    def attention_kernel(self, config) -> Tuple[str, bool]:
        """(kernel, K/V expanded) as attention.sdpa_kernel_for picks them for this setup;
        under context parallelism the CP attention (blocks merged by their LSE)."""
        if config.context_parallel_size > 1:
            return CP_KERNEL, False
        dtype = torch.float32 if self.activation_bytes == FP32 else torch.bfloat16
        return sdpa_kernel_for(self.device, dtype, config.kv_channels,
                               config.num_query_groups != config.num_attention_heads, False,
                               self.training and config.attention_dropout > 0)

    def flash_attention(self, config) -> bool:
        """A fused kernel (flash or memory-efficient): no s x s matrix is kept."""
        return self.attention_kernel(config)[0] != "math"


def _norm_terms(config, tokens: int, h: int, e: int) -> Dict[str, int]:
    if config.normalization == "RMSNorm":
        return {"norm input": e * tokens * h, "norm statistics": FP32 * tokens}
    return {"norm input (fp32)": FP32 * tokens * h, "norm statistics": 2 * FP32 * tokens}


def layer_terms(config, setup: ActivationSetup, moe: bool = False) -> Dict[str, int]:
    """Bytes one transformer layer keeps for backward, one microbatch, no recomputation, on
    one tensor-parallel rank; ``moe``: an MoE layer (its MLP terms from moe.py)."""
    tp = config.tensor_model_parallel_size
    s, b, e = setup.local_seq_length(config), setup.micro_batch_size, setup.activation_bytes
    h, f = config.hidden_size, config.ffn_hidden_size
    tokens = s * b
    # Sequence parallelism shards the norms, dropouts and linear inputs along the sequence.
    sharded_tokens = tokens // tp if config.sequence_parallel and tp > 1 else tokens
    m = setup.mask_bytes() if config.hidden_dropout > 0 else 0
    terms: Dict[str, int] = {}

    def add(name: str, value: int) -> None:
        terms[name] = terms.get(name, 0) + value

    for name, value in _norm_terms(config, sharded_tokens, h, e).items():
        add(name, 2 * value)  # before attention and before the MLP
    if getattr(config, "multi_latent_attention", False):
        for name, value in _latent_attention_terms(config, setup, sharded_tokens).items():
            add(name, value)
    else:
        for name, value in _self_attention_terms(config, setup, sharded_tokens).items():
            add(name, value)
    add("dropout masks", 2 * m * sharded_tokens * h)
    if moe:
        for name, value in moe_layer_terms(config, sharded_tokens, e, b).items():
            add(name, value)
        return terms
    add("MLP input", e * sharded_tokens * h)
    gated = config.activation in GATED_ACTIVATIONS
    add("MLP intermediate", e * tokens * f // tp * (3 if gated else 2))
    return terms


def _self_attention_terms(config, setup: ActivationSetup, sharded_tokens: int
                          ) -> Dict[str, int]:
    """SelfAttention's (fused QKV) saved tensors, from its input to the output projection's."""
    tp = config.tensor_model_parallel_size
    s, b, e = setup.local_seq_length(config), setup.micro_batch_size, setup.activation_bytes
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    tokens = s * b
    terms: Dict[str, int] = {}

    def add(name: str, value: int) -> None:
        terms[name] = terms.get(name, 0) + value

    add("QKV input", e * sharded_tokens * h)
    rope = config.position_embedding_type == "rope"
    new_query = rope or heads != groups  # a new Q unless it is a plain view of the QKV output
    # all_gather keeps the gathered K/V, not the local ones: the QKV output (V's storage) and
    # RoPE's K are then freed, unless Q is a view of the QKV output.
    gathered = config.context_parallel_size > 1 and config.cp_comm_type == "all_gather"
    if compiled_head_layout(config):  # Q, K, V written anew from the QKV output, then freed
        add("Q, K, V (the compiled head layout)", e * tokens * (heads + 2 * groups) * d)
    else:
        if not (gathered and new_query):
            add("QKV output (V is a view of it)", e * tokens * (heads + 2 * groups) * d)
        if new_query:
            add("Q", e * tokens * heads * d)
        if rope and not gathered:
            add("K", e * tokens * groups * d)
    for name, value in _attention_core_terms(config, setup, heads, groups).items():
        add(name, value)
    add("attention output projection input", e * tokens * heads * d)
    return terms


def _latent_norm_terms(config, tokens: int, width: int, stored_width: int, e: int
                       ) -> Dict[str, int]:
    """A latent's norm (multi-latent attention with qk_layernorm) over ``width`` channels of
    a down projection's output ``stored_width`` wide: RMSNorm keeps its input as it is, a view
    of that whole output; LayerNorm an fp32 copy of the latent (in fp32: the view itself)."""
    if config.normalization == "RMSNorm":
        return {"latent norm input (the down projection's output)": e * tokens * stored_width,
                "norm statistics": FP32 * tokens}
    kept = FP32 * tokens * (stored_width if e == FP32 else width)
    return {"latent norm input (fp32)": kept, "norm statistics": 2 * FP32 * tokens}


def _latent_attention_terms(config, setup: ActivationSetup, sharded_tokens: int
                            ) -> Dict[str, int]:
    """Multi-latent attention's saved tensors (multi_latent_attention.py), on one TP rank:
    the down projections' input, the latents (their norms' inputs and outputs, which the up
    projections keep), the rotated Q and K (d_qk = qk_head_dim + qk_pos_emb_head_dim), V
    and the attention core, and the output projection's input (d_v = v_head_dim). The down
    projections and latents are per sharded token (SP), the rest per token. Where V is
    zero-padded to d_qk (fused kernels, CP) the kernel keeps the padded V and its d_qk-wide
    output, and the output projection a d_v-wide copy of it; SDPA's math kernel (CPU with
    attention dropout) keeps V as a view of the key/value up projection's output."""
    tp = config.tensor_model_parallel_size
    s, b, e = setup.local_seq_length(config), setup.micro_batch_size, setup.activation_bytes
    heads, tokens = config.num_attention_heads // tp, s * b
    d_qk, d_v = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    kv_rank, q_rank = config.kv_lora_rank, config.q_lora_rank
    terms: Dict[str, int] = {}

    def add(name: str, value: int) -> None:
        terms[name] = terms.get(name, 0) + value

    add("down projections' input", e * sharded_tokens * config.hidden_size)
    for rank, stored in ((q_rank, q_rank), (kv_rank, kv_rank + config.qk_pos_emb_head_dim)):
        if rank is None:  # no query latent: linear_q_proj keeps the hidden input above
            continue
        if config.qk_layernorm:
            for name, value in _latent_norm_terms(config, sharded_tokens, rank, stored,
                                                  e).items():
                add(name, value)
            add("normalised latents (the up projections' input)", e * sharded_tokens * rank)
        else:  # the up projection keeps the latent, a view of the down projection's output
            add("latents (the up projections' input)", e * sharded_tokens * stored)
    gathered = config.context_parallel_size > 1 and config.cp_comm_type == "all_gather"
    padded = config.context_parallel_size > 1 or setup.flash_attention(config)
    add("Q and K (rotated)", e * tokens * heads * d_qk * (1 if gathered else 2))
    if not padded:  # the math kernel: V a view of the up projection's output
        add("V (the key/value up projection's output)",
            e * tokens * heads * (config.qk_head_dim + d_v))
    elif not gathered:
        add("V padded to the Q/K head dim", e * tokens * heads * d_qk)
    if padded and config.context_parallel_size == 1:
        add("attention output (padded)", e * tokens * heads * d_qk)
    for name, value in _attention_core_terms(config, setup, heads, heads).items():
        add(name, value)
    add("attention output projection input", e * tokens * heads * d_v)
    return terms


def _attention_core_terms(config, setup: ActivationSetup, heads: int, groups: int
                          ) -> Dict[str, int]:
    """What the attention kernel itself keeps (dropped by selective recomputation)."""
    s, b, e = setup.local_seq_length(config), setup.micro_batch_size, setup.activation_bytes
    d = config.kv_channels
    if config.context_parallel_size > 1:
        return _cp_attention_core_terms(config, setup, heads, groups)
    if setup.flash_attention(config):
        # Its output is the storage the output projection keeps (a view: the projection's
        # linear saves its 3-D input as given), counted as that GEMM's input.
        terms = {"attention log-sum-exp": FP32 * b * heads * s}
        if setup.attention_kernel(config)[1]:  # memory-efficient kernel under GQA (CUDA)
            terms["K, V expanded to all heads"] = 2 * e * s * b * heads * d
        return terms
    # Unfused (CPU with attention dropout): scaled Q and K^T copies, softmax, dropout mask
    # and dropout output, and K/V expanded to all heads under grouped-query attention.
    terms = {"softmax, dropout mask and output": (2 * e + setup.mask_bytes()) * b * heads * s * s}
    # Multi-latent attention counts Q and K (the copies' size) with its layer's terms:
    # selective recomputation keeps them, as the recomputed span's inputs.
    if not getattr(config, "multi_latent_attention", False):
        terms["attention Q, K copies"] = 2 * e * s * b * heads * d
    if heads != groups:
        terms["V expanded to all heads"] = e * s * b * heads * d
    return terms


def _cp_attention_core_terms(config, setup: ActivationSetup, heads: int, groups: int
                             ) -> Dict[str, int]:
    """The CP attention's own saved tensors (context_parallel/ring.py, all_gather.py) beside its
    q, k and v: its output [b, heads, s/CP, d] (the output projection keeps a [s/CP, b, heads x d]
    copy of it, counted as that GEMM's input), the fp32 log-sum-exp of the local queries, and
    under all_gather the gathered K and V of the whole sequence."""
    b, e, d = setup.micro_batch_size, setup.activation_bytes, config.kv_channels
    s_local = setup.local_seq_length(config)
    terms = {"attention output (the CP attention's own)": e * b * heads * s_local * d,
             "attention log-sum-exp": FP32 * b * heads * s_local}
    if config.cp_comm_type == "all_gather":
        terms["gathered K, V (all_gather)"] = 2 * e * b * groups * setup.seq_length * d
    return terms


def attention_call_bytes(config, setup: ActivationSetup) -> int:
    """What one attention call keeps for backward on one rank, its inputs included (in the
    layer tally they are the QKV output, Q and K terms): q, k, v, output and log-sum-exp for
    flash at CP 1 and for the ring; q, the gathered K and V, output and log-sum-exp for
    all_gather. Only for kernels that keep the log-sum-exp (no s x s matrix)."""
    if not setup.flash_attention(config) or setup.attention_kernel(config)[1]:
        raise ValueError("attention_call_bytes covers flash-like kernels (no s x s scores, no "
                         "expanded K/V) only")
    tp = config.tensor_model_parallel_size
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    b, e, d = setup.micro_batch_size, setup.activation_bytes, config.kv_channels
    s_local = setup.local_seq_length(config)
    query_and_output = 2 * e * b * heads * s_local * d
    lse = FP32 * b * heads * s_local
    if config.context_parallel_size > 1 and config.cp_comm_type == "all_gather":
        return query_and_output + lse + 2 * e * b * groups * setup.seq_length * d
    return query_and_output + lse + 2 * e * b * groups * s_local * d


def cp_kv_in_flight_bytes(config, setup: ActivationSetup) -> int:
    """The CP attention's transient K/V buffers during one layer's backward (the larger half;
    not saved, so they add to the peak once; from context_parallel/ring.py / all_gather.py, not
    measured). The ring: one block of K and V (b x groups/TP x s/CP x d each) being sent and
    one being received, and likewise the block's dK and dV travelling back, accumulated in
    fp32. all_gather: dK and dV of the whole sequence in fp32, and their rank-ordered copy for
    the reduce-scatter. 0 without CP."""
    if config.context_parallel_size == 1:
        return 0
    groups = config.num_query_groups // config.tensor_model_parallel_size
    kv_tokens = 2 * setup.micro_batch_size * groups * config.kv_channels  # K and V, a token
    if config.cp_comm_type == "all_gather":
        return 2 * kv_tokens * setup.seq_length * FP32
    return 2 * kv_tokens * setup.local_seq_length(config) * (setup.activation_bytes + FP32)


def layer_bytes(config, setup: ActivationSetup, recompute: Optional[str] = None,
                moe: bool = False) -> int:
    """One layer, one microbatch. ``recompute``: None, "selective" (the attention core is
    recomputed where the kernel keeps the s x s softmax; a no-op with a fused kernel, which
    keeps only Q, K, V, output and log-sum-exp) or "full" (nothing but the span inputs, see
    ``chunk_bytes``)."""
    terms = layer_terms(config, setup, moe)
    if recompute == "selective" and not setup.flash_attention(config):
        tp = config.tensor_model_parallel_size
        core = _attention_core_terms(config, setup, config.num_attention_heads // tp,
                                     config.num_query_groups // tp)
        return sum(terms.values()) - sum(core.values())
    return sum(terms.values())


def _hidden_input_bytes(config, setup: ActivationSetup) -> int:
    """A [s, b, h] tensor between layers (sequence-sharded under SP or distributed saving)."""
    tp = config.tensor_model_parallel_size
    divided = (config.sequence_parallel or config.distribute_saved_activations) and tp > 1
    tokens = setup.local_seq_length(config) * setup.micro_batch_size
    return setup.activation_bytes * (tokens // tp if divided else tokens) * config.hidden_size


def layers_bytes(config, setup: ActivationSetup, num_layers: int, start: int = 0) -> int:
    """``num_layers`` consecutive layers of a chunk (the first is global layer ``start``,
    0-based: MoE and dense layers differ) under the config's recomputation."""
    granularity = config.recompute_granularity
    if granularity != "full":
        return sum(layer_bytes(config, setup, granularity, is_moe_layer(config, i))
                   for i in range(start, start + num_layers))
    k = config.recompute_num_layers
    if config.recompute_method == "uniform":  # one saved input per group of k layers
        return math.ceil(num_layers / k) * _hidden_input_bytes(config, setup)
    recomputed = min(k, num_layers)  # "block": the first k layers one by one
    return recomputed * _hidden_input_bytes(config, setup) + sum(
        layer_bytes(config, setup, moe=is_moe_layer(config, i))
        for i in range(start + recomputed, start + num_layers))


def recompute_working_bytes(config, setup: ActivationSetup, num_layers: int) -> int:
    """Full recomputation rebuilds one span's activations during its backward: the transient
    peak on top of what is stored."""
    if config.recompute_granularity != "full":
        return 0
    span = config.recompute_num_layers if config.recompute_method == "uniform" else 1
    largest = max(layer_bytes(config, setup, moe=moe) for moe in
                  ((False, True) if getattr(config, "moe", None) else (False,)))
    return min(span, num_layers) * largest


def embedding_bytes(config, setup: ActivationSetup) -> int:
    """The first stage: token ids (and positions) and the embedding dropout mask."""
    tp = config.tensor_model_parallel_size
    tokens = setup.local_seq_length(config) * setup.micro_batch_size
    total = INT64 * tokens  # the ids (under TP: shifted into this rank's vocabulary range)
    if tp > 1:  # which ids are outside this rank's range
        total += tokens
    if config.position_embedding_type == "learned_absolute":
        total += INT64 * setup.local_seq_length(config)
    if config.hidden_dropout > 0:
        sharded = tokens // tp if config.sequence_parallel and tp > 1 else tokens
        total += setup.mask_bytes() * sharded * config.hidden_size
    return total


def output_bytes(config, setup: ActivationSetup) -> int:
    """The last stage: final norm, output-layer input and the cross entropy's fp32 logits
    with its per-token sums, mask and targets; on the compiled path (``torch_compile``) its
    fused cross entropy keeps the logits in their own dtype and the row maximum too."""
    tp = config.tensor_model_parallel_size
    tokens = setup.local_seq_length(config) * setup.micro_batch_size
    sharded = tokens // tp if config.sequence_parallel and tp > 1 else tokens
    e, h = setup.activation_bytes, config.hidden_size
    norm = sum(_norm_terms(config, sharded, h, e).values())
    # sum_exp is a view of the stacked [predicted logit; sum_exp] buffer: 2 floats a token
    logits = tokens * setup.padded_vocab_size // tp
    if config.torch_compile:
        loss = e * logits + 3 * FP32 * tokens + tokens + INT64 * tokens
    else:
        loss = FP32 * logits + 2 * FP32 * tokens + tokens + INT64 * tokens
    return norm + e * sharded * h + loss


def rotary_bytes(config, setup: ActivationSetup) -> int:
    """cos and sin, computed once per chunk and shared by its layers."""
    if config.position_embedding_type != "rope":
        return 0
    rotary_dim = config.qk_pos_emb_head_dim if getattr(config, "multi_latent_attention", False) \
        else int(config.kv_channels * config.rotary_percent)
    return 2 * FP32 * setup.local_seq_length(config) * rotary_dim


def chunk_bytes(config, setup: ActivationSetup, pipeline_rank: int, chunk: int = 0) -> int:
    """One microbatch's stored activations in one model chunk (placed as its schedule places
    it: zbv's V puts the embedding and the loss on rank 0)."""
    span = chunk_span(config, pipeline_rank, chunk)
    total = layers_bytes(config, setup, span.end - span.start, span.start) + \
        rotary_bytes(config, setup)
    if span.pre_process:
        total += embedding_bytes(config, setup)
    elif setup.activation_bytes != FP32 and config.recompute_granularity != "full" and \
            config.normalization != "RMSNorm":
        # The received input stays alive for backward; the first LayerNorm keeps an fp32 copy
        # (RMSNorm keeps the received input itself, counted as its norm input).
        total += _hidden_input_bytes(config, setup)
    if span.post_process:
        total += output_bytes(config, setup)
    return total


@dataclass
class StageActivations:
    pipeline_rank: int
    in_flight: int  # (microbatch, chunk) forwards alive at the peak
    stored_bytes: int  # at the peak of the schedule
    recompute_working_bytes: int
    cp_kv_in_flight_bytes: int = 0  # the CP ring's K/V block in flight (transient)
    # Zero-bubble schedules: of stored_bytes, the deferred W records (output gradients and
    # linear inputs kept from B to W) of ``deferred`` (chunk, microbatch) at the peak.
    weight_grad_bytes: int = 0
    deferred: int = 0
    moe_dispatch_bytes: int = 0  # an MoE layer's dispatcher rows in flight (transient)

    @property
    def peak_bytes(self) -> int:
        return self.stored_bytes + self.recompute_working_bytes + \
            self.cp_kv_in_flight_bytes + self.moe_dispatch_bytes


def stage_activations(config, setup: ActivationSetup, pipeline_rank: int,
                      num_microbatches: int) -> StageActivations:
    """Walk this rank's schedule (the order the executor runs): each forward adds its chunk's
    microbatch activations until its backward frees them (zero-bubble schedules: the backward
    leaves the W records until the W step, ``schedules``); the peak is what must fit."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    chunks = range(vpp or 1)
    per_chunk = [chunk_bytes(config, setup, pipeline_rank, c) for c in chunks]
    records = deferred = 0
    if pp == 1:  # no pipelining: each microbatch's backward follows its forward
        live_peak, in_flight = per_chunk[0], 1
    elif is_zero_bubble(config):
        order = schedule_order(pp, pipeline_rank, num_microbatches, vpp,
                               schedule=pipeline_schedule(config))
        peak = walk_peak(order, per_chunk, [weight_grad_record_bytes(
            config, setup, pipeline_rank, c) for c in chunks])
        live_peak, in_flight = peak.live_bytes, peak.activations
        records, deferred = peak.deferred_bytes, peak.deferred
    else:
        live = count = live_peak = in_flight = 0
        for step in schedule_order(pp, pipeline_rank, num_microbatches, vpp):
            sign = 1 if step.kind == FORWARD else -1
            live += sign * per_chunk[step.chunk]
            count += sign
            if live > live_peak:
                live_peak, in_flight = live, count
    layers = max(span.end - span.start for span in
                 (chunk_span(config, pipeline_rank, c) for c in chunks))
    return StageActivations(pipeline_rank, in_flight, live_peak,
                            recompute_working_bytes(config, setup, layers),
                            cp_kv_in_flight_bytes(config, setup) if layers else 0,
                            records, deferred, moe_dispatch_in_flight(config, setup, layers))


def moe_dispatch_in_flight(config, setup: ActivationSetup, layers: int) -> int:
    """The dispatcher's send/receive (all-gather: gathered) rows of one MoE layer."""
    if not layers or getattr(config, "moe", None) is None:
        return 0
    tp, tokens = config.tensor_model_parallel_size, \
        setup.local_seq_length(config) * setup.micro_batch_size
    sharded = tokens // tp if config.sequence_parallel and tp > 1 else tokens
    return dispatch_buffer_bytes(config, sharded, setup.activation_bytes)
