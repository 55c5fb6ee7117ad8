"""MoELayer: router, dispatch, routed SwiGLU experts, combine, and an optional shared expert.

Expert parallelism is not here yet: the local dispatcher keeps every expert on this rank.
"""
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.experts import SwiGLUExperts
from megatron.core.transformer.moe.local_dispatcher import LocalDispatcher
from megatron.core.transformer.moe.router import TopKRouter


class SharedExpertMLP(torch.nn.Module):
    """A dense SwiGLU FFN every token goes through (weight1 [2f, h] = [gate; up], weight2
    [h, f]); with `gate`, Qwen2-MoE's sigmoid(x @ gate_weight^T) scales its output per token."""

    def __init__(self, hidden_size, ffn_hidden_size, gate=False, init_method_std=0.02):
        super().__init__()
        self.weight1 = torch.nn.Parameter(torch.empty(2 * ffn_hidden_size, hidden_size))
        self.weight2 = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size))
        self.gate_weight = torch.nn.Parameter(torch.empty(1, hidden_size)) if gate else None
        for weight in self.parameters():
            torch.nn.init.normal_(weight, std=init_method_std)

    def forward(self, hidden):
        gate, up = F.linear(hidden, self.weight1).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, self.weight2)
        if self.gate_weight is not None:
            out = torch.sigmoid(F.linear(hidden, self.gate_weight)) * out
        return out


class MoELayer(torch.nn.Module):
    def __init__(self, config, hidden_size, init_method_std=0.02, output_init_std=None):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config, hidden_size, init_method_std)
        self.experts = SwiGLUExperts(config.num_moe_experts, hidden_size,
                                     config.moe_ffn_hidden_size, config.moe_grouped_gemm,
                                     init_method_std, output_init_std)
        self.dispatcher = LocalDispatcher(config.num_moe_experts,
                                          config.moe_expert_capacity_factor,
                                          config.moe_token_drop_policy,
                                          config.moe_pad_expert_input_to_capacity)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                hidden_size, config.moe_shared_expert_intermediate_size,
                config.moe_shared_expert_gate, init_method_std)

    def forward(self, hidden):
        """hidden [s, b, h] -> (output [s, b, h], aux): aux holds the scaled "aux_loss" and
        "z_loss" where enabled (for the caller to add to the loss), "tokens_per_expert" (rows
        each expert received, padding included) and "num_dropped"."""
        seq_len, batch, hidden_size = hidden.shape
        tokens = hidden.reshape(seq_len * batch, hidden_size)
        probs, indices, aux = self.router(tokens, num_sequences=batch)
        expert_input, tokens_per_expert, state = self.dispatcher.permute(tokens, indices, probs)
        expert_output = self.experts(expert_input, tokens_per_expert)
        output = self.dispatcher.unpermute(expert_output, state)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        aux["tokens_per_expert"] = tokens_per_expert.detach()
        aux["num_dropped"] = state.num_dropped
        return output.reshape(seq_len, batch, hidden_size), aux
