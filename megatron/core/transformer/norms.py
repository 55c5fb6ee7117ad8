"""LayerNorm and RMSNorm over the last dimension, statistics in fp32."""
import torch
import torch.nn.functional as F

from megatron.core import device


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype,
                                                    device=device.current_device()))

    def forward(self, x):
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return normed * self.weight


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=torch.float32):
        super().__init__()
        self.eps = eps
        dev = device.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=dev))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=dev))

    def forward(self, x):
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


def build_norm(config, hidden_size=None):
    """The config's norm; under sequence parallelism its parameters see only a sequence shard,
    so they are marked for the TP all-reduce of their gradients."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    norm = cls(hidden_size or config.hidden_size, config.layernorm_epsilon, config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm
