"""Sliding-window (local) causal attention: query i attends to keys i - W .. i, W + 1 of them
(Megatron's and flash attention's ``--window-size W,0``; Hugging Face's ``sliding_window`` S
is W = S - 1: its mask keeps keys j with i - j < S).

Which layers: all, or with ``window_attn_skip_freq`` N every N-th layer (1-based: layers N, 2N,
...) keeps full causal attention (gpt-oss alternates: N = 2; Gemma 3: N = 6).

Kernels: on CUDA in half precision, torch's variable-length flash attention with its
``window_size`` (each sequence of the micro batch one "document", or the packed documents
themselves); elsewhere query blocks of ``block`` rows against only the keys their window can
reach, one SDPA call per block with a [block, block + W] mask: memory O(s (block + W)), never
s x s.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F


def layer_window(config, layer_number: int) -> Optional[int]:
    """W for transformer layer ``layer_number`` (1-based), or None for full causal attention."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    freq = getattr(config, "window_attn_skip_freq", None)
    if freq and layer_number % freq == 0:
        return None
    return window[0]


def layer_windows(config, with_mtp: bool = False) -> List[Optional[int]]:
    """Every layer's window (None: full), for the FLOP count; ``with_mtp``: the
    multi-token-prediction layers' too (numbered after the model's)."""
    extra = (getattr(config, "mtp_num_layers", None) or 0) if with_mtp else 0
    return [layer_window(config, n) for n in range(1, config.num_layers + extra + 1)]


def check_window(window_size) -> None:
    """ValueError for a window this attention cannot run: right context (not causal)."""
    left, right = window_size
    if right != 0:
        raise ValueError(f"--window-size {left},{right}: only causal windows are supported "
                         f"(the right size must be 0), e.g. --window-size {left},0")
    if left < 0:
        raise ValueError(f"--window-size {left},{right}: the left size must be >= 0")


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int):
    """[q, k] boolean: True where query may attend key (causal, within ``window`` before)."""
    diff = q_positions[:, None] - k_positions[None, :]
    return (diff >= 0) & (diff <= window)


def blocked_window_attention(query, key, value, window: int, dropout: float = 0.0,
                             block: int = 256, enable_gqa: bool = False):
    """[b, heads|groups, s, d] -> [b, heads, s, d]: causal attention within ``window``, one
    SDPA per block of ``block`` queries over keys [start - window, end)."""
    s = query.shape[2]
    outputs = []
    positions = torch.arange(s, device=query.device)
    for start in range(0, s, block):
        end = min(start + block, s)
        lo = max(0, start - window)
        mask = window_mask(positions[start:end], positions[lo:end], window)
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, lo:end], value[:, :, lo:end], attn_mask=mask,
            dropout_p=dropout, enable_gqa=enable_gqa))
    return torch.cat(outputs, dim=2)
