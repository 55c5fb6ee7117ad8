"""The step-time model's mixture-of-experts terms (step_time.py).

- FLOPs: an MoE layer's FFN does k routed experts' SwiGLU (k x moe_ffn_hidden_size) plus the
  shared expert per token, so the FLOP count takes, per layer on average, that FFN size in
  place of ffn_hidden_size for the MoE layers (the router's h x E multiply-adds a token are
  left out, under 1% for the models planned). Expert parallelism moves the experts' work
  between ranks without changing a rank's share (balanced routing), so compute per GPU does
  not depend on EP.
- All-to-all (EP > 1): per MoE layer and microbatch each rank sends its k T routed rows to
  the experts' ranks and receives as many back in the combine, 2 k T h e bytes forward
  (T = b s / TP tokens under sequence parallelism), of which (EP-1)/EP leave the rank; the
  backward moves that again twice (the gradients back, and for the combine), full
  recomputation one more forward. Over the EP group's link: EP ranks are ETP apart, so the
  group spans ETP x EP consecutive ranks. Not overlapped with compute (the dispatch waits for
  the router, the experts for the dispatch).
"""
from megatron.training.memory.moe import expert_sizes, is_moe_layer


def effective_ffn_hidden_size(config) -> int:
    """The FFN size per token, averaged over the layers (MoE layers: k routed experts plus
    the shared expert)."""
    moe = getattr(config, "moe", None)
    if moe is None:
        return config.ffn_hidden_size
    routed = moe.moe_router_topk * moe.moe_ffn_hidden_size + \
        (moe.moe_shared_expert_intermediate_size or 0)
    moe_layers = sum(is_moe_layer(config, i) for i in range(config.num_layers))
    total = moe_layers * routed + (config.num_layers - moe_layers) * config.ffn_hidden_size
    return total // config.num_layers


def moe_layers_in(config, spans) -> int:
    return sum(is_moe_layer(config, i) for span in spans for i in range(span.start, span.end))


def alltoall_seconds_per_layer(config, layout, cluster, seq_length: int, element: int) -> float:
    """One MoE layer's all-to-all time for one microbatch: forward, backward and the redone
    forward under full recomputation (module docstring); 0 at EP 1 or for a dense model."""
    if getattr(config, "moe", None) is None:
        return 0.0
    ep, etp = expert_sizes(config)
    if ep == 1:
        return 0.0
    t = layout.tensor_parallel
    tokens = layout.micro_batch_size * seq_length // layout.context_parallel // t
    forward = 2 * config.moe.moe_router_topk * tokens * config.hidden_size * element
    passes = 4 if layout.recompute == "full" else 3
    return passes * forward * (ep - 1) / ep / cluster.group_bandwidth(etp * ep)
