"""YaRN rotary scaling equals Hugging Face bit for bit: the inverse frequencies and attention
factor against transformers' own ``ROPE_INIT_FUNCTIONS["yarn"]`` (and the cos/sin its rotary
module returns), a converted LLaMA and Qwen2 against HF's logits at 16 positions past an
original context of 8, the HF config round trip, the flags, and the checkpoint's record."""
import shlex

import pytest
import torch

from megatron.core.models.hf_conversion import config_from_hf
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.arguments.configs import transformer_config_from_args
from megatron.training.checkpointing.architecture import architecture_mismatch
from tests.distributed import run_distributed
from tests.hf_checkpoints import converter
from tests.unit.test_models_vs_hf import SEQ, VOCAB, _check, _compare, build_hf_model

converter()  # tools/checkpoint on sys.path
import megatron_args  # noqa: E402

YARN_FIELDS = ("rope_type", "rotary_base", "rotary_scaling_factor",
               "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim", "yarn_truncate", "yarn_attention_factor")

# name -> (head_dim, rope_parameters); max_position_embeddings is factor x original.
CASES = {
    "gpt_oss": (64, {"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                     "truncate": False}),
    "qwen3_long_context": (128, {"rope_theta": 1000000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32768}),
    # The mscale ratio: the factor cancels to 1.0 with both at 1.0.
    "deepseek_v3": (64, {"rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 4096}),
    "mscale_ratio": (64, {"rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}),
    # HF takes the ratio only when both are set: mscale_all_dim alone changes nothing.
    "mscale_all_dim_alone": (64, {"rope_theta": 10000.0, "factor": 40.0,
                                  "mscale_all_dim": 0.707,
                                  "original_max_position_embeddings": 4096}),
    "explicit_attention_factor": (16, {"rope_theta": 10000.0, "factor": 8.0,
                                       "attention_factor": 1.5, "truncate": False,
                                       "original_max_position_embeddings": 8}),
    # A one-dim correction range (HF widens it by 0.001).
    "single_dim_range": (16, {"rope_theta": 10000.0, "factor": 8.0, "beta_fast": 1.01,
                              "beta_slow": 1.0, "original_max_position_embeddings": 8}),
}


def _hf_config(head_dim, params):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=int(params["factor"] * params["original_max_position_embeddings"]),
        rope_parameters={"rope_type": "yarn", **params})


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_attention_factor_and_cos_sin_equal_hf(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = _hf_config(*CASES[name])
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    rotary = RotaryEmbedding(config_from_hf(hf_config)[0])
    assert torch.equal(rotary.inv_freq, hf_inv_freq)
    assert rotary.attention_factor == hf_factor
    original = hf_config.rope_parameters["original_max_position_embeddings"]
    positions = torch.arange(0, 3 * original, 7).unsqueeze(0)  # past the original context
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32),
                                                     positions)
    cos, sin = rotary(positions)
    assert torch.equal(cos.squeeze(-2), hf_cos) and torch.equal(sin.squeeze(-2), hf_sin)


def test_gpt_oss_fields_by_name_and_the_factors_that_matter():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    gpt_oss = TransformerConfig(
        num_attention_heads=64, hidden_size=2880, kv_channels=64, num_query_groups=8,
        position_embedding_type="rope", rotary_base=150000.0, rope_type="yarn",
        rotary_scaling_factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
        beta_slow=1.0, yarn_truncate=False)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(*CASES["gpt_oss"]))
    rotary = RotaryEmbedding(gpt_oss)
    assert torch.equal(rotary.inv_freq, hf_inv_freq) and rotary.attention_factor == hf_factor
    rounded = RotaryEmbedding(TransformerConfig(**{**vars(gpt_oss), "yarn_truncate": True}))
    assert not torch.equal(rounded.inv_freq, rotary.inv_freq)  # truncate is not a no-op
    deepseek = config_from_hf(_hf_config(*CASES["deepseek_v3"]))[0]
    assert RotaryEmbedding(deepseek).attention_factor == 1.0


def test_plain_rope_is_unchanged():
    """The default path multiplies by nothing: cos/sin are exactly cos/sin of the angles."""
    rotary = RotaryEmbedding(TransformerConfig(position_embedding_type="rope"))
    assert rotary.attention_factor is None
    positions = torch.arange(10).unsqueeze(0)
    angles = positions.float().unsqueeze(-1) * rotary.inv_freq
    cos, _ = rotary(positions)
    assert torch.equal(cos, torch.cat((angles, angles), -1).unsqueeze(-2).cos())


@pytest.mark.parametrize("name", ["llama_yarn", "qwen2_yarn"])
def test_converted_model_equals_hf(name):
    """Logits, per-token loss and gradients within 1e-5 (the TOL of test_models_vs_hf)."""
    _check(run_distributed(_compare, world_size=1, tp=1, name=name, sequence_parallel=False))


def test_converted_model_equals_hf_tensor_parallel():
    _check(run_distributed(_compare, world_size=2, tp=2, name="llama_yarn",
                           sequence_parallel=True))


def test_yarn_matters():
    """The YaRN model's logits differ from plain RoPE's (the comparison above can fail)."""
    import transformers

    yarn = build_hf_model("llama_yarn")
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**yarn.config.to_dict(), "rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 10000.0}})).eval()
    plain.load_state_dict(yarn.state_dict())
    tokens = torch.arange(SEQ).unsqueeze(0) % VOCAB
    assert (yarn(tokens).logits - plain(tokens).logits).abs().max() > 1e-3


def _round_trip(hf_config):
    """HF config -> a checkpoint's args -> HF config, and the printed flags -> our config."""
    args = megatron_args.args_from_hf(hf_config, None)
    back = megatron_args.hf_config_from_args(args, VOCAB, torch.float32, {})
    layout = megatron_args.layout_args(args, 1, 1, None, None, 128)
    flags = shlex.split(" ".join(megatron_args.architecture_flags(layout)))
    parsed = parse_args(flags + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                                 "--mock-data", "--vocab-size", str(VOCAB)])
    return back, transformer_config_from_args(parsed)


@pytest.mark.parametrize("name", list(CASES))
def test_hf_config_round_trip_keeps_every_yarn_parameter(name):
    hf_config = _hf_config(*CASES[name])
    ours = config_from_hf(hf_config)[0]
    back, from_flags = _round_trip(hf_config)
    assert back.rope_parameters["rope_type"] == "yarn"
    for field in YARN_FIELDS:
        assert getattr(config_from_hf(back)[0], field) == getattr(ours, field), field
        assert getattr(from_flags, field) == getattr(ours, field), field
    # HF's own parameters come back as HF wrote them (those it left unset as its defaults).
    for key, value in hf_config.rope_parameters.items():
        assert back.rope_parameters[key] == value, key


FAMILIES = {
    "Qwen2Config": {},
    "Qwen3Config": dict(head_dim=32),
    "MistralConfig": dict(sliding_window=5),
    "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           decoder_sparse_step=1),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_exports_yarn(family):
    """Each family keeps its class and its YaRN on the way back."""
    import transformers

    yarn = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0,
            "original_max_position_embeddings": 8, "truncate": False}
    hf_config = getattr(transformers, family)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters=yarn, **FAMILIES[family])
    back, from_flags = _round_trip(hf_config)
    assert type(back) is type(hf_config)
    assert {k: back.rope_parameters[k] for k in yarn} == yarn
    assert from_flags.rope_type == "yarn" and from_flags.yarn_truncate is False


def test_verify_names_a_yarn_difference():
    """tools/checkpoint/verify.py reports a checkpoint whose YaRN differs from the HF config."""
    import types

    import verify

    hf_config = _hf_config(*CASES["gpt_oss"])
    ours, kwargs = config_from_hf(hf_config)
    configs = types.SimpleNamespace(transformer=ours, model_kwargs=kwargs)
    assert verify.config_differences(hf_config, configs, kwargs["vocab_size"]) == []
    configs.transformer = TransformerConfig(**{**vars(ours), "yarn_truncate": True})
    assert verify.config_differences(hf_config, configs, kwargs["vocab_size"]) == [
        "yarn_truncate: checkpoint True, HF False"]


def test_unsupported_rope_type_is_named():
    import transformers

    config = transformers.LlamaConfig(rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
        config_from_hf(config)


SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data --vocab-size 100 "
         "--position-embedding-type rope").split()
GPT_OSS_FLAGS = ("--rope-type yarn --rotary-base 150000 --rotary-scaling-factor 32 "
                 "--original-max-position-embeddings 4096 --beta-fast 32 --beta-slow 1 "
                 "--no-yarn-correction-range-round-to-int").split()


def test_flags_build_the_config():
    config = transformer_config_from_args(parse_args(SMALL + GPT_OSS_FLAGS))
    assert (config.rope_type, config.rotary_scaling_factor, config.rotary_base,
            config.original_max_position_embeddings, config.beta_fast, config.beta_slow,
            config.mscale, config.mscale_all_dim, config.yarn_truncate,
            config.yarn_attention_factor) == ("yarn", 32.0, 150000.0, 4096, 32.0, 1.0, 1.0, 0.0,
                                              False, None)
    assert transformer_config_from_args(parse_args(SMALL)).rope_type == "rope"


@pytest.mark.parametrize("extra,message", [
    (["--rotary-scaling-factor", "4"],
     "--rotary-scaling-factor has no effect without --rope-type yarn: add --rope-type yarn or "
     "drop --rotary-scaling-factor."),
    (["--no-yarn-correction-range-round-to-int"],
     "--no-yarn-correction-range-round-to-int has no effect without --rope-type yarn"),
    (["--rope-type", "yarn", "--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor must be >= 1, got 0.5 (YaRN's context extension; 1 = none)."),
    (["--rope-type", "yarn", "--beta-slow", "0"], "--beta-slow must be > 0, got 0.0"),
    (["--rope-type", "yarn", "--use-rope-scaling"],
     "--use-rope-scaling (LLaMA-3.1) and --rope-type yarn both rescale the rotary "
     "frequencies; give one."),
])
def test_bad_flags_are_refused(extra, message):
    with pytest.raises(ConfigError) as info:
        parse_args(SMALL + extra)
    assert message in str(info.value)


def test_config_refuses_yarn_with_llama3_scaling_and_unknown_types():
    with pytest.raises(ValueError, match="use one of them"):
        TransformerConfig(position_embedding_type="rope", rope_type="yarn",
                          rope_scaling_factor=8.0)
    with pytest.raises(ValueError, match=r"rope_type 'ntk' not in \('rope', 'yarn'\)"):
        TransformerConfig(position_embedding_type="rope", rope_type="ntk")


def test_checkpoint_with_yarn_refuses_a_run_without_it():
    yarn = vars(parse_args(SMALL + GPT_OSS_FLAGS))
    plain = vars(parse_args(SMALL + ["--rotary-base", "150000"]))
    assert "was trained with --rope-type yarn, this run has --rope-type rope" in \
        architecture_mismatch(yarn, plain, "c")
    rounded = vars(parse_args(SMALL + GPT_OSS_FLAGS[:-1]))
    assert "was trained with --no-yarn-correction-range-round-to-int, this run has " \
        "--yarn-correction-range-round-to-int" in architecture_mismatch(yarn, rounded, "c")
    assert architecture_mismatch(yarn, yarn, "c") is None
