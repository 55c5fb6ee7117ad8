"""Mixture of experts: config, router, dispatch, experts and the MoE layer."""
from megatron.core.transformer.moe.experts import SwiGLUExperts
from megatron.core.transformer.moe.local_dispatcher import LocalDispatcher
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter, update_expert_bias

__all__ = ["LocalDispatcher", "MoEConfig", "MoELayer", "SwiGLUExperts", "TopKRouter",
           "update_expert_bias"]
