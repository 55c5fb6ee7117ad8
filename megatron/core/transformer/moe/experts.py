"""The routed experts: E SwiGLU FFNs with weights stacked as [E, ...] tensors.

weight1 [E, 2f, h] holds each expert's [gate; up] rows and weight2 [E, h, f] its down
projection, the layout of HF's gate_up_proj / down_proj, so expert e computes
F.linear(silu(gate) * up, weight2[e]) with [gate | up] = F.linear(x, weight1[e]).

The input is grouped: rows of expert 0, then expert 1, ... (tokens_per_expert of each). With
moe_grouped_gemm the two projections are torch._grouped_mm calls where that applies (torch
has it, fp32/bf16, every row stride a multiple of 16 bytes); otherwise the fallback loops over
the experts on contiguous slices (one F.linear pair per expert, not per token), which needs
the counts on the host.
"""
import torch
import torch.nn.functional as F


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


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUExperts(torch.nn.Module):
    def __init__(self, num_experts, hidden_size, ffn_hidden_size, grouped_gemm=False,
                 init_method_std=0.02, output_init_std=None):
        super().__init__()
        self.num_experts = num_experts
        self.grouped_gemm = grouped_gemm
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.weight2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        torch.nn.init.normal_(self.weight1, std=init_method_std)
        torch.nn.init.normal_(self.weight2, std=output_init_std or init_method_std)

    def forward(self, expert_input, tokens_per_expert):
        """expert_input [N, h] grouped by expert, tokens_per_expert [E] -> [N, h]."""
        if self.grouped_gemm and grouped_mm_applies(expert_input, self.weight1, self.weight2):
            return self._forward_grouped(expert_input, tokens_per_expert)
        return self._forward_loop(expert_input, tokens_per_expert)

    def _forward_grouped(self, x, tokens_per_expert):
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        fc1 = torch._grouped_mm(x.contiguous(), self.weight1.transpose(1, 2), offs=offsets)
        act = _swiglu(fc1).contiguous()
        out = torch._grouped_mm(act, self.weight2.transpose(1, 2), offs=offsets)
        return _ContiguousGrad.apply(out)

    def _forward_loop(self, x, tokens_per_expert):
        outputs = []
        for expert, rows in enumerate(torch.split(x, tokens_per_expert.tolist())):
            fc1 = F.linear(rows, self.weight1[expert])
            outputs.append(F.linear(_swiglu(fc1), self.weight2[expert]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[1])
