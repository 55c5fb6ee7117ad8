"""GPT, LLaMA, Qwen2/2.5 (q/k/v biases, tied and untied) and Qwen3 (per-head q/k RMSNorms,
head dim 32 with hidden 64 and 4 heads, tied embeddings) equal Hugging Face transformers
(weights copied through hf_conversion), at TP 1, 2 and 4, with and without sequence
parallelism: logits, per-token loss, and gradients (gathered over TP and mapped back to HF
names).

Tolerance 1e-5 (fp32): HF's eager attention and our SDPA, and the TP reductions, sum in
different orders; observed differences are ~1e-6.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel
from megatron.core.models.hf_conversion import config_from_hf, hf_to_megatron, megatron_to_hf
from megatron.core.models.tp_sharding import merge_state_dicts, shard_state_dict
from megatron.core.tensor_parallel import vocab_size_with_padding
from tests.distributed import run_distributed

TOL = 1e-5
VOCAB, BATCH, SEQ = 100, 2, 16

HF_CONFIGS = {
    "llama_mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "llama_gqa2": dict(num_attention_heads=4, num_key_value_heads=2),
    "llama_gqa4": dict(num_attention_heads=8, num_key_value_heads=4),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}),
    "gpt2": {},
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True),
    "mistral_window": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5),
    "qwen2_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_untied": dict(num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False),
    # YaRN (tests/unit/test_rope_yarn.py): trained at 8 positions, 16 run, 64 = 8 x 8 claimed.
    # gpt-oss's unrounded range; betas that put the ramp's ends inside the 8 frequencies.
    "llama_yarn": dict(num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                        "factor": 8.0, "original_max_position_embeddings": 8,
                                        "beta_fast": 4.0, "beta_slow": 0.25,
                                        "truncate": False}),
    # Rounded range, DeepSeek's mscale ratio.
    "qwen2_yarn": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 100.0,
                                        "factor": 8.0, "original_max_position_embeddings": 8,
                                        "mscale": 1.0, "mscale_all_dim": 0.5}),
}


def build_hf_model(name):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)
    elif name == "mistral_window":  # a window (5 keys) much shorter than the sequence (16)
        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attn_implementation="eager", **HF_CONFIGS[name])
        model = transformers.MistralForCausalLM(config)
    elif name.startswith("qwen2"):  # Qwen2 / Qwen2.5: biases on Q, K and V only
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
            **HF_CONFIGS[name])
        model = transformers.Qwen2ForCausalLM(config)
    elif name == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
            **HF_CONFIGS[name])
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attn_implementation="eager", **HF_CONFIGS[name])
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is checked too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _gather_tp(t, dim):
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _full_grads(model, gated):
    """Gradients of all TP shards merged into full tensors (sequence-parallel ones summed)."""
    size = ps.get_tensor_model_parallel_world_size()
    local = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if getattr(p, "sequence_parallel", False) and size > 1:
            dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        local[name] = grad
    shards = [None] * size
    dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
    return merge_state_dicts(shards, gated)


def _compare(name, sequence_parallel):
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    hf = build_hf_model(name)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    weights = torch.rand(BATCH, SEQ, generator=g)
    hf_logits = hf(tokens).logits
    hf_loss = F.cross_entropy(hf_logits.reshape(-1, VOCAB), labels.reshape(-1),
                              reduction="none").view(BATCH, SEQ)
    (hf_loss * weights).sum().backward()

    config, kwargs = config_from_hf(hf.config, sequence_parallel=sequence_parallel,
                                    tensor_model_parallel_size=tp)
    gated = config.activation == "swiglu"
    padded = vocab_size_with_padding(VOCAB, 8, tp)
    model = GPTModel(config, padded_vocab_size=padded, **kwargs)
    full = hf_to_megatron(hf.state_dict(), hf.config, padded)
    model.load_state_dict(shard_state_dict(full, tp, rank, gated), strict=True)

    logits = _gather_tp(model(tokens), dim=-1)
    loss = model(tokens, labels=labels)
    (loss * weights).sum().backward()
    grads = megatron_to_hf(_full_grads(model, gated), hf.config)
    errors = {"logits": (logits[..., :VOCAB] - hf_logits).abs().max().item(),
              "padded_logits_present": logits.shape[-1] == padded,
              "loss": (loss - hf_loss).abs().max().item()}
    for hf_name, p in hf.named_parameters():
        errors[f"grad {hf_name}"] = (grads[hf_name] - p.grad).abs().max().item()
    return errors


def _check(results):
    for rank, errors in enumerate(results):
        assert errors.pop("padded_logits_present")
        for what, err in errors.items():
            assert err <= TOL, f"rank {rank}: {what} differs from HF by {err:.3g}"


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa2", "llama3_rope", "gpt2", "qwen3",
                                  "qwen2_tied", "qwen2_untied", "mistral_window"])
def test_tp1_equals_hf(name):
    _check(run_distributed(_compare, world_size=1, tp=1, name=name, sequence_parallel=False))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp,name", [(2, "llama_gqa2"), (2, "llama3_rope"), (2, "gpt2"),
                                     (2, "qwen3"), (2, "qwen2_tied"), (2, "qwen2_untied"),
                                     (2, "mistral_window"),
                                     (4, "llama_mha"), (4, "llama_gqa4"),
                                     (4, "gpt2")])
def test_tensor_parallel_equals_hf(tp, name, sequence_parallel):
    _check(run_distributed(_compare, world_size=tp, tp=tp, name=name,
                           sequence_parallel=sequence_parallel))


def test_llama3_rope_scaling_matters():
    """The scaled config really differs from the unscaled one (the test above can fail)."""
    scaled, plain = build_hf_model("llama3_rope"), build_hf_model("llama_gqa2")
    tokens = torch.arange(SEQ).unsqueeze(0) % VOCAB
    plain.load_state_dict(scaled.state_dict())
    assert (scaled(tokens).logits - plain(tokens).logits).abs().max() > 1e-3


def test_mistral_window_matters():
    """A 5-key window at 16 tokens changes HF's logits (the test above can fail)."""
    import transformers

    windowed = build_hf_model("mistral_window")
    config = transformers.MistralConfig(**{**windowed.config.to_dict(), "sliding_window": None})
    plain = transformers.MistralForCausalLM(config).eval()
    plain.load_state_dict(windowed.state_dict())
    tokens = torch.arange(SEQ).unsqueeze(0) % VOCAB
    assert (windowed(tokens).logits - plain(tokens).logits).abs().max() > 1e-3


def test_hf_round_trip_is_exact():
    for name in ("llama_gqa2", "gpt2", "qwen3", "qwen2_tied"):
        hf = build_hf_model(name)
        back = megatron_to_hf(hf_to_megatron(hf.state_dict(), hf.config, 128), hf.config)
        for key, value in hf.state_dict().items():
            if key in back:
                assert torch.equal(back[key], value), key
        assert {k for k, _ in hf.named_parameters()} <= set(back)
