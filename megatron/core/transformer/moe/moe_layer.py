"""MoELayer: router, dispatch, routed SwiGLU experts, combine, and an optional shared expert.

It takes the MLP's place in the layers ``config.moe.is_moe_layer`` picks. Inside it every rank's
tokens are its own: TP > 1 needs sequence parallelism (checked by TransformerConfig), so each
TP rank (and each CP rank) routes its part of the sequence and the dispatcher sends the rows to
the expert-parallel ranks holding their experts.

The router's aux and z losses reach the gradient through ``MoEAuxLossAutoScaler`` on the
layer's output, scaled like the main loss (1 / microbatches, times the fp16 loss scale): a
layer on any pipeline stage gets its losses' gradient in its own backward, without sending
them to the stage with the loss. Their values and the routed tokens per expert are summed per
layer in ``metrics`` (training forwards only) for the log (``training/logging/moe_metrics.py``).
"""
import torch
import torch.nn.functional as F

from megatron.core import device, parallel_state
from megatron.core.transformer.mlp import MLP, gated_activation_func
from megatron.core.transformer.moe.capacity import count_per_expert
from megatron.core.transformer.moe.ep_dispatcher import DISPATCHERS
from megatron.core.transformer.moe.experts import SwiGLUExperts
from megatron.core.transformer.moe.local_dispatcher import LocalDispatcher
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import scaled_init_std

LOSS_NAMES = ("aux_loss", "z_loss")


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on the output; its backward also gives the aux loss the gradient ``loss_scale``
    (set per microbatch by the schedule, see ``set_aux_loss_scale``)."""

    loss_scale = 1.0

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        ctx.scale = MoEAuxLossAutoScaler.loss_scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale)


def set_aux_loss_scale(scale: float) -> None:
    """The factor the main loss's gradient gets (1 / microbatches x the fp16 loss scale)."""
    MoEAuxLossAutoScaler.loss_scale = float(scale)


class SharedExpertMLP(MLP):
    """The dense SwiGLU FFN every token goes through, tensor-parallel like the MLP; with
    ``moe_shared_expert_gate``, Qwen2-MoE's sigmoid(x @ gate_weight^T) scales it per token."""

    def __init__(self, config):
        moe = config.moe
        super().__init__(config, moe.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if moe.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size))
            torch.nn.init.normal_(self.gate_weight, std=config.init_method_std)
            _place(self.gate_weight, config)

    def forward(self, hidden):
        out, bias = super().forward(hidden)
        if bias is not None:  # fc2 skips its bias add: the layer adds a dense MLP's
            out = out + bias
        if self.gate_weight is not None:
            out = torch.sigmoid(F.linear(hidden, self.gate_weight)) * out
        return out


def _place(param, config):
    """On the device in the params dtype; replicated over TP, so under SP its gradient is a
    partial sum (summed over TP like the norms')."""
    param.data = param.data.to(device.current_device(), config.params_dtype)
    param.sequence_parallel = config.sequence_parallel


def _output_init_std(config):
    if config.scaled_output_init:
        return scaled_init_std(config.init_method_std, config.num_layers)
    return config.init_method_std


def _sequence_group(config):
    """The ranks that split a micro batch's tokens and route them apart: TP under sequence
    parallelism, CP, or both (their counts and loss shares are summed over it); None alone."""
    split_tp = config.sequence_parallel and config.tensor_model_parallel_size > 1
    if config.context_parallel_size > 1:
        return parallel_state.get_tensor_and_context_parallel_group() if split_tp \
            else parallel_state.get_context_parallel_group()
    return parallel_state.get_tensor_model_parallel_group() if split_tp else None


def build_dispatcher(config):
    moe = config.moe
    if config.expert_model_parallel_size == 1 and config.expert_tensor_parallel_size == 1:
        return LocalDispatcher(moe.num_moe_experts, moe.moe_expert_capacity_factor,
                               moe.moe_token_drop_policy, moe.moe_pad_expert_input_to_capacity)
    return DISPATCHERS[moe.moe_token_dispatcher_type](
        moe.num_moe_experts, moe.moe_expert_capacity_factor, moe.moe_token_drop_policy,
        moe.moe_pad_expert_input_to_capacity)


class MoELayer(torch.nn.Module):
    def __init__(self, config, layer_number: int = 1):
        super().__init__()
        moe = config.moe
        self.config = config
        self.layer_number = layer_number
        sequence_group = _sequence_group(config)
        self.router = TopKRouter(moe, config.hidden_size, config.init_method_std, sequence_group)
        self.router.to(device.current_device())
        _place(self.router.weight, config)
        if self.router.bias is not None:
            _place(self.router.bias, config)
        self.experts = SwiGLUExperts(moe.num_moe_experts, config.hidden_size,
                                     moe.moe_ffn_hidden_size, moe.moe_grouped_gemm,
                                     config.init_method_std, _output_init_std(config),
                                     bias=config.add_bias_linear,
                                     activation_func=gated_activation_func(
                                         config.activation, config.activation_func_clamp_value,
                                         config.glu_linear_offset))
        for param in self.experts.parameters():  # keeps the shard's parallel attributes
            param.data = param.data.to(device.current_device(), config.params_dtype)
        self.dispatcher = build_dispatcher(config)
        self.shared_experts = SharedExpertMLP(config) \
            if moe.moe_shared_expert_intermediate_size is not None else None
        self.metrics = {}

    def forward_with_aux(self, hidden):
        """hidden [s, b, h] -> (output [s, b, h], aux): aux holds the scaled "aux_loss" and
        "z_loss" where enabled, "routed_per_expert" ([E], this rank's routing choices per
        expert), "tokens_per_expert" (rows each local expert received, padding included) and
        "num_dropped" (0-dim), all on the device."""
        seq_len, batch, hidden_size = hidden.shape
        tokens = hidden.reshape(seq_len * batch, hidden_size)
        probs, indices, aux = self.router(tokens, num_sequences=batch)
        expert_input, tokens_per_expert, state = self.dispatcher.permute(tokens, indices, probs)
        expert_output = self.experts(expert_input, tokens_per_expert,
                                     state.host_tokens_per_expert)
        output = self.dispatcher.unpermute(expert_output, state).to(hidden.dtype)
        output = output.reshape(seq_len, batch, hidden_size)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        aux["routed_per_expert"] = count_per_expert(indices, self.config.moe.num_moe_experts)
        aux["tokens_per_expert"] = tokens_per_expert.detach()
        aux["num_dropped"] = state.num_dropped
        return output, aux

    def forward(self, hidden):
        """(output, None), the MLP's interface; the losses ride on the output's backward."""
        output, aux = self.forward_with_aux(hidden)
        # Recomputation runs a forward twice: the one with grad enabled is the one that counts.
        if self.training and torch.is_grad_enabled():
            self._record(aux)
            losses = [aux[name] for name in LOSS_NAMES if name in aux]
            if losses:
                output = MoEAuxLossAutoScaler.apply(output, sum(losses))
        return output, None

    @torch.no_grad()
    def _record(self, aux):
        for name in LOSS_NAMES + ("routed_per_expert", "num_dropped"):
            if name in aux:
                value = aux[name].detach().float()
                self.metrics[name] = self.metrics.get(name, 0) + value
        self.metrics["forwards"] = self.metrics.get("forwards", 0) + 1

    def take_metrics(self):
        """The sums since the last call (this rank's share), and reset."""
        metrics, self.metrics = self.metrics, {}
        return metrics
