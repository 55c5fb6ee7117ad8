"""The routed experts: E SwiGLU FFNs with weights stacked as [E, ...] tensors.

weight1 [E, 2f, h] holds each expert's [gate; up] rows and weight2 [E, h, f] its down
projection, the layout of HF's gate_up_proj / down_proj, so expert e computes
F.linear(silu(gate) * up, weight2[e]) with [gate | up] = F.linear(x, weight1[e]).

The input is grouped: rows of expert 0, then expert 1, ... (tokens_per_expert of each). With
moe_grouped_gemm the two projections are torch._grouped_mm calls where that applies (torch
has it, fp32/bf16, every row stride a multiple of 16 bytes); otherwise the fallback loops over
the experts on contiguous slices (one F.linear pair per expert, not per token), which needs
the counts on the host: the dispatcher's copy where it made one (see forward).

Expert parallelism (EP) and expert tensor parallelism (ETP): a rank holds E/EP experts (local
expert l is global expert ep_rank*E/EP + l) and, of each, the ETP rank's slice of f: weight1
[E/EP, 2f/ETP, h] = [gate rows of the slice; up rows of the slice] (the stride-2 split of
[gate; up]) and weight2 [E/EP, h, f/ETP]. With ETP > 1 the output is partial (fc2 over this
rank's f slice); the dispatcher sums it over the ETP group.

gpt-oss's experts: biases bias1 [E/EP, 2f] ([gate; up] like weight1) and bias2 [E/EP, h]
(bias=True; ETP 1 only, or fc2's bias would enter the ETP sum once per rank), and another
gated activation (activation_func, see transformer/gated_linear_unit.py).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.mlp import SwiGLUFunction


@dataclass(frozen=True)
class ExpertShard:
    """Which experts, and which slice of their f, this rank holds."""
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0

    @classmethod
    def from_parallel_state(cls):
        """This rank's shard from the expert groups (EP = ETP = 1 when they do not exist)."""
        if not parallel_state.expert_parallel_is_initialized():
            return cls()
        return cls(parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_rank(),
                   parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_rank())

    def check(self, num_experts, ffn_hidden_size):
        if num_experts % self.ep_size:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by "
                             f"expert-model-parallel-size ({self.ep_size}).")
        if ffn_hidden_size % self.etp_size:
            raise ValueError(f"moe_ffn_hidden_size ({ffn_hidden_size}) must be divisible by "
                             f"expert-tensor-parallel-size ({self.etp_size}).")

    def cut(self, weight1, weight2):
        """Full weight1 [E, 2f, h] and weight2 [E, h, f] -> this rank's [E/EP, 2f/ETP, h] and
        [E/EP, h, f/ETP] (views of the full tensors)."""
        num_experts, ffn = weight2.shape[0], weight2.shape[2]
        self.check(num_experts, ffn)
        local, part = num_experts // self.ep_size, ffn // self.etp_size
        experts = slice(self.ep_rank * local, (self.ep_rank + 1) * local)
        cols = slice(self.etp_rank * part, (self.etp_rank + 1) * part)
        gate, up = weight1[experts].chunk(2, dim=1)
        return torch.cat([gate[:, cols], up[:, cols]], dim=1), weight2[experts][:, :, cols]

    def cut_biases(self, bias1, bias2):
        """Full bias1 [E, 2f] and bias2 [E, h] -> this rank's [E/EP, 2f] and [E/EP, h]."""
        if self.etp_size > 1:
            raise ValueError("expert biases need expert-tensor-parallel-size 1 (fc2's bias "
                             "would be added by every expert-TP rank).")
        local = bias1.shape[0] // self.ep_size
        experts = slice(self.ep_rank * local, (self.ep_rank + 1) * local)
        return bias1[experts], bias2[experts]


def grouped_mm_applies(x, weight1, weight2):
    """Whether torch._grouped_mm can run this input: it exists, the dtype is one its CPU and
    CUDA kernels take, and every operand's rows are 16-byte aligned (it refuses otherwise)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16) or weight1.dtype != x.dtype:
        return False
    item = x.element_size()
    row_sizes = (weight1.shape[2], weight1.shape[1], weight2.shape[2], weight2.shape[1])
    return all(size * item % 16 == 0 for size in row_sizes)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: _grouped_mm's backward
    rejects expanded gradients (e.g. from a .sum())."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _row_experts(tokens_per_expert, num_rows):
    """The local expert of each of the grouped rows, without a host sync (the row count is
    known): which bias row each row gets."""
    experts = torch.arange(tokens_per_expert.numel(), device=tokens_per_expert.device)
    return torch.repeat_interleave(experts, tokens_per_expert, output_size=num_rows)


def _swiglu(x):
    """silu(gate) * up of x = [gate | up], with the MLP's autograd function: it keeps only x
    and writes both halves of the gradient into one buffer (no concatenation in backward),
    with autograd's own kernels, so the numbers are bitwise those of the plain expression."""
    return SwiGLUFunction.apply(x)


class SwiGLUExperts(torch.nn.Module):
    def __init__(self, num_experts, hidden_size, ffn_hidden_size, grouped_gemm=False,
                 init_method_std=0.02, output_init_std=None, shard=None, bias=False,
                 activation_func=None):
        """shard: an ExpertShard (default: from parallel_state's expert groups). The FULL
        [E, ...] weights are drawn from the current RNG and this rank keeps its shard, so the
        global weights do not depend on EP or ETP. bias: bias1 and bias2, zeros (no RNG
        draw). activation_func: of fc1's [gate | up] rows (default SwiGLU)."""
        super().__init__()
        self.shard = shard or ExpertShard.from_parallel_state()
        self.shard.check(num_experts, ffn_hidden_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.shard.ep_size
        self.grouped_gemm = grouped_gemm
        self.activation_func = activation_func or _swiglu
        # (fc1's, fc2's) fp8.linear.Fp8Gemms: both projections in FP8 (set by use_fp8)
        self.fp8 = None
        full1 = torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size)
        full2 = torch.empty(num_experts, hidden_size, ffn_hidden_size)
        torch.nn.init.normal_(full1, std=init_method_std)
        torch.nn.init.normal_(full2, std=output_init_std or init_method_std)
        local1, local2 = self.shard.cut(full1, full2)
        self.weight1 = torch.nn.Parameter(local1.clone())
        self.weight2 = torch.nn.Parameter(local2.clone())
        self.bias1 = self.bias2 = None
        if bias:
            local1, local2 = self.shard.cut_biases(torch.zeros(num_experts, 2 * ffn_hidden_size),
                                                   torch.zeros(num_experts, hidden_size))
            self.bias1 = torch.nn.Parameter(local1.clone())
            self.bias2 = torch.nn.Parameter(local2.clone())
        for param in self.parameters():
            param.expert_parallel = True  # reduced over the expert-DP group, not DP
            param.tensor_model_parallel = self.shard.etp_size > 1

    @torch.no_grad()
    def load_full(self, weight1, weight2, bias1=None, bias2=None):
        """Copy this rank's shard of full weight1 [E, 2f, h] / weight2 [E, h, f] (and, for
        experts with biases, bias1 [E, 2f] / bias2 [E, h])."""
        local1, local2 = self.shard.cut(weight1, weight2)
        self.weight1.copy_(local1)
        self.weight2.copy_(local2)
        if (bias1 is None) != (self.bias1 is None) or (bias2 is None) != (self.bias2 is None):
            raise ValueError("load_full: give bias1 and bias2 exactly when the experts have "
                             "biases.")
        if self.bias1 is not None:
            local1, local2 = self.shard.cut_biases(bias1, bias2)
            self.bias1.copy_(local1)
            self.bias2.copy_(local2)

    def forward(self, expert_input, tokens_per_expert, host_tokens_per_expert=None):
        """expert_input [N, h] grouped by local expert, tokens_per_expert [E/EP] -> [N, h]
        (partial over the ETP group when ETP > 1). host_tokens_per_expert: the same counts
        as a list, where the dispatcher already copied them (the loop then needs no copy of
        its own; the grouped GEMM reads the device counts)."""
        if self.fp8 is not None:
            return self._forward_fp8(expert_input, tokens_per_expert, host_tokens_per_expert)
        if self.grouped_gemm and grouped_mm_applies(expert_input, self.weight1, self.weight2):
            return self._forward_grouped(expert_input, tokens_per_expert)
        return self._forward_loop(expert_input, tokens_per_expert, host_tokens_per_expert)

    def _forward_grouped(self, x, tokens_per_expert):
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        rows = None if self.bias1 is None else _row_experts(tokens_per_expert, x.shape[0])
        fc1 = torch._grouped_mm(x.contiguous(), self.weight1.transpose(1, 2), offs=offsets)
        act = self.activation_func(self._add_bias(fc1, self.bias1, rows)).contiguous()
        out = torch._grouped_mm(act, self.weight2.transpose(1, 2), offs=offsets)
        return _ContiguousGrad.apply(self._add_bias(out, self.bias2, rows))

    @staticmethod
    def _add_bias(out, bias, rows):
        """out + each row's expert's bias (rows: _row_experts; None when no biases)."""
        return out if bias is None else out + bias.index_select(0, rows)

    def _forward_fp8(self, x, tokens_per_expert, host_tokens_per_expert=None):
        """Both projections' GEMMs (and their two backward GEMMs) in FP8, expert by expert
        (``fp8.experts``): each expert's weight scaled on its own, its tokens as a linear's."""
        from megatron.core.fp8.experts import fp8_expert_linear

        if host_tokens_per_expert is None:
            host_tokens_per_expert = tokens_per_expert.tolist()  # a host sync on CUDA
        fc1_gemms, fc2_gemms = self.fp8
        rows = None if self.bias1 is None else _row_experts(tokens_per_expert, x.shape[0])
        # The biases stay high precision, added after each FP8 GEMM.
        fc1 = self._add_bias(fp8_expert_linear(x, self.weight1, host_tokens_per_expert,
                                               fc1_gemms), self.bias1, rows)
        out = fp8_expert_linear(self.activation_func(fc1), self.weight2,
                                host_tokens_per_expert, fc2_gemms)
        return self._add_bias(out, self.bias2, rows)

    def _forward_loop(self, x, tokens_per_expert, host_tokens_per_expert=None):
        if host_tokens_per_expert is None:
            host_tokens_per_expert = tokens_per_expert.tolist()  # a host sync on CUDA
        outputs = []
        bias1 = [None] * self.num_local_experts if self.bias1 is None else self.bias1
        bias2 = [None] * self.num_local_experts if self.bias2 is None else self.bias2
        for expert, rows in enumerate(torch.split(x, host_tokens_per_expert)):
            fc1 = F.linear(rows, self.weight1[expert], bias1[expert])
            outputs.append(F.linear(self.activation_func(fc1), self.weight2[expert],
                                    bias2[expert]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[1])
