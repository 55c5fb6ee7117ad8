"""Rotary position embedding (rotate-half layout, as Megatron and HF LLaMA use), with optional
LLaMA-3 frequency scaling."""
import math

import torch

from megatron.core import device
from megatron.core.compiled import compiled


def rotary_inv_freq(dim: int, base: float, scaling_factor=None, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_positions=8192) -> torch.Tensor:
    """Inverse frequencies base^(-2i/dim), i < dim/2, in fp32.

    LLaMA-3 scaling keeps high frequencies (wavelength below original_max/high_freq_factor),
    divides low ones (wavelength above original_max/low_freq_factor) by the factor, and
    interpolates smoothly in between.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling_factor is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_max_positions / low_freq_factor
    high_freq_wavelength = original_max_positions / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_positions / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary_dim = int(config.kv_channels * config.rotary_percent)
        inv_freq = rotary_inv_freq(
            self.rotary_dim, config.rotary_base, config.rope_scaling_factor,
            config.rope_low_freq_factor, config.rope_high_freq_factor,
            config.rope_original_max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device.current_device()), persistent=False)

    def forward(self, position_ids: torch.Tensor):
        """cos, sin of shape [b or 1, s, 1, rotary_dim] (fp32) for [b or 1, s] positions."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, d]; rotates the first rotary_dim channels, passes the rest through."""
    rot_dim = cos.shape[-1]
    # One cast (none in fp32); the rotation is done in fp32. No slice when all channels rotate:
    # a slice's backward zero-fills a full-size gradient and copies into it.
    x_rot = (x if rot_dim == x.shape[-1] else x[..., :rot_dim]).float()
    x_rot = (x_rot * cos + _rotate_half(x_rot) * sin).to(x.dtype)
    return torch.cat((x_rot, x[..., rot_dim:]), dim=-1) if rot_dim < x.shape[-1] else x_rot


def rotary_function(config):
    """apply_rotary, torch.compile'd under --torch-compile (the casts, rotation and products
    become one kernel; shared by all layers)."""
    if config.torch_compile:
        return compiled(apply_rotary)
    return apply_rotary
