"""Activation memory of the zero-bubble schedules (zb-h1, zbv): what a rank holds between a
microbatch's F, B and W, walked over the rank's real order.

A zero-bubble B is the input gradient only; the linear layers' weight-gradient GEMMs wait in a
``WeightGradStore`` until the W step. So a (chunk, microbatch) holds
- from F to B: the chunk's saved activations (``activations.chunk_bytes``), as in 1F1B;
- from B to W: the deferred W records (``weight_grad_record_bytes``): every deferred linear
  keeps its output gradient and its saved input (``layers.LinearWithGradAllReduce``: under
  sequence parallelism the input is this rank's sequence shard). B frees the rest of the graph.

The peak is found by walking the order (``schedule_order``) step by step, adding and freeing
those amounts (``live_bytes_per_step``), not by a formula, so it follows the orders as they
change. Linear weights that run whole in B (biases, norms, the embedding) keep nothing.

Under zbv rank r holds virtual stages r (chunk 0) and 2p-1-r (chunk 1): the embedding and the
output layer (and its loss) are both on rank 0 (``chunk_span``).
"""
from dataclasses import dataclass
from typing import List, Sequence

from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ZERO_BUBBLE,
    Step,
)
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.training.memory.params import chunk_span


def pipeline_schedule(config) -> str:
    """The schedule a pipelined run of ``config`` uses ("1f1b", "interleaved", "zb-h1", "zbv")."""
    schedule = getattr(config, "pipeline_schedule", None)
    if schedule is not None:
        return schedule
    return "1f1b" if config.virtual_pipeline_model_parallel_size is None else "interleaved"


def is_zero_bubble(config) -> bool:
    return config.pipeline_model_parallel_size > 1 and pipeline_schedule(config) in ZERO_BUBBLE


def _linear_records(config, setup) -> List[int]:
    """(output gradient + input) bytes of each deferred linear of one layer, one TP rank."""
    tp = config.tensor_model_parallel_size
    e, h, d = setup.activation_bytes, config.hidden_size, config.kv_channels
    tokens = setup.local_seq_length(config) * setup.micro_batch_size
    shard = tokens // tp if config.sequence_parallel and tp > 1 else tokens
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    fc1_out = config.ffn_hidden_size * (2 if config.activation in GATED_ACTIVATIONS else 1) // tp
    if getattr(config, "multi_latent_attention", False):
        attention = _latent_attention_records(config, e, tokens, shard, heads)
    else:
        attention = [
            e * (tokens * (heads + 2 * groups) * d + shard * h),  # QKV: column, SP-shard input
            e * (tokens * h + tokens * heads * d),  # projection: row, full output grad
        ]
    return attention + [
        e * (tokens * fc1_out + shard * h),  # fc1: column
        e * (tokens * h + tokens * config.ffn_hidden_size // tp),  # fc2: row
    ]


def _latent_attention_records(config, e: int, tokens: int, shard: int, heads: int
                              ) -> List[int]:
    """Multi-latent attention's deferred linears: the down projections (replicated, on the
    SP shard; their shared input counted once), the up projections (column, SP-shard input),
    the output projection (row)."""
    h, q_rank, kv_rank = config.hidden_size, config.q_lora_rank, config.kv_lora_rank
    d_qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    kv_down = e * shard * (kv_rank + config.qk_pos_emb_head_dim)
    # Without the latent's norm kv_up's input is a view of kv_down's whole output.
    kv_up_input = kv_rank if config.qk_layernorm else kv_rank + config.qk_pos_emb_head_dim
    kv_up = e * (tokens * heads * (config.qk_head_dim + config.v_head_dim) +
                 shard * kv_up_input)
    if q_rank is None:
        query = [e * (tokens * heads * d_qk + shard * h)]
    else:
        query = [e * shard * (q_rank + h), e * (tokens * heads * d_qk + shard * q_rank)]
    return query + [kv_down, kv_up, e * (tokens * h + tokens * heads * config.v_head_dim)]


def weight_grad_record_bytes(config, setup, pipeline_rank: int, chunk: int = 0) -> int:
    """Bytes one microbatch's deferred W of one chunk keeps from its B to its W: the
    transformer layers' four linears and, on the last stage, the output layer (its input and
    the logits' gradient, [s, b, V/t] in the activation dtype)."""
    span = chunk_span(config, pipeline_rank, chunk)
    total = (span.end - span.start) * sum(_linear_records(config, setup))
    if span.post_process:
        tp = config.tensor_model_parallel_size
        tokens = setup.local_seq_length(config) * setup.micro_batch_size
        shard = tokens // tp if config.sequence_parallel and tp > 1 else tokens
        total += setup.activation_bytes * (tokens * setup.padded_vocab_size // tp +
                                           shard * config.hidden_size)
    return total


@dataclass
class WalkPeak:
    """The peak of a walk: bytes, and what is held there."""
    live_bytes: int = 0
    activations: int = 0  # (chunk, microbatch) between F and B
    deferred: int = 0  # (chunk, microbatch) between B and W
    deferred_bytes: int = 0  # of live_bytes, the W records


def live_bytes_per_step(order: Sequence[Step], activation_bytes: Sequence[int],
                        record_bytes: Sequence[int]) -> List[int]:
    """Bytes held after each step of ``order`` (per chunk: activations from F to B, or to W
    where the order has no W; W records from B to W)."""
    return [peak.live_bytes for peak in _walk(order, activation_bytes, record_bytes)]


def _walk(order, activation_bytes, record_bytes):
    split = any(step.kind == WEIGHT for step in order)
    state = WalkPeak()
    for step in order:
        a, w = activation_bytes[step.chunk], record_bytes[step.chunk]
        if step.kind == FORWARD:
            state.activations += 1
            state.live_bytes += a
        elif step.kind == BACKWARD:
            state.activations -= 1
            state.live_bytes -= a
            if split:
                state.deferred += 1
                state.deferred_bytes += w
                state.live_bytes += w
        else:
            state.deferred -= 1
            state.deferred_bytes -= w
            state.live_bytes -= w
        yield WalkPeak(state.live_bytes, state.activations, state.deferred,
                       state.deferred_bytes)


def walk_peak(order: Sequence[Step], activation_bytes: Sequence[int],
              record_bytes: Sequence[int]) -> WalkPeak:
    """The step after which the most bytes are held (the first such step)."""
    peak = WalkPeak()
    for state in _walk(order, activation_bytes, record_bytes):
        if state.live_bytes > peak.live_bytes:
            peak = state
    return peak
