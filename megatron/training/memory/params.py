"""Bytes a rank holds for parameters, gradients and optimizer state, from the configuration.

Exact for this code base, not a rule of thumb: the parameter list of each model chunk is
derived in registration order (so DDP's buckets and the distributed optimizer's shards, with
their padding, come out as the real run lays them out), and each kind of tensor is counted at
its dtype. Per parameter the totals reduce to the table in Megatron's distributed-optimizer
documentation (bytes/param; d = data-parallel size, times the context-parallel size under
CP: gradients are reduced and the optimizer sharded over DP x CP, ``OptimizerSetup``):

    params / grads       plain optimizer    distributed optimizer
    fp16 / fp16          20                 4 + 16/d
    bf16 / fp32          18                 6 + 12/d
    fp32 / fp32          16                 8 + 8/d

(2 param + 2 grad + fp32 main param, Adam m and v, and an fp32 copy of the gradient; with
fp32 gradient buffers the copy is the buffer itself; with fp32 params the main params are the
params.) Adam's per-tensor ``step`` counters (4 bytes each) are counted too.

Mixture of experts (``config.moe``, moe.py): an MoE layer's ``mlp.`` holds the router,
its E/EP experts (f split by expert TP) and the shared expert; the routed experts' state is
laid out in buffers of their own, with d = the expert-data-parallel size DP x CP x TP /
(ETP x EP) in place of DP (``modes.rank_state_bytes``).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import List, Tuple

from megatron.core.pipeline_parallel.layer_split import chunk_layer_range
from megatron.core.pipeline_placement import placement_for_schedule, virtual_stage_of
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.training.memory.base import FP32, ModelStateBytes, OptimizerSetup, ParamShape
from megatron.training.memory.moe import is_moe_layer, moe_mlp_params


def _layer_params(config, tp: int, number: int, prefix: str = None,
                  moe: bool = None) -> List[ParamShape]:
    """Layer ``number`` (0-based)'s parameters under ``prefix`` (default its decoder name);
    ``moe`` says whether its MLP has experts where the layer is not the model's own (a
    multi-token-prediction layer)."""
    h, d = config.hidden_size, config.kv_channels
    a, g = config.num_attention_heads, config.num_query_groups
    prefix = prefix or f"decoder.layers.{number}."
    norm = ["weight"] + (["bias"] if config.normalization == "LayerNorm" else [])
    qkv = (a + 2 * g) * d // tp
    shapes = [ParamShape(prefix + "input_layernorm." + n, h) for n in norm]
    if getattr(config, "multi_latent_attention", False):
        shapes += _latent_attention_params(config, tp, prefix + "self_attention.", norm)
        return shapes + _mlp_params(config, tp, number, prefix, norm, moe)
    shapes.append(ParamShape(prefix + "self_attention.linear_qkv.weight", qkv * h, qkv))
    if config.add_qkv_bias:
        shapes.append(ParamShape(prefix + "self_attention.linear_qkv.bias", qkv))
    shapes.append(ParamShape(prefix + "self_attention.linear_proj.weight", h * a * d // tp, h))
    if config.add_bias_linear:
        shapes.append(ParamShape(prefix + "self_attention.linear_proj.bias", h))
    if config.qk_layernorm:  # one norm over a head's dim, shared by the heads (Qwen3)
        shapes += [ParamShape(f"{prefix}self_attention.{q_or_k}_layernorm.{n}", d)
                   for q_or_k in "qk" for n in norm]
    if getattr(config, "softmax_type", "vanilla") == "learnable":  # attention sinks per head
        shapes.append(ParamShape(prefix + "self_attention.sinks", a // tp))
    return shapes + _mlp_params(config, tp, number, prefix, norm, moe)


def _latent_attention_params(config, tp: int, prefix: str, norm: List[str]
                             ) -> List[ParamShape]:
    """Multi-latent attention's (multi_latent_attention.py, in its registration order): the
    projections to heads split over TP by rows, the down projections and the latents' norms
    (with qk_layernorm) whole on every rank, no biases but the output projection's."""
    h, heads = config.hidden_size, config.num_attention_heads // tp
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    kv_rank, q_rank = config.kv_lora_rank, config.q_lora_rank

    def linear(name, rows, cols):
        return ParamShape(prefix + name + ".weight", rows * cols, rows)

    def norms(name, size):
        return [ParamShape(f"{prefix}{name}.{n}", size) for n in norm] \
            if config.qk_layernorm else []

    if q_rank is None:
        shapes = [linear("linear_q_proj", heads * qk, h)]
    else:
        shapes = [linear("linear_q_down_proj", q_rank, h), *norms("q_layernorm", q_rank),
                  linear("linear_q_up_proj", heads * qk, q_rank)]
    shapes += [linear("linear_kv_down_proj", kv_rank + config.qk_pos_emb_head_dim, h),
               *norms("kv_layernorm", kv_rank),
               linear("linear_kv_up_proj", heads * (config.qk_head_dim + config.v_head_dim),
                      kv_rank),
               linear("linear_proj", h, heads * config.v_head_dim)]
    if config.add_bias_linear:
        shapes.append(ParamShape(prefix + "linear_proj.bias", h))
    return shapes


def _mlp_params(config, tp: int, number: int, prefix: str, norm: List[str],
                moe: bool = None) -> List[ParamShape]:
    """The pre-MLP norm and the MLP (or MoE layer) of layer ``number``."""
    h, tp_f = config.hidden_size, config.ffn_hidden_size
    fc1 = tp_f * (2 if config.activation in GATED_ACTIVATIONS else 1) // tp
    shapes = [ParamShape(prefix + "pre_mlp_layernorm." + n, h) for n in norm]
    if is_moe_layer(config, number) if moe is None else moe:
        return shapes + moe_mlp_params(config, prefix + "mlp.")
    shapes.append(ParamShape(prefix + "mlp.linear_fc1.weight", fc1 * h, fc1))
    if config.add_bias_linear:
        shapes.append(ParamShape(prefix + "mlp.linear_fc1.bias", fc1))
    shapes.append(ParamShape(prefix + "mlp.linear_fc2.weight", h * tp_f // tp, h))
    if config.add_bias_linear:
        shapes.append(ParamShape(prefix + "mlp.linear_fc2.bias", h))
    return shapes


@dataclass(frozen=True)
class ChunkSpan:
    """Layers [start, end) of one model chunk, and whether it holds the embedding / output."""
    start: int
    end: int
    pre_process: bool
    post_process: bool


def chunk_span(config, pipeline_rank: int, chunk: int = 0) -> ChunkSpan:
    """Layers and ends of a chunk in the placement its schedule runs (the loop, or zbv's V,
    where rank 0 holds both the embedding and the output layer)."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    placement = placement_for_schedule(getattr(config, "pipeline_schedule", None))
    start, end = chunk_layer_range(
        config.num_layers, pp, pipeline_rank, chunk, vpp,
        config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage,
        config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split, placement)
    stage = virtual_stage_of(pipeline_rank, chunk, pp, vpp, placement)
    return ChunkSpan(start, end, stage == 0, stage == pp * (vpp or 1) - 1)


def chunk_param_shapes(config, padded_vocab_size: int, pipeline_rank: int, chunk: int = 0,
                       share_embeddings_and_output_weights: bool = True) -> List[ParamShape]:
    """This chunk's parameters in the order the model registers them (GPTModel)."""
    tp = config.tensor_model_parallel_size
    span = chunk_span(config, pipeline_rank, chunk)
    start, end = span.start, span.end
    pre_process, post_process = span.pre_process, span.post_process
    h, vocab = config.hidden_size, padded_vocab_size // tp
    shapes = []
    if pre_process:
        shapes.append(ParamShape("embedding.word_embeddings.weight", vocab * h, vocab))
        if config.position_embedding_type == "learned_absolute":
            shapes.append(ParamShape("embedding.position_embeddings.weight",
                                     config.max_position_embeddings * h,
                                     config.max_position_embeddings))
    for number in range(start, end):
        shapes += _layer_params(config, tp, number)
    if post_process:
        norm = ["weight"] + (["bias"] if config.normalization == "LayerNorm" else [])
        shapes += [ParamShape("decoder.final_layernorm." + n, h) for n in norm]
        if not (share_embeddings_and_output_weights and pre_process):
            shapes.append(ParamShape("output_layer.weight", vocab * h, vocab))
        shapes += _mtp_params(config, tp, norm)
        if getattr(config, "mtp_num_layers", None) and not pre_process and \
                not share_embeddings_and_output_weights:  # MTP's copy of the embedding
            shapes.append(ParamShape("mtp.word_embeddings.weight", vocab * h, vocab))
    return shapes


def _mtp_params(config, tp: int, norm: List[str]) -> List[ParamShape]:
    """The multi-token prediction depths (with the output layer), in registration order:
    the [h, 2h] projection (replicated), the two input norms, a layer of the model's last
    layer's kind, the norm before the head."""
    h, shapes = config.hidden_size, []
    last = config.num_layers - 1
    for k in range(getattr(config, "mtp_num_layers", None) or 0):
        prefix = f"mtp.depths.{k}."
        shapes.append(ParamShape(prefix + "eh_proj", 2 * h * h, h))
        shapes += [ParamShape(f"{prefix}{which}.{n}", h) for which in ("enorm", "hnorm")
                   for n in norm]
        shapes += _layer_params(config, tp, last, prefix + "layer.", is_moe_layer(config, last))
        shapes += [ParamShape(f"{prefix}final_layernorm.{n}", h) for n in norm]
    return shapes


def _is_tied_copy_alone(shape: ParamShape, share: bool, pre_process: bool,
                        post_process: bool, mtp: bool = False) -> bool:
    """The embedding and its copy on the last stage (the tied output layer, or multi-token
    prediction's) get a bucket of their own when sharded (see GradBuffer)."""
    if not (share or mtp) or pre_process == post_process:
        return False
    return shape.name in ("embedding.word_embeddings.weight", "mtp.word_embeddings.weight") \
        or (share and shape.name == "output_layer.weight")


def bucket_layout(shapes: List[ParamShape], setup: OptimizerSetup,
                  alone=lambda shape: False) -> List[Tuple[List[ParamShape], int]]:
    """(params, padded size) per bucket, as GradBuffer builds them: reverse registration
    order, a new bucket once ``bucket_size`` elements are reached, each padded to a multiple
    of the DP size when sharded."""
    shard, dp = setup.use_distributed_optimizer, setup.data_parallel_size
    groups, current, count = [], [], 0
    for shape in reversed(shapes):
        by_itself = shard and alone(shape)
        if by_itself and current:
            groups.append(current)
            current, count = [], 0
        current.append(shape)
        count += shape.numel
        if by_itself or (setup.bucket_size is not None and count >= setup.bucket_size):
            groups.append(current)
            current, count = [], 0
    if current:
        groups.append(current)
    layout = []
    for group in groups:
        size = sum(s.numel for s in group)
        layout.append((group, math.ceil(size / dp) * dp if shard else size))
    return layout


def _shard_states(group: List[ParamShape], padded: int, dp: int, dp_rank: int,
                  setup: OptimizerSetup) -> Tuple[int, int]:
    """(step counters, state elements) of this DP rank's shard of a bucket: the optimizer
    holds one tensor per parameter piece overlapping it, with its parameter's state (Muon's
    matrices: one momentum, no step; see OptimizerSetup.states_of); the bucket's padding has
    no optimizer state."""
    size = padded // dp
    begin, end, offset, steps, states = dp_rank * size, (dp_rank + 1) * size, 0, 0, 0
    for shape in group:
        overlap = min(offset + shape.numel, end) - max(offset, begin)
        if overlap > 0:
            steps += setup.steps_of(shape)
            states += setup.states_of(shape) * overlap
        offset += shape.numel
    return steps, states


def chunk_state_bytes(shapes: List[ParamShape], setup: OptimizerSetup, param_bytes: int,
                      data_parallel_rank: int = 0, alone=lambda shape: False
                      ) -> ModelStateBytes:
    """The state one model chunk costs on one rank's device after the optimizer step (with
    CPU offload the optimizer's part is on the host: ``modes.host_state_bytes``)."""
    if setup.cpu_offload:
        device = chunk_state_bytes(shapes, dataclasses.replace(setup, cpu_offload=False),
                                   param_bytes, data_parallel_rank, alone)
        return ModelStateBytes(params=device.params, grads=device.grads)
    grad_bytes = FP32 if setup.grad_reduce_in_fp32 else param_bytes
    mixed = param_bytes != FP32
    result = ModelStateBytes()
    layout = bucket_layout(shapes, setup, alone)
    if setup.use_distributed_optimizer:
        dp = setup.data_parallel_size
        for group, padded in layout:
            shard = padded // dp
            steps, state_elements = _shard_states(group, padded, dp, data_parallel_rank, setup)
            result.params += padded * param_bytes  # params live in the padded buffer
            # ZeRO-2: after the step only this rank's shard of the bucket is kept
            result.grads += (shard if setup.shard_gradients else padded) * grad_bytes
            result.main_params += shard * FP32 if mixed else 0
            result.main_grads += shard * FP32 if grad_bytes != FP32 else 0
            result.optimizer_states += state_elements * FP32
            result.step_counters += steps * FP32
        return result
    numel = sum(s.numel for s in shapes)
    result.params = numel * param_bytes
    result.grads = numel * grad_bytes
    result.main_params = numel * FP32 if mixed else 0
    result.main_grads = numel * FP32 if grad_bytes != FP32 else 0
    result.optimizer_states = sum(setup.states_of(s) * s.numel for s in shapes) * FP32
    result.step_counters = sum(setup.steps_of(s) for s in shapes) * FP32
    return result


def rank_chunks(config, padded_vocab_size: int, pipeline_rank: int,
                share_embeddings_and_output_weights: bool = True):
    """(parameter shapes, ``alone`` predicate of the bucket layout) of each chunk of one
    pipeline rank (DDP wraps each chunk on its own)."""
    share = share_embeddings_and_output_weights
    for chunk in range(config.virtual_pipeline_model_parallel_size or 1):
        shapes = chunk_param_shapes(config, padded_vocab_size, pipeline_rank, chunk, share)
        span = chunk_span(config, pipeline_rank, chunk)
        yield shapes, lambda s, span=span: _is_tied_copy_alone(
            s, share, span.pre_process, span.post_process,
            bool(getattr(config, "mtp_num_layers", None)))


def add_states(total: ModelStateBytes, part: ModelStateBytes) -> ModelStateBytes:
    for name in vars(total):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    return total
