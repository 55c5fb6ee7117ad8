"""The memory estimate's mixture-of-experts terms (``config.moe``; names and layouts of
design: TransformerConfig.moe, ModelParallelConfig.expert_model_parallel_size EP and
expert_tensor_parallel_size ETP).

Parameters of one MoE layer on one rank, in registration order (router, experts, shared
expert): the router [E, h] (replicated) and its bias [E] (--moe-router-bias), the E/EP local
experts' weight1 [E/EP, 2f/ETP, h] and weight2 [E/EP, h, f/ETP] and, with biases (expert TP
1), bias1 [E/EP, 2f] and bias2 [E/EP, h], the shared expert split over TP like a dense MLP
(with its biases) and its gate [1, h]. Expert weights live in DDP buffers of their own,
reduced over the expert-data-parallel group and sharded over it by the distributed
optimizer: EDP = world / (ETP x EP x PP) = DP x CP x TP / (ETP x EP).

Activations of one MoE layer, one microbatch, from what autograd saves in MoELayer (measured
by tests/unit/test_memory_moe.py): with T tokens on the rank (T/TP under sequence
parallelism), k choices and N = k T routed rows (E x capacity when padded to capacity; with
EP > 1, N is the rows this rank's experts receive, k T when the routing is balanced):
- router: its fp32 input (a copy unless the activations are fp32, where it is the MLP input
  itself), the top-k indices (int64) and gate probabilities (fp32) [T, k]; the scores [T, E]
  (fp32) for the aux loss, the logits [T, E] and log-sum-exp [T] for the z-loss;
- dispatch: the sort order and each row's token (int64 [N] each; the all-to-all also keeps its
  regrouping order and its inverse, 2 more [N]), each row's gate weight (fp32 [N]);
- experts: the input rows [N, h], the fc1 output 2f/ETP and the SwiGLU product f/ETP per row
  (3f/ETP: the MLP's SwiGLU function recomputes the SiLU in backward); grouped GEMM's offsets (int32 [E/EP]); with a
  capacity, the kept choices' order (int64), and when padding each kept row's slot and gate;
  with biases and the grouped GEMM, each row's expert (int64 [N], the bias rows' index);
- shared expert: the dense MLP's terms (fc1 output and product, 3 x its f/TP per token), and
  with its gate the sigmoid [T, 1] and the expert's output [T, h];
- combine: the expert output and the gate-weighted rows [N, h] each.
Dispatch buffers (transient, not saved: added to the peak once, like CP's K/V in flight): the
all-to-all's send and receive rows (2 N x h), the all-gather's EP x T gathered rows and the
EP x T partial outputs it reduce-scatters.
"""
import math
from typing import Dict

from megatron.training.memory.base import ParamShape

FP32, INT64, INT32 = 4, 8, 4


def is_moe_layer(config, layer_index: int) -> bool:
    """Whether 0-based global layer ``layer_index`` has experts."""
    moe = getattr(config, "moe", None)
    return moe is not None and moe.is_moe_layer(layer_index + 1)


def expert_sizes(config):
    """(EP, ETP) of a config (ETP None means the TP size)."""
    ep = getattr(config, "expert_model_parallel_size", 1)
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return ep, etp or config.tensor_model_parallel_size


def expert_data_parallel_size(config, data_parallel_size: int) -> int:
    """EDP = world / (ETP x EP x PP), from the dense DP (x CP) size."""
    ep, etp = expert_sizes(config)
    ranks = data_parallel_size * config.tensor_model_parallel_size
    if ranks % (ep * etp):
        raise ValueError(f"DP x CP x TP ({ranks}) is not divisible by ETP x EP ({etp * ep})")
    return ranks // (ep * etp)


def moe_mlp_params(config, prefix: str) -> list:
    """One MoE layer's ``mlp.`` parameters on one rank (ParamShape), in registration order."""
    moe, h, tp = config.moe, config.hidden_size, config.tensor_model_parallel_size
    ep, etp = expert_sizes(config)
    local, f = moe.num_moe_experts // ep, moe.moe_ffn_hidden_size // etp
    biased = config.add_bias_linear  # gpt-oss: the experts' (and shared expert's) biases
    shapes = [ParamShape(prefix + "router.weight", moe.num_moe_experts * h, moe.num_moe_experts)]
    if getattr(moe, "moe_router_bias", False):
        shapes.append(ParamShape(prefix + "router.bias", moe.num_moe_experts))
    shapes += [ParamShape(prefix + "experts.weight1", local * 2 * f * h, local),
               ParamShape(prefix + "experts.weight2", local * h * f, local)]
    if biased:  # expert-TP 1 (TransformerConfig's rule), so f here is the whole f
        shapes += [ParamShape(prefix + "experts.bias1", local * 2 * f, local),
                   ParamShape(prefix + "experts.bias2", local * h, local)]
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None:
        fc1 = 2 * shared // tp
        shapes.append(ParamShape(prefix + "shared_experts.linear_fc1.weight", fc1 * h, fc1))
        if biased:
            shapes.append(ParamShape(prefix + "shared_experts.linear_fc1.bias", fc1))
        shapes.append(ParamShape(prefix + "shared_experts.linear_fc2.weight", h * shared // tp, h))
        if biased:
            shapes.append(ParamShape(prefix + "shared_experts.linear_fc2.bias", h))
        if moe.moe_shared_expert_gate:
            shapes.append(ParamShape(prefix + "shared_experts.gate_weight", h, 1))
    return shapes


def is_expert_param(shape) -> bool:
    """Routed-expert weights: reduced and sharded over the expert-DP group."""
    return ".mlp.experts." in shape.name


def _capacity(config, tokens: int) -> int:
    moe = config.moe
    return math.ceil(tokens * moe.moe_router_topk / moe.num_moe_experts *
                     moe.moe_expert_capacity_factor)


def kept_rows(config, tokens: int) -> int:
    """Routing choices kept on one rank: k T, at most E x capacity (balanced routing)."""
    rows = config.moe.moe_router_topk * tokens
    if config.moe.moe_expert_capacity_factor is None:
        return rows
    return min(rows, _capacity(config, tokens) * config.moe.num_moe_experts)


def routed_rows(config, tokens: int) -> int:
    """N: the rows one rank's experts receive (balanced routing; padded to capacity)."""
    moe = config.moe
    if moe.moe_expert_capacity_factor is not None and moe.moe_pad_expert_input_to_capacity:
        return _capacity(config, tokens) * moe.num_moe_experts // expert_sizes(config)[0]
    return kept_rows(config, tokens)


def moe_layer_terms(config, tokens: int, e: int, sequences: int = 1) -> Dict[str, int]:
    """Bytes one MoE layer's MLP keeps for backward (its input included), one microbatch on
    one rank; ``tokens`` is T on the rank (after the SP split), ``e`` the
    activation element size, ``sequences`` the micro batch size."""
    moe, h = config.moe, config.hidden_size
    ep, etp = expert_sizes(config)
    experts, k, f = moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size // etp
    rows = routed_rows(config, tokens)
    shared = moe.moe_shared_expert_intermediate_size
    terms = {"router top-k indices": INT64 * tokens * k}
    if moe.moe_router_score_function == "softmax" and not moe.moe_router_pre_softmax:
        terms["router gates (softmax over the k)"] = FP32 * tokens * k
    else:  # softmax or sigmoid over all E, then the top-k
        terms["router scores over all experts"] = FP32 * tokens * experts
        if moe.moe_router_topk_norm:
            terms["router gates and their sum (top-k norm)"] = FP32 * tokens * (k + 1)
    # The router's input in fp32 is the layer's MLP input itself; the shared expert keeps it.
    if e == FP32 or shared is not None:
        terms["MLP input"] = e * tokens * h
    if e != FP32:
        terms["router fp32 input"] = FP32 * tokens * h
    if moe.moe_router_load_balancing_type != "none" and moe.moe_aux_loss_coeff > 0:
        # and the [E] load per expert (per sequence for seq_aux_loss)
        per = sequences if moe.moe_router_load_balancing_type == "seq_aux_loss" else 1
        terms["router scores (aux loss)"] = FP32 * tokens * experts + FP32 * experts * per
    if moe.moe_z_loss_coeff:
        terms["router logits and log-sum-exp (z-loss)"] = FP32 * tokens * (experts + 1)
    if moe.moe_expert_capacity_factor is not None:  # the kept choices' order
        terms["capacity: kept choices"] = INT64 * kept_rows(config, tokens)
    if moe.moe_pad_expert_input_to_capacity:  # slot of each kept row and its gate
        terms["capacity slots and kept gates"] = (INT64 + FP32) * kept_rows(config, tokens)
    index_arrays = 4 if ep > 1 and moe.moe_token_dispatcher_type == "alltoall" else 2
    terms["dispatch order, row tokens and gates"] = (index_arrays * INT64 + FP32) * rows
    terms["expert input rows"] = e * rows * h
    if config.add_bias_linear and moe.moe_grouped_gemm:  # which bias row each row adds
        terms["expert of each row (biases)"] = INT64 * rows
    terms["expert fc1 output and SwiGLU product"] = e * rows * 3 * f
    if moe.moe_grouped_gemm:
        terms["grouped GEMM offsets"] = INT32 * (experts // ep)
    terms["expert output and weighted rows"] = 2 * e * rows * h
    if shared is not None:  # the dense MLP's SwiGLU terms (fc1 output and product)
        terms["shared expert intermediate"] = \
            e * tokens * 3 * shared // config.tensor_model_parallel_size
        if moe.moe_shared_expert_gate:
            terms["shared expert gate and output"] = e * tokens * (h + 1)
    return terms


def dispatch_buffer_bytes(config, tokens: int, e: int) -> int:
    """The dispatcher's transient rows in one MoE layer (0 at EP 1)."""
    ep, _ = expert_sizes(config)
    if ep == 1:
        return 0
    h = config.hidden_size
    if config.moe.moe_token_dispatcher_type == "alltoall":
        return 2 * routed_rows(config, tokens) * h * e  # send and receive
    return 2 * ep * tokens * h * e  # gathered rows and the partial outputs


def alltoall_bytes_per_layer(config, tokens: int, e: int) -> int:
    """All-to-all traffic of one MoE layer, forward (2 k T h: dispatch and combine); the
    backward moves as much again."""
    return 2 * config.moe.moe_router_topk * tokens * config.hidden_size * e
