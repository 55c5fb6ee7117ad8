"""tools/checkpoint/convert.py on DeepSeek-V3 (the whole run, TP 2 x EP 2, verify.py and back:
tests/e2e/test_checkpoint_convert_deepseek.py): the checkpoint's args and the printed flags
rebuild the model HF's config describes (MLA with and without the query latent, YaRN,
group-limited sigmoid routing), and back to an equal DeepseekV3Config; a checkpoint with the
multi-token prediction layer converts without it (saying so); FP8 weights are refused in one
line naming the fix."""
import json
import os
import shlex

import pytest
import torch

from megatron.core.models.hf_conversion import config_from_hf
from megatron.training.arguments import parse_args
from megatron.training.arguments.configs import transformer_config_from_args
from tests.hf_checkpoints import converter
from tests.unit.test_hf_moe_conversion import VOCAB, build_hf_model

convert = converter()
import megatron_args  # noqa: E402  (tools/checkpoint, on sys.path once convert is imported)
import megatron_moe_args  # noqa: E402
from conversion_utils import ConversionError  # noqa: E402

NAMES = ("deepseek_v3", "deepseek_v3_noq", "deepseek_v3_yarn")
TRAINING = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
            "--vocab-size", str(VOCAB)]
# Set by the parallel layout or by training, not by the model.
_LAYOUT_FIELDS = {"tensor_model_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size", "sequence_parallel", "params_dtype",
                  "gradient_accumulation_fusion", "scaled_output_init"}


def _flags(hf_config):
    """The checkpoint's args at TP 2 x EP 2 (expert TP 1) and its printed flags, parsed."""
    args = megatron_args.args_from_hf(hf_config, None)
    layout = megatron_moe_args.expert_layout_args(
        megatron_args.layout_args(args, 2, 1, None, None, 128), 2, 1)
    flags = shlex.split(" ".join(megatron_args.architecture_flags(layout)))
    return args, flags, parse_args(flags + TRAINING)


@pytest.mark.parametrize("name", NAMES)
def test_flags_build_the_model_of_the_hf_config(name):
    hf_config = build_hf_model(name).config
    args, flags, parsed = _flags(hf_config)
    assert "--group-query-attention" not in flags
    assert ("--q-lora-rank" in flags) == (name != "deepseek_v3_noq")
    ours, expected = transformer_config_from_args(parsed), config_from_hf(hf_config)[0]
    for field, value in vars(expected).items():
        if field not in _LAYOUT_FIELDS:
            assert getattr(ours, field) == value, field
    assert ours.multi_latent_attention and ours.moe.moe_router_score_function == "sigmoid"
    for key in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                "qk_pos_emb_head_dim", "v_head_dim", "rotary_interleaved", "qk_layernorm",
                "kv_channels", "moe_router_score_function", "moe_router_enable_expert_bias",
                "moe_router_num_groups", "moe_router_group_topk",
                "moe_router_topk_scaling_factor", "moe_router_topk_norm",
                "moe_shared_expert_intermediate_size", "moe_layer_freq"):
        assert args[key] == vars(parsed)[key], key  # what tools read = what training reads


@pytest.mark.parametrize("name", NAMES)
def test_args_give_back_the_hf_config(name):
    hf_config = build_hf_model(name).config
    args = megatron_args.args_from_hf(hf_config, None)
    back = megatron_args.hf_config_from_args(args, VOCAB, torch.float32, {})
    assert type(back).__name__ == "DeepseekV3Config"
    assert back.architectures == ["DeepseekV3ForCausalLM"]
    assert back.head_dim == hf_config.qk_rope_head_dim  # HF's, not our q/k head dim
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "n_routed_experts", "n_group", "topk_group",
                  "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                  "intermediate_size", "first_k_dense_replace", "routed_scaling_factor",
                  "norm_topk_prob", "rope_interleave", "num_key_value_heads", "rms_norm_eps"):
        assert getattr(back, field) == getattr(hf_config, field), field
    for key, value in hf_config.rope_parameters.items():
        assert back.rope_parameters[key] == value, key
    assert config_from_hf(back)[0] == config_from_hf(hf_config)[0]


def test_models_without_an_hf_counterpart_are_refused():
    args = megatron_args.args_from_hf(build_hf_model("deepseek_v3").config, None)
    with pytest.raises(ConversionError, match="latent norms use 1e-06"):
        megatron_args.hf_config_from_args({**args, "norm_epsilon": 1e-5}, VOCAB,
                                          torch.float32, {})
    dense = {**args, "num_experts": None}
    with pytest.raises(ConversionError, match="multi_latent_attention without experts"):
        megatron_args.hf_config_from_args(dense, VOCAB, torch.float32, {})


def _save(model, path, extra=None, stacked=False):
    """config.json and model.safetensors: as save_pretrained writes them (experts per expert),
    or the in-memory state dict (transformers 5's stacked experts), plus ``extra``."""
    from safetensors.torch import save_file

    if stacked:
        model.config.save_pretrained(path)
        state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
        save_file({**state, **(extra or {})}, os.path.join(path, "model.safetensors"))
    else:
        model.save_pretrained(path)
        if extra:
            from tests.hf_checkpoints import read_safetensors_dir

            save_file({**read_safetensors_dir(path), **extra},
                      os.path.join(path, "model.safetensors"))
    return path


def _mtp_layer(model, index):
    """DeepSeek-V3's multi-token prediction module as its checkpoints hold it: a layer past
    num_hidden_layers with the projections that feed it and a head of its own."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    prefix = f"model.layers.{index}."
    last = {k.split(".", 3)[3]: v for k, v in model.state_dict().items()
            if k.startswith(f"model.layers.{index - 1}.")}
    return {**{prefix + k: v.clone() for k, v in last.items()},
            prefix + "enorm.weight": torch.ones(hidden),
            prefix + "hnorm.weight": torch.ones(hidden),
            prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden),
            prefix + "embed_tokens.weight": torch.randn(vocab, hidden),
            prefix + "shared_head.norm.weight": torch.ones(hidden),
            prefix + "shared_head.head.weight": torch.randn(vocab, hidden)}


@pytest.mark.parametrize("stacked", [False, True])
def test_mtp_layers_are_dropped_with_a_note(tmp_path, capsys, stacked):
    from megatron.training.checkpointing.offline import find_iteration_dir, read_model

    model = build_hf_model("deepseek_v3")
    src = _save(model, str(tmp_path / "hf"), _mtp_layer(model, 3), stacked)
    assert convert.main(["hf-to-megatron", "--load", src, "--save",
                         str(tmp_path / "meg")]) == 0
    err = capsys.readouterr().err
    assert "note: dropped the" in err and "model.layers.3" in err
    assert "multi-token prediction" in err and "MTP weights are not converted" in err
    full, _, _ = read_model(find_iteration_dir(str(tmp_path / "meg"), None))
    assert not any(".layers.3." in name for name in full)
    hf = model.state_dict()
    assert torch.equal(full["decoder.layers.2.mlp.router.expert_bias"],
                       hf["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert torch.equal(full["decoder.layers.1.mlp.experts.weight1"],
                       hf["model.layers.1.mlp.experts.gate_up_proj"])


def _refused(capsys, argv):
    """The error: one line, the last on stderr (after any progress lines)."""
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert.main(argv) == 1
    lines = capsys.readouterr().err.splitlines()
    assert sum("error:" in line for line in lines) == 1, lines
    return lines[-1]


def test_fp8_weights_are_refused_in_one_line(tmp_path, capsys):
    model = build_hf_model("deepseek_v3")
    scale = {"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}
    src = _save(model, str(tmp_path / "hf"), scale)
    err = _refused(capsys, ["hf-to-megatron", "--load", src, "--save", str(tmp_path / "meg")])
    assert "FP8" in err and "weight_scale_inv" in err and "dequantize" in err and "bf16" in err
    assert not os.path.exists(tmp_path / "meg")


def test_fp8_config_is_refused_before_the_weights_are_read(tmp_path, capsys):
    src = _save(build_hf_model("deepseek_v3"), str(tmp_path / "hf"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    os.remove(os.path.join(src, "model.safetensors"))  # never reached
    err = _refused(capsys, ["hf-to-megatron", "--load", src, "--save", str(tmp_path / "meg")])
    assert "FP8" in err and "dequantize" in err


def test_verify_names_a_latent_attention_difference():
    """tools/checkpoint/verify.py reports a checkpoint whose MLA differs from the HF config."""
    import types

    import verify

    from megatron.core.transformer.transformer_config import TransformerConfig

    hf_config = build_hf_model("deepseek_v3").config
    ours, kwargs = config_from_hf(hf_config)
    configs = types.SimpleNamespace(transformer=ours, model_kwargs=kwargs)
    assert verify.config_differences(hf_config, configs, kwargs["vocab_size"]) == []
    configs.transformer = TransformerConfig(**{**vars(ours), "rotary_interleaved": False})
    assert verify.config_differences(hf_config, configs, kwargs["vocab_size"]) == [
        "rotary_interleaved: checkpoint False, HF True"]
