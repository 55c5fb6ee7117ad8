"""checkpointing/architecture.py: every row of the table is detected when the checkpoint's
saved args differ from the run's (one message naming the flag and both values), a saved
args dict lacking the row's key passes, layout flags never matter, and
--use-checkpoint-args' take_architecture leaves nothing to detect."""
import argparse

import pytest

from megatron.training.arguments import get_parser, parse_args
from megatron.training.checkpointing.architecture import (
    ARCHITECTURE,
    architecture_mismatch,
    take_architecture,
)
from megatron.training.tokenizer.fingerprint import FINGERPRINT_ARG

# A run for which every row applies: RoPE with LLaMA-3.1 scaling, GQA, explicit head size,
# experts with a shared expert, NullTokenizer, a tokenizer fingerprint.
FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --kv-channels 16 --seq-length 32 --micro-batch-size 1 --lr 1e-3 "
         "--train-iters 2 --position-embedding-type rope --rotary-base 500000 "
         "--use-rope-scaling --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
         "--window-size 15,0 --window-attn-skip-freq 2 "
         "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
         "--moe-shared-expert-intermediate-size 48 --tokenizer-type NullTokenizer "
         "--vocab-size 100").split()

# A changed value for each row (its dest: the saved args' key).
CHANGED = {
    "num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 8,
    "group_query_attention": False, "num_query_groups": 1, "kv_channels": 32,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000.0,
    "rotary_percent": 0.5, "use_rope_scaling": False, "rope_scaling_factor": 16.0,
    "rope_low_freq_factor": 2.0, "rope_high_freq_factor": 8.0,
    "rope_original_max_position_embeddings": 4096, "rope_type": "yarn",
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-6, "swiglu": False, "openai_gelu": True, "disable_bias_linear": False,
    "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
    "add_qkv_bias": True, "qk_layernorm": True, "untie_embeddings_and_output_weights": True,
    "window_size": (7, 0), "window_attn_skip_freq": 3, "softmax_type": "learnable",
    "mtp_num_layers": 2,
    "num_experts": 8, "moe_router_topk": 1, "moe_router_score_function": "sigmoid",
    "moe_router_pre_softmax": True, "moe_router_topk_norm": True,
    "moe_router_enable_expert_bias": True, "moe_router_bias": True,
    "moe_router_num_groups": 2, "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_ffn_hidden_size": 64, "moe_layer_freq": 2,
    "moe_shared_expert_intermediate_size": 96, "moe_shared_expert_gate": True,
    "vocab_size": 200, FINGERPRINT_ARG: {"vocab_size": 201, "sha256": "b"},
    "multi_latent_attention": True,
}
# Rows that apply only under another setting than FLAGS': (their dest, that setting).
_YARN_CHANGED = {"rotary_scaling_factor": 32.0, "original_max_position_embeddings": 8192,
                 "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                 "yarn_correction_range_round_to_int": False, "yarn_attention_factor": 1.2}
_LATENT_ATTENTION_CHANGED = {"q_lora_rank": 32, "kv_lora_rank": 64, "qk_head_dim": 64,
                             "qk_pos_emb_head_dim": 32, "v_head_dim": 64,
                             "rotary_interleaved": True}
CONDITION = {"max_position_embeddings": {"position_embedding_type": "learned_absolute"},
             **{dest: {"rope_type": "yarn"} for dest in _YARN_CHANGED},
             **{dest: {"multi_latent_attention": True} for dest in _LATENT_ATTENTION_CHANGED}}
CHANGED_UNDER_CONDITION = {"max_position_embeddings": 64, **_YARN_CHANGED,
                           **_LATENT_ATTENTION_CHANGED}


def _run_args():
    args = vars(parse_args(FLAGS))
    args[FINGERPRINT_ARG] = {"vocab_size": 101, "sha256": "a"}
    return args


def _rows():
    return [pytest.param(s, id=s.dest) for s in ARCHITECTURE]


def test_the_table_has_a_change_for_every_row_and_rows_are_parser_dests():
    dests = {a.dest for a in get_parser()._actions}
    assert {s.dest for s in ARCHITECTURE} == set(CHANGED) | set(CHANGED_UNDER_CONDITION)
    for setting in ARCHITECTURE:
        assert setting.dest in dests or setting.dest == FINGERPRINT_ARG, setting.dest
        assert setting.dest == FINGERPRINT_ARG or setting.flag in \
            get_parser()._option_string_actions, setting.flag
    # Layout flags are not architecture: a checkpoint loads at any TP/PP/VPP/DP/EP/CP.
    layout = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
              "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
              "context_parallel_size", "data_parallel_size", "padded_vocab_size",
              "make_vocab_size_divisible_by", "sequence_parallel"}
    assert not layout & {s.dest for s in ARCHITECTURE}


@pytest.mark.parametrize("setting", _rows())
def test_every_row_is_detected_naming_the_flag_and_both_values(setting):
    run = {**_run_args(), **CONDITION.get(setting.dest, {})}
    value = {**CHANGED, **CHANGED_UNDER_CONDITION}[setting.dest]
    saved = {**run, setting.dest: value}
    message = architecture_mismatch(saved, run, "/ckpt/iter_0000002")
    assert message is not None, setting.dest
    assert message.startswith("the checkpoint at /ckpt/iter_0000002 was trained with "
                              f"{setting.show(setting.of(saved))}, this run has "
                              f"{setting.show(setting.of(run))}: "), message
    if setting.taken:
        assert message.endswith("pass the checkpoint's value, or --use-checkpoint-args to "
                                "take the checkpoint's architecture."), message
        assert setting.flag in message
    # The same values both ways round pass.
    assert architecture_mismatch(run, run, "x") is None
    assert architecture_mismatch(saved, saved, "x") is None


def test_messages_spell_values_as_flags():
    run = _run_args()
    assert "trained with --rotary-base 10000, this run has --rotary-base 500000" in \
        architecture_mismatch({**run, "rotary_base": 10000.0}, run, "c")
    assert "trained with --norm-epsilon 1e-06, this run has --norm-epsilon 1e-05" in \
        architecture_mismatch({**run, "norm_epsilon": 1e-6}, run, "c")
    assert "trained with no --swiglu, this run has --swiglu" in \
        architecture_mismatch({**run, "swiglu": False}, run, "c")
    dense = {**run, "num_experts": None}
    assert "trained with no --num-experts, this run has --num-experts 4" in \
        architecture_mismatch(dense, run, "c")
    assert "a tokenizer of 201 tokens, this run has a tokenizer of 101 tokens" in \
        architecture_mismatch({**run, FINGERPRINT_ARG: {"vocab_size": 201}, "vocab_size":
                               None}, run, "c")


@pytest.mark.parametrize("setting", _rows())
def test_saved_args_lacking_the_key_pass(setting):
    run = {**_run_args(), **CONDITION.get(setting.dest, {})}
    value = {**CHANGED, **CHANGED_UNDER_CONDITION}[setting.dest]
    saved = {**run, setting.dest: value}
    del saved[setting.dest]
    assert architecture_mismatch(saved, run, "c") is None


def test_old_checkpoint_with_few_args_passes():
    run = _run_args()
    assert architecture_mismatch({"num_layers": 4, "hidden_size": 64}, run, "c") is None
    assert architecture_mismatch({}, run, "c") is None


def test_equivalent_spellings_are_not_a_mismatch():
    """Defaults derived from other settings compare by their effect: --kv-channels unset is
    hidden / heads; --group-query-attention with as many groups as heads is plain attention;
    rope settings do not matter under learned positions (and the table's size under RoPE)."""
    run = _run_args()
    assert architecture_mismatch({**run, "kv_channels": None}, {**run, "kv_channels": 16},
                                 "c") is None
    mha = {**run, "group_query_attention": False, "num_query_groups": 1}
    assert architecture_mismatch({**run, "num_query_groups": 4}, mha, "c") is None
    learned = {**run, "position_embedding_type": "learned_absolute"}
    assert architecture_mismatch({**learned, "rotary_base": 1.0}, learned, "c") is None
    assert architecture_mismatch({**run, "max_position_embeddings": 8}, run, "c") is None
    assert architecture_mismatch({**run, "tensor_model_parallel_size": 2,
                                  "padded_vocab_size": 256}, run, "c") is None


def test_take_architecture_leaves_nothing_to_detect():
    saved = {**_run_args(), **{k: v for k, v in CHANGED.items()
                               if k not in ("vocab_size", FINGERPRINT_ARG)}}
    args = argparse.Namespace(**vars(get_parser().parse_args([])))
    taken = take_architecture(saved, args)
    assert architecture_mismatch(saved, {**vars(args), FINGERPRINT_ARG: saved[FINGERPRINT_ARG],
                                         "vocab_size": saved["vocab_size"],
                                         "tokenizer_type": "NullTokenizer"}, "c") is None
    assert "--num-layers 8" in taken and "--position-embedding-type learned_absolute" in taken
    assert "--vocab-size 100" not in taken and args.vocab_size is None  # the tokenizer's
    assert not any(t.startswith("--rotary-base") for t in taken)  # not used by learned ones
