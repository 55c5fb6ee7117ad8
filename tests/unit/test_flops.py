"""FLOP counts against hand expansions and Megatron-LM's closed form (dense, causal,
windowed, MoE, multi-latent attention), and the MFU arithmetic."""
import pytest

from megatron.training.logging.flops import mfu, num_floating_point_operations

LLAMA2_7B = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                 num_attention_heads=32, num_query_groups=32, seq_length=4096,
                 vocab_size=32000, batch_size=1, swiglu=True)


def test_flops_llama2_7b_hand_expansion():
    h, f, s, V, L = 4096, 11008, 4096, 32000, 32
    qkv = h * 3 * h                 # 50,331,648 MACs per token (MHA: K, V as big as Q)
    scores = attend = s * h         # 16,777,216 each: full s x s, no causal halving
    out_proj = h * h                # 16,777,216
    mlp = 3 * h * f                 # 135,266,304: gate, up, down
    per_layer = qkv + scores + attend + out_proj + mlp
    assert per_layer == 235_929_600
    macs_per_token = L * per_layer + h * V     # 7,549,747,200 + 131,072,000
    expected = 3 * 2 * s * macs_per_token
    assert expected == 188_763_812_659_200     # 1.888e14 FLOPs per 4096-token sequence
    assert num_floating_point_operations(**LLAMA2_7B) == expected


def test_flops_vs_six_n_t():
    """6*N*T (N = matmul weights, output layer included) misses only the s^2 terms."""
    h, f, s, V, L = 4096, 11008, 4096, 32000, 32
    n_params = L * (4 * h * h + 3 * h * f) + h * V
    assert n_params == 6_607_077_376
    six_n_t = 6 * n_params * s                 # 1.6238e14
    assert six_n_t == 162_375_533_592_576
    attention_scores = 3 * 2 * s * L * 2 * s * h   # 12*s^2*L*h = 2.6388e13 (~16 %)
    assert attention_scores == 26_388_279_066_624
    assert num_floating_point_operations(**LLAMA2_7B) == six_n_t + attention_scores


def test_causal_flops_count_the_lower_triangle():
    """Causal: query i meets i + 1 keys, so scores and values cover s (s + 1) / 2 pairs per
    head, not s * s; everything else is unchanged. Counted here pair by pair."""
    L, h, f, a, g, s, V, B = 2, 64, 176, 4, 2, 8, 256, 3
    d = h // a
    full = num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True)
    causal = num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True, causal=True)
    pairs_full = s * s
    pairs_causal = sum(i + 1 for i in range(s))  # 36 of 64
    # per pair, layer, head: one MAC of d for the score and d for the value, fwd + 2 bwd.
    per_pair = 3 * 2 * 2 * d * a * L * B
    assert full - causal == (pairs_full - pairs_causal) * per_pair


def test_windowed_layers_count_only_their_window():
    """A layer with window W charges each query min(i + 1, W + 1) keys (causal) or W + 1
    (Megatron's convention); full layers are unchanged. Counted pair by pair."""
    L, h, f, a, g, s, V, B = 2, 64, 176, 4, 2, 8, 256, 3
    d = h // a
    per_pair = 3 * 2 * 2 * d * a * B  # one layer
    for causal in (False, True):
        full = num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True,
                                             causal=causal)
        windowed = num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True,
                                                 causal=causal, windows=[2, None])
        pairs_full = sum(i + 1 for i in range(s)) if causal else s * s
        pairs_window = sum(min(i + 1, 3) for i in range(s)) if causal else s * 3
        assert full - windowed == (pairs_full - pairs_window) * per_pair
        # A window past the sequence is full attention.
        assert num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True,
                                             causal=causal, windows=[s, s]) == full
    with pytest.raises(ValueError, match="windows has 1 entries for 2 layers"):
        num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu=True, windows=[2])


def _megatron_closed_form(L, h, f, a, g, s, V, B, swiglu, d):
    """Megatron-LM's expression (dense, no MoE), transcribed as floats."""
    q_ratio = d * a / h
    gated = 1.5 if swiglu else 1.0
    return 12 * B * s * L * h * h * ((1 + g / a + s / h) * q_ratio + f / h * gated
                                     + V / (2 * L * h))


@pytest.mark.parametrize("cfg", [
    (32, 4096, 11008, 32, 32, 4096, 32000, 1, True, 128),   # LLaMA-2 7B
    (80, 8192, 28672, 64, 8, 4096, 32000, 2, True, 128),    # LLaMA-2 70B (GQA, 8 groups)
    (12, 768, 3072, 12, 12, 1024, 50304, 8, False, 64),     # GPT-2 small, GeLU MLP
    (4, 256, 512, 8, 2, 128, 1000, 3, True, 48),            # kv_channels != h / a
])
def test_flops_match_megatron_closed_form(cfg):
    L, h, f, a, g, s, V, B, swiglu, d = cfg
    ours = num_floating_point_operations(L, h, f, a, g, s, V, B, swiglu, kv_channels=d)
    assert ours == pytest.approx(_megatron_closed_form(*cfg), rel=1e-12)


def test_flops_rejects_bad_shapes():
    with pytest.raises(ValueError, match="kv_channels"):
        num_floating_point_operations(2, 100, 400, 3, 3, 8, 10, 1, False)
    with pytest.raises(ValueError, match="num_query_groups"):
        num_floating_point_operations(2, 96, 400, 6, 4, 8, 10, 1, False)


def test_mfu_arithmetic():
    # 1e15 FLOPs over 4 devices in 2 s = 125 TFLOP/s each; half of a 250 TFLOP/s peak.
    assert mfu(1e15, 2.0, 4, 250.0) == pytest.approx(0.5, rel=1e-15)
    with pytest.raises(ValueError):
        mfu(1e15, 0.0, 4, 250.0)


def test_moe_flops_count_k_experts_and_the_shared_one():
    """pretrain's MFU numerator for an MoE model: per layer the FFN of k routed experts plus
    the shared expert (MoE layers) or the dense FFN, averaged over the layers."""
    from megatron.core.transformer.moe import MoEConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.planner.moe_cost import effective_ffn_hidden_size

    moe = MoEConfig(num_moe_experts=8, moe_ffn_hidden_size=16, moe_router_topk=2,
                    moe_shared_expert_intermediate_size=24, moe_layer_freq=[1, 0])
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               ffn_hidden_size=48, activation="swiglu", add_bias_linear=False,
                               moe=moe)
    assert effective_ffn_hidden_size(config) == (2 * 16 + 24 + 48) // 2
    got = num_floating_point_operations(2, 32, effective_ffn_hidden_size(config), 4, 4, 8, 64,
                                        1, swiglu=True)
    attention = 2 * (32 * 96 + 8 * 32 + 8 * 32 + 32 * 32)
    ffn = 3 * 32 * (2 * 16 + 24) + 3 * 32 * 48
    assert got == 3 * 2 * 8 * (attention + ffn + 32 * 64)


def test_multi_latent_attention_flops_count_its_projections_and_head_dims():
    """DeepSeek-V3's attention sizes (q_lora_rank 1536, kv_lora_rank 512, d_qk = 128 + 64,
    d_v = 128): every projection by hand, scores over d_qk and values over d_v channels a
    head; the causal count takes the masked pairs off at a (d_qk + d_v) MACs each; without
    the query latent the queries come straight from the hidden states."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.logging.flops import LatentAttention, latent_attention_of

    L, h, f, a, s, V, B = 2, 7168, 18432, 128, 4096, 129280, 1
    mla = LatentAttention(1536, 512, 128, 64, 128)
    keys_values = h * (512 + 64) + 512 * a * (128 + 128)
    rest = keys_values + s * a * 192 + s * a * 128 + a * 128 * h + 3 * h * f
    want = 3 * 2 * B * s * (L * (h * 1536 + 1536 * a * 192 + rest) + h * V)
    assert num_floating_point_operations(L, h, f, a, a, s, V, B, True, kv_channels=192,
                                         latent_attention=mla) == want
    masked = s * s - s * (s + 1) // 2
    assert num_floating_point_operations(L, h, f, a, a, s, V, B, True, kv_channels=192,
                                         causal=True, latent_attention=mla) == \
        want - 3 * 2 * B * L * masked * a * (192 + 128)
    no_latent = 3 * 2 * B * s * (L * (h * a * 192 + rest) + h * V)
    assert num_floating_point_operations(L, h, f, a, a, s, V, B, True, kv_channels=192,
                                         latent_attention=mla._replace(q_lora_rank=None)) == \
        no_latent
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               position_embedding_type="rope", multi_latent_attention=True,
                               q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                               qk_pos_emb_head_dim=4, v_head_dim=6)
    assert latent_attention_of(config) == LatentAttention(16, 8, 8, 4, 6)
    assert latent_attention_of(TransformerConfig()) is None
