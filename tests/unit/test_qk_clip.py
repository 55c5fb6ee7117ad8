"""QK-clip building blocks (megatron/core/optimizer/qk_clip.py) against plain torch."""
import math

import torch

from megatron.core.optimizer.qk_clip import (clip_factors, max_attention_logits,
                                             scale_fused_qkv_)
from megatron.training.arguments import build_configs, parse_args
from tests.unit.test_arguments import error_of, small


def _reference(query, key, scale, mask):
    """The explicit [b, heads, s, s] softmax input with the mask -> [heads] max."""
    per_group = query.size(2) // key.size(2)
    k = key.repeat_interleave(per_group, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", query, k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def test_max_logits_causal_gqa_and_documents():
    torch.manual_seed(0)
    b, s, heads, groups, d = 2, 11, 6, 2, 8
    q, k = torch.randn(b, s, heads, d), torch.randn(b, s, groups, d)
    scale = 1 / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    got = max_attention_logits(q, k, scale, block=4)
    torch.testing.assert_close(got, _reference(q, k, scale, causal), rtol=0, atol=1e-6)
    # packed documents [0, 4), [4, 11) in sample 0, one document in sample 1
    doc = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    docs = (doc[:, :, None] == doc[:, None, :]) & causal
    got = max_attention_logits(q, k, scale, allowed=docs, block=3)
    torch.testing.assert_close(got, _reference(q, k, scale, docs[:, None]), rtol=0, atol=1e-6)
    # a sliding window of 3
    i = torch.arange(s)
    window = causal & (i[:, None] - i[None, :] < 3)
    got = max_attention_logits(q, k, scale, allowed=window, block=5)
    torch.testing.assert_close(got, _reference(q, k, scale, window), rtol=0, atol=1e-6)


def test_rescale_brings_max_under_threshold():
    torch.manual_seed(1)
    hidden, heads, groups, d, s = 16, 4, 2, 8, 9
    per_group = heads // groups
    weight = torch.randn((groups * (per_group + 2) * d, hidden)) * 2
    x = torch.randn(1, s, hidden)
    scale = 1 / math.sqrt(d)

    def logits(w):
        qkv = (x @ w.T).view(1, s, groups, per_group + 2, d)
        q = qkv[:, :, :, :per_group].reshape(1, s, heads, d)
        return max_attention_logits(q, qkv[:, :, :, per_group], scale)

    before = logits(weight)
    tau, alpha = float(before.min()) * 0.5, 0.5
    gamma = clip_factors(before, tau)
    expected = weight.clone().view(groups, per_group + 2, d, hidden)
    for g in range(groups):
        for p in range(per_group):
            expected[g, p] *= gamma[g * per_group + p] ** alpha
        expected[g, per_group] *= gamma[g * per_group:(g + 1) * per_group].min() ** (1 - alpha)
    scale_fused_qkv_(weight, gamma, alpha, per_group, d)
    torch.testing.assert_close(weight, expected.view_as(weight), rtol=1e-6, atol=0)
    assert bool((logits(weight) <= tau * (1 + 1e-5)).all())


def test_mla_rescale_per_part():
    from megatron.core.optimizer.qk_clip import scale_mla_
    torch.manual_seed(2)
    heads, nope, rope, v, hidden, lora = 3, 4, 2, 5, 7, 6
    q_w, kv_w = torch.randn(heads * (nope + rope), hidden), torch.randn(heads * (nope + v), lora)
    gamma, alpha = torch.tensor([1.0, 0.25, 0.5]), 0.3
    q_ref, kv_ref = q_w.clone().view(heads, nope + rope, hidden), kv_w.clone().view(heads, -1, lora)
    for h in range(heads):
        q_ref[h, :nope] *= gamma[h] ** alpha
        q_ref[h, nope:] *= gamma[h]
        kv_ref[h, :nope] *= gamma[h] ** (1 - alpha)
    scale_mla_(q_w, kv_w, gamma, alpha, nope, rope, v)
    torch.testing.assert_close(q_w, q_ref.view_as(q_w), rtol=1e-6, atol=0)
    torch.testing.assert_close(kv_w, kv_ref.view_as(kv_w), rtol=1e-6, atol=0)


def test_qk_clip_flags_reach_the_transformer_config():
    def fields(*extra):
        t = build_configs(parse_args(small(*extra)), 1).transformer
        return t.qk_clip, t.qk_clip_threshold, t.qk_clip_alpha, t.log_max_attention_logit

    assert fields() == (False, 100.0, 0.5, False)  # Megatron-LM's defaults
    assert fields("--qk-clip", "--qk-clip-threshold", "30", "--qk-clip-alpha", "0.25") == (
        True, 30.0, 0.25, False)
    assert fields("--log-max-attention-logit") == (False, 100.0, 0.5, True)
    assert fields("--optimizer", "muon", "--qk-clip")[0]  # and with Adam above
    assert "--qk-clip rescales rows of W_q and W_k, which --qk-layernorm's norms" in \
        error_of(small("--qk-clip", "--qk-layernorm"))
