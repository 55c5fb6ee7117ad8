"""Training FLOPs per iteration and MFU, with Megatron-LM's accounting.

Megatron logs ``throughput per GPU (TFLOP/s/GPU)`` from a closed-form FLOP count
(``num_floating_point_operations`` in its ``training.py``, after Narayanan et al. 2021,
appendix "Floating-point operations"). We count the same operations so our TFLOP/s and MFU
compare one to one with Megatron runs, but write the count term by term so each line can
be checked by hand.

Formula (B batch, s sequence, L layers, h hidden, f FFN hidden, a heads, g query groups,
d = kv_channels (default h / a), V vocabulary; counts are multiply-adds (MACs) per forward):

    per layer, per token:
        QKV projection        h * (a*d + 2*g*d)          (GQA: K and V have g heads)
        attention scores      s * a*d                    (Q K^T, full s x s matrix)
        attention over V      s * a*d                    (softmax(QK^T) V)
        output projection     a*d * h
        MLP                   m * h * f                  (m = 3 with SwiGLU, else 2)
    logits, per token         h * V

    FLOPs = 3 * 2 * B * s * (L * per_layer + h * V)

Multi-latent attention (``latent_attention``: DeepSeek-V3's MLA; r_q, r_kv its latents, d_n +
d_r = d_qk a query/key head, d_v a value head) replaces the QKV, score, value and output
terms:

        queries               h * a*d_qk, or h * r_q + r_q * a*d_qk   (the query latent)
        keys and values       h * (r_kv + d_r) + r_kv * a*(d_n + d_v)
        attention scores      s * a*d_qk
        attention over V      s * a*d_v
        output projection     a*d_v * h

(the zero padding of V that some kernels run on is not counted: it is no model arithmetic).

2 FLOPs per MAC; 3x because each GEMM runs once forward and twice backward (data and
weight gradients). Element-wise work (norms, softmax, activations, RoPE) is left out, as in
Megatron.

Sliding windows (``windows``, one entry per layer: W or None): a windowed layer's query
sees at most W + 1 keys, so its score and value terms count s * min(s, W + 1) pairs per head
instead of s * s (causal: the sum over queries of min(i + 1, W + 1)).

Causal masking: the attention score terms count the full s x s matrix, not the causal
half. Megatron's classic formula does the same, and matching it is the point: logs and MFU
stay comparable with Megatron's. (Flash attention kernels skip the masked half, so on
long sequences this overstates the work done by up to ``6*B*s*L*s*a*d`` FLOPs.)
"""
from typing import NamedTuple, Optional, Sequence


class LatentAttention(NamedTuple):
    """Multi-latent attention's sizes (TransformerConfig's names)."""
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


def latent_attention_of(config) -> Optional[LatentAttention]:
    """The sizes of ``config``'s multi-latent attention, or None for SelfAttention."""
    if not getattr(config, "multi_latent_attention", False):
        return None
    return LatentAttention(config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
                           config.qk_pos_emb_head_dim, config.v_head_dim)


def attention_pair_macs(num_attention_heads: int, kv_channels: int,
                        latent_attention: Optional[LatentAttention] = None) -> int:
    """Forward multiply-adds of one query-key pair, all heads of a layer: its score and its
    share of the value sum."""
    if latent_attention is None:
        return 2 * num_attention_heads * kv_channels
    mla = latent_attention
    return num_attention_heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)


def _latent_attention_macs_per_token(hidden_size: int, num_attention_heads: int,
                                     seq_length: int, mla: LatentAttention) -> int:
    """Forward multiply-adds of one multi-latent attention for one token (docstring)."""
    h, a = hidden_size, num_attention_heads
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank is None:
        queries = h * a * qk
    else:
        queries = h * mla.q_lora_rank + mla.q_lora_rank * a * qk
    keys_values = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) + \
        mla.kv_lora_rank * a * (mla.qk_head_dim + mla.v_head_dim)
    core = seq_length * attention_pair_macs(a, qk, mla)
    return queries + keys_values + core + a * mla.v_head_dim * h


def _per_layer_macs_per_token(hidden_size: int, ffn_hidden_size: int,
                              num_attention_heads: int, num_query_groups: int,
                              seq_length: int, kv_channels: int, swiglu: bool,
                              latent_attention: Optional[LatentAttention] = None) -> int:
    """Forward multiply-adds of one transformer layer for one token."""
    mlp_matrices = 3 if swiglu else 2  # SwiGLU: gate, up and down projections
    mlp = mlp_matrices * hidden_size * ffn_hidden_size
    if latent_attention is not None:
        return mlp + _latent_attention_macs_per_token(hidden_size, num_attention_heads,
                                                      seq_length, latent_attention)
    query_size = kv_channels * num_attention_heads
    kv_size = kv_channels * num_query_groups
    qkv = hidden_size * (query_size + 2 * kv_size)
    scores = seq_length * query_size
    attend_values = seq_length * query_size
    out_proj = query_size * hidden_size
    return qkv + scores + attend_values + out_proj + mlp


def _attention_pairs(seq_length: int, window: Optional[int], causal: bool) -> int:
    """Query-key pairs of one head and sequence that the count charges (docstring)."""
    s = seq_length
    if window is None or window + 1 >= s:
        return s * (s + 1) // 2 if causal else s * s
    keys = window + 1
    if not causal:
        return s * keys
    return keys * (keys + 1) // 2 + (s - keys) * keys


def num_floating_point_operations(num_layers: int, hidden_size: int, ffn_hidden_size: int,
                                  num_attention_heads: int, num_query_groups: int,
                                  seq_length: int, vocab_size: int, batch_size: int,
                                  swiglu: bool, kv_channels: Optional[int] = None,
                                  causal: bool = False,
                                  windows: Sequence[Optional[int]] = (),
                                  latent_attention: Optional[LatentAttention] = None,
                                  mtp_num_layers: int = 0) -> int:
    """Training FLOPs (forward + backward) of one iteration over ``batch_size`` sequences.

    ``causal=True`` counts only the scores and values a causal kernel computes: query i
    attends to i + 1 keys, s (s + 1) / 2 pairs per head instead of s * s (Megatron's figure,
    the default, counts all s * s). ``windows``: each layer's sliding window (None: full
    attention); empty: every layer full. ``latent_attention``: the layers' multi-latent
    attention sizes (``latent_attention_of(config)``), which replace ``kv_channels`` and
    ``num_query_groups``.

    ``mtp_num_layers``: multi-token prediction depths, each one more layer, its [2h -> h]
    projection and the logits GEMM again (``windows`` may list their layers after the
    model's; unlisted, they attend fully).

    ``num_query_groups`` equals ``num_attention_heads`` for plain multi-head attention.
    ``vocab_size`` should be the padded vocabulary, the size of the real logits GEMM.
    Integer arithmetic, so the result is exact (Megatron's float version rounds).
    """
    if kv_channels is None:
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size {hidden_size} is not divisible by num_attention_heads "
                f"{num_attention_heads}; pass kv_channels explicitly.")
        kv_channels = hidden_size // num_attention_heads
    if num_attention_heads % num_query_groups:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                         f"num_query_groups {num_query_groups}.")
    windows = list(windows) or [None] * num_layers
    if len(windows) == num_layers:
        windows += [None] * mtp_num_layers
    if len(windows) != num_layers + mtp_num_layers:
        raise ValueError(f"windows has {len(windows)} entries for {num_layers} layers "
                         f"(+ {mtp_num_layers} multi-token prediction layers).")
    per_layer = _per_layer_macs_per_token(hidden_size, ffn_hidden_size, num_attention_heads,
                                          num_query_groups, seq_length, kv_channels, swiglu,
                                          latent_attention)
    macs_per_token = num_layers * per_layer + hidden_size * vocab_size + mtp_num_layers * (
        per_layer + 2 * hidden_size * hidden_size + hidden_size * vocab_size)
    flops_per_mac, fwd_plus_bwd = 2, 3
    macs = batch_size * seq_length * macs_per_token
    # The score and value terms above charge s * s pairs per head and layer (2 s^2 a d MACs
    # a sequence): take off what the mask and the windows leave out.
    full = seq_length * seq_length
    pair = attention_pair_macs(num_attention_heads, kv_channels, latent_attention)
    for window in windows:
        skipped = full - _attention_pairs(seq_length, window, causal)
        macs -= batch_size * skipped * pair
    return fwd_plus_bwd * flops_per_mac * macs


def mfu(flops_per_iteration: float, seconds_per_iteration: float, num_devices: int,
        peak_tflops_per_device: float) -> float:
    """Model FLOPs utilisation as a fraction (0.42 means 42 %) of the devices' peak.

    Achieved FLOP/s per device divided by the per-device peak; ``flops_per_iteration`` is
    the whole job's work per iteration, so it is shared among ``num_devices``.
    """
    if seconds_per_iteration <= 0 or num_devices <= 0 or peak_tflops_per_device <= 0:
        raise ValueError("seconds_per_iteration, num_devices and peak_tflops_per_device "
                         "must be positive.")
    achieved_per_device = flops_per_iteration / (seconds_per_iteration * num_devices)
    return achieved_per_device / (peak_tflops_per_device * 1e12)
