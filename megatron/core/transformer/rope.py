"""Rotary position embedding (rotate-half layout, as Megatron and HF LLaMA use), with optional
LLaMA-3 frequency scaling or YaRN (gpt-oss, DeepSeek-V3), both equal to Hugging Face's bit for
bit."""
import math
from typing import Optional

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


def _yarn_correction_dim(rotations: float, dim: int, base: float,
                         original_max_positions: int) -> float:
    """The (fractional) dim index whose frequency turns ``rotations`` times over the original
    context. The operation order is HF's: the non-truncated range feeds the ramp unrounded."""
    return (dim * math.log(original_max_positions / (rotations * 2 * math.pi))) / (
        2 * math.log(base))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                          explicit: Optional[float] = None) -> float:
    """The cos/sin multiplier: ``explicit`` if given; the DeepSeek ratio when both mscales are
    set (non-zero); else the plain temperature of ``factor`` (HF's rule, whatever ``mscale``)."""
    if explicit is not None:
        return explicit
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0,
                  truncate: bool = True) -> torch.Tensor:
    """YaRN's inverse frequencies, in fp32: the dims that turn more than ``beta_fast`` times over
    the original context keep their frequency (extrapolation), those under ``beta_slow`` turns
    are divided by ``factor`` (interpolation), with a linear ramp between the two dims."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated = 1.0 / powers
    interpolated = 1.0 / (factor * powers)
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_positions)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_positions)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dim range: a step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Blended as 1 - ramp and 1 - (1 - ramp), not ramp: the same roundings as HF.
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary_dim = config.qk_pos_emb_head_dim if config.multi_latent_attention else \
            int(config.kv_channels * config.rotary_percent)
        # YaRN scales cos and sin (so q.k by its square); None: no multiply at all, so the
        # plain path stays bitwise what it was.
        self.attention_factor = None
        if config.rope_type == "yarn":
            inv_freq = yarn_inv_freq(
                self.rotary_dim, config.rotary_base, config.rotary_scaling_factor,
                config.original_max_position_embeddings, config.beta_fast, config.beta_slow,
                config.yarn_truncate)
            self.attention_factor = yarn_attention_factor(
                config.rotary_scaling_factor, config.mscale, config.mscale_all_dim,
                config.yarn_attention_factor)
        else:
            inv_freq = rotary_inv_freq(
                self.rotary_dim, config.rotary_base, config.rope_scaling_factor,
                config.rope_low_freq_factor, config.rope_high_freq_factor,
                config.rope_original_max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device.current_device()), persistent=False)

    def forward(self, position_ids: torch.Tensor):
        """cos, sin of shape [b or 1, s, 1, rotary_dim] (fp32) for [b or 1, s] positions."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        if self.attention_factor is None:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, d], all d channels rotated as adjacent pairs (x0, x1), (x2, x3), ...,
    pair i by angle i (DeepSeek's layout); the result holds the pairs' first members, then
    their second members, as Hugging Face's ``apply_rotary_pos_emb_interleave`` writes it
    (attention only takes dot products of queries and keys laid out alike)."""
    half = cos.shape[-1] // 2  # cos/sin repeat their angles: the first half has each once
    cos, sin = cos[..., :half], sin[..., :half]
    dtype, x = x.dtype, x.float()  # one cast (none in fp32), the rotation in fp32
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin),
                     dim=-1).to(dtype)


def rotary_function(config):
    """apply_rotary (apply_rotary_interleaved with rotary_interleaved), torch.compile'd under
    --torch-compile (the casts, rotation and products become one kernel; shared by all
    layers)."""
    rotate = apply_rotary_interleaved if config.rotary_interleaved else apply_rotary
    if config.torch_compile:
        return compiled(rotate)
    return rotate
