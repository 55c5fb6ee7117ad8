"""tools/checkpoint/convert.py, called in process (the CLI as a subprocess, the shell wrappers
and training from a converted checkpoint: tests/e2e/test_checkpoint_convert_cli.py).

HF -> Megatron (any TP/PP/VPP) -> HF gives back every tensor bit for bit, a directory
``from_pretrained`` loads with the original's config, and Megatron flags (the checkpoint's
args and megatron_flags.txt) that rebuild the same model. Every error is one line, exit code 1,
and leaves no output behind.
"""
import json
import os
import shlex
import types

import pytest
import torch

from megatron.core.models.hf_conversion import config_from_hf, hf_to_megatron
from megatron.core.utils import vocab_size_with_padding
from megatron.training.arguments import build_configs, parse_args
from megatron.training.checkpointing.offline import (
    TargetLayout,
    find_iteration_dir,
    read_model,
    write_model,
)
from tests.hf_checkpoints import VOCAB, build_model, converter, read_safetensors_dir, save_model

convert = converter()
import megatron_args  # noqa: E402  (tools/checkpoint, on sys.path once convert is imported)

# Fields of TransformerConfig a converted checkpoint must reproduce.
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "normalization", "layernorm_epsilon",
               "activation", "add_bias_linear", "add_qkv_bias", "position_embedding_type",
               "max_position_embeddings", "rotary_base", "rope_scaling_factor",
               "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_position_embeddings", "init_method_std", "hidden_dropout",
               "attention_dropout")
HF_FIELDS = {
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "initializer_range", "attention_dropout", "hidden_act",
              "bos_token_id", "eos_token_id", "pad_token_id", "architectures"),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
             "layer_norm_epsilon", "activation_function", "resid_pdrop", "embd_pdrop",
             "attn_pdrop", "initializer_range", "tie_word_embeddings", "bos_token_id",
             "eos_token_id", "architectures"),
}


def run(*argv) -> int:
    return convert.main([str(a) for a in argv])


def layout_flags(tp, pp, per_stage=None):
    flags = ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    return flags + (["--num-layers-per-virtual-pipeline-stage", per_stage] if per_stage else [])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_model(build_model(name), str(root / name))
            for name in ("llama_gqa", "llama3_rope_tied", "gpt2")}


def flags_of(checkpoint_dir, *extra):
    """megatron_flags.txt as an argv, plus what a training run adds."""
    with open(os.path.join(checkpoint_dir, "megatron_flags.txt")) as f:
        text = " ".join(line for line in f.read().splitlines() if not line.startswith("#"))
    return shlex.split(text) + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                                "--mock-data", *extra]


def check_flags_rebuild_model(checkpoint_dir, hf_config, saved_args, world_size):
    args = parse_args(flags_of(checkpoint_dir))
    tokenizer = types.SimpleNamespace(vocab_size=VOCAB, eod=2)  # the tokenizer's real size
    configs = build_configs(args, world_size=world_size, tokenizer=tokenizer)
    expected, model_kwargs = config_from_hf(hf_config)
    for field in ARCH_FIELDS:
        assert getattr(configs.transformer, field) == getattr(expected, field), field
    assert configs.model_kwargs["share_embeddings_and_output_weights"] == \
        model_kwargs["share_embeddings_and_output_weights"]
    assert configs.model_kwargs["padded_vocab_size"] == vocab_size_with_padding(
        VOCAB, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    assert saved_args["padded_vocab_size"] is None  # the tokenizer fills every row: no flag
    # The checkpoint's args (what tools read) say what the flags (what training reads) say;
    # vocab_size, a NullTokenizer flag, records the model's vocabulary for tools.
    assert saved_args["vocab_size"] == VOCAB
    training_only = {"micro_batch_size", "train_iters", "lr", "mock_data", "load",
                     "start_weight_decay", "end_weight_decay", "vocab_size", "global_batch_size"}
    for key in set(megatron_args.parser_defaults()) - training_only:
        assert saved_args[key] == vars(args)[key], key


@pytest.mark.parametrize("name, tp, pp, per_stage, fmt", [
    ("llama_gqa", 2, 2, None, "torch"), ("llama_gqa", 4, 1, None, "torch"),
    ("llama_gqa", 1, 2, 1, "torch"), ("llama3_rope_tied", 2, 2, None, "torch"),
    ("gpt2", 2, 2, None, "torch"), ("gpt2", 4, 1, None, "torch"), ("gpt2", 2, 2, 1, "torch"),
    ("llama_gqa", 2, 2, None, "torch_dist"), ("llama3_rope_tied", 1, 1, None, "torch_dist"),
    ("gpt2", 2, 2, 1, "torch_dist"),
])
def test_round_trip_is_bitwise(hf_dirs, tmp_path, name, tp, pp, per_stage, fmt):
    import transformers

    src, meg, back = hf_dirs[name], str(tmp_path / "meg"), str(tmp_path / "hf")
    assert run("hf-to-megatron", "--load", src, "--save", meg, "--ckpt-format", fmt,
               *layout_flags(tp, pp, per_stage)) == 0

    with open(os.path.join(meg, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "release"
    full, layout, args = read_model(find_iteration_dir(meg))
    vpp = 2 if per_stage else None
    padded = vocab_size_with_padding(VOCAB, 128, tp)
    assert args["padded_vocab_size"] is None and layout["vocab_size"] == VOCAB
    if fmt == "torch":  # a release checkpoint in the asked layout, vocabulary padded
        assert (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                layout["virtual_pipeline_model_parallel_size"]) == (tp, pp, vpp)
        assert layout["padded_vocab_size"] == padded == 128 * tp
        rank0_file = os.path.join(meg, "release", "mp_rank_00" + ("_000" if pp > 1 else ""),
                                  "model_optim_rng.pt")
        rank0 = torch.load(rank0_file, weights_only=True)
        embedding = rank0["model0" if vpp else "model"]["embedding.word_embeddings.weight"]
        assert embedding.shape[0] == padded // tp
    else:  # every tensor whole (no padding) in one shard; loads at any layout
        assert sorted(os.listdir(os.path.join(meg, "release"))) == [
            "metadata.json", "shard_00000.safetensors"]
        assert layout["tensor_model_parallel_size"] == layout["pipeline_model_parallel_size"] \
            == 1 and full["embedding.word_embeddings.weight"].shape[0] == VOCAB
        assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == \
            (tp, pp)  # what the flags file trains with
    assert sorted(os.listdir(os.path.join(meg, "tokenizer"))) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert args["tokenizer_type"] == "PretrainedFromHF" and \
        args["tokenizer_name_or_path"] == os.path.join(meg, "tokenizer")
    original = transformers.AutoConfig.from_pretrained(src)
    check_flags_rebuild_model(meg, original, args, tp * pp)

    assert run("megatron-to-hf", "--load", meg, "--save", back, "--max-shard-size", "40KB") == 0
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json"))  # sharded
    before, after = read_safetensors_dir(src), read_safetensors_dir(back)
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    assert os.path.isfile(os.path.join(back, "tokenizer.json"))

    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    reloaded = model.config
    for field in HF_FIELDS["gpt2" if name == "gpt2" else "llama"]:
        assert getattr(reloaded, field) == getattr(original, field), field
    state = model.state_dict()
    for key, tensor in before.items():
        assert torch.equal(state[key], tensor), key
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    assert transformers.AutoTokenizer.from_pretrained(back).eos_token_id == 2


@pytest.mark.parametrize("fmt, name", [("safetensors_sharded", "llama_gqa"), ("bin", "llama_gqa"),
                                       ("bin_sharded", "llama3_rope_tied"),
                                       ("bin_base_names", "gpt2")])
def test_input_formats(tmp_path, fmt, name):
    model = build_model(name, num_layers=2, seed=1)
    src = save_model(model, str(tmp_path / "hf"), fmt, tokenizer=False)
    assert run("hf-to-megatron", "--load", src, "--save", tmp_path / "meg") == 0
    full, _, _ = read_model(find_iteration_dir(str(tmp_path / "meg")))
    expected = hf_to_megatron(model.state_dict(), model.config)
    assert sorted(full) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(full[key], tensor), key


class _Payload:
    """Pickles into a call of os.system: what a malicious pytorch_model.bin holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_bin_is_refused(tmp_path, capsys):
    model = build_model("llama_gqa", num_layers=2)
    src = save_model(model, str(tmp_path / "hf"), "bin", tokenizer=False)
    marker = tmp_path / "payload_ran"
    state = dict(model.state_dict(), payload=_Payload(marker))
    torch.save(state, os.path.join(src, "pytorch_model.bin"))
    assert run("hf-to-megatron", "--load", src, "--save", tmp_path / "meg") == 1
    assert "refusing to load" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "meg").exists()


def _reshard_and_compare(src, dst, tp, pp, per_stage=None):
    assert run("megatron-to-megatron", "--load", src, "--save", dst, "--ckpt-format", "torch",
               *layout_flags(tp, pp, per_stage)) == 0
    full_a, layout_a, args_a = read_model(find_iteration_dir(src))
    full_b, layout_b, args_b = read_model(find_iteration_dir(dst))
    assert (layout_b["tensor_model_parallel_size"], layout_b["pipeline_model_parallel_size"]) \
        == (tp, pp)
    assert sorted(full_a) == sorted(full_b)
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), key
    changed = {k for k in args_a if args_a[k] != args_b.get(k)}
    assert changed <= {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "virtual_pipeline_model_parallel_size", "padded_vocab_size",
                       "num_layers_per_virtual_pipeline_stage", "tokenizer_name_or_path"}
    return args_b


def test_megatron_to_megatron(hf_dirs, tmp_path):
    src = str(tmp_path / "tp2pp2")
    assert run("hf-to-megatron", "--load", hf_dirs["llama_gqa"], "--save", src,
               *layout_flags(2, 2)) == 0
    args = _reshard_and_compare(src, str(tmp_path / "tp1pp1"), 1, 1)
    assert args["tokenizer_name_or_path"] == str(tmp_path / "tp1pp1" / "tokenizer")
    assert os.path.isfile(tmp_path / "tp1pp1" / "tokenizer" / "tokenizer.json")
    assert (tmp_path / "tp1pp1" / "latest_checkpointed_iteration.txt").read_text().strip() == \
        "release"
    _reshard_and_compare(src, str(tmp_path / "vpp"), 2, 2, per_stage=1)

    # A training iteration keeps its number.
    full, layout, saved = read_model(find_iteration_dir(src))
    trained = str(tmp_path / "trained")
    write_model(trained, full, layout["num_layers"], layout["vocab_size"], True, False,
                TargetLayout(2, 2), saved, iteration=100)
    _reshard_and_compare(trained, str(tmp_path / "trained_tp4"), 4, 1)
    assert (tmp_path / "trained_tp4" / "latest_checkpointed_iteration.txt").read_text().strip() \
        == "100"
    assert (tmp_path / "trained_tp4" / "iter_0000100").is_dir()


def test_format_conversion_of_a_release_keeps_every_tensor(hf_dirs, tmp_path, capsys):
    """No layout flags: the checkpoint as it is, in the other format, and back."""
    src, torch_dir, back = (str(tmp_path / n) for n in ("sharded", "torch", "back"))
    assert run("hf-to-megatron", "--load", hf_dirs["llama3_rope_tied"], "--save", src) == 0
    assert run("megatron-to-megatron", "--load", src, "--save", torch_dir,
               "--ckpt-format", "torch") == 0
    assert "in the torch format (model weights; the saved layout)" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(torch_dir, "release", "mp_rank_00"))
    assert run("megatron-to-megatron", "--load", torch_dir, "--save", back) == 0
    assert os.path.isfile(os.path.join(back, "release", "metadata.json"))
    want = read_model(find_iteration_dir(src))
    for other in (torch_dir, back):
        got = read_model(find_iteration_dir(other))
        assert sorted(got[0]) == sorted(want[0]) and got[1] == want[1]
        assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])
        assert got[2]["tokenizer_name_or_path"] == os.path.join(other, "tokenizer")


def test_mistral_converts_with_its_sliding_window(tmp_path):
    """Mistral's sliding window (16 keys, in a 64-position model) becomes --window-size 15,0
    and comes back as MistralForCausalLM's sliding_window 16, every weight bit for bit. (Its
    logits equal HF's: tests/unit/test_models_vs_hf.py, mistral_window.)"""
    import transformers

    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=16)
    torch.manual_seed(0)
    src = save_model(transformers.MistralForCausalLM(config), str(tmp_path / "hf"),
                     tokenizer=False)
    assert run("hf-to-megatron", "--load", src, "--save", tmp_path / "meg") == 0
    flags = (tmp_path / "meg" / "megatron_flags.txt").read_text()
    assert "--window-size 15,0" in flags and "--window-attn-skip-freq" not in flags
    assert run("megatron-to-hf", "--load", tmp_path / "meg", "--save", tmp_path / "back") == 0
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(tmp_path / "back"))
    assert all(torch.equal(after[k], t) for k, t in before.items()) and len(before) == len(after)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["MistralForCausalLM"] and back["sliding_window"] == 16


# ---- errors: one line, exit code 1, nothing written --------------------------------------

def one_line_error(capsys) -> str:
    """The error line: the last on stderr (after any progress lines), and the only one."""
    lines = capsys.readouterr().err.splitlines()
    assert sum("error:" in line for line in lines) == 1, lines
    return lines[-1]

def _write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def _damaged(tmp_path, hf_dirs, kind):
    """An HF directory with one problem."""
    import shutil

    path = str(tmp_path / "bad")
    if kind == "bert":
        _write_json(os.path.join(path, "config.json"), {"model_type": "bert",
                                                       "architectures": ["BertForMaskedLM"]})
        return path
    shutil.copytree(hf_dirs["llama_gqa"], path)
    if kind == "no_config":
        os.remove(os.path.join(path, "config.json"))
    elif kind == "no_weights":
        os.remove(os.path.join(path, "model.safetensors"))
    elif kind == "missing_shard":
        os.remove(os.path.join(path, "model.safetensors"))
        _write_json(os.path.join(path, "model.safetensors.index.json"),
                    {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    elif kind == "missing_tensor":
        from safetensors.torch import load_file, save_file

        state = load_file(os.path.join(path, "model.safetensors"))
        del state["model.layers.3.mlp.up_proj.weight"]
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    elif kind in ("linear_rope", "gelu_llama"):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if kind == "linear_rope":
            config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 10000.0}
        else:
            config["hidden_act"] = "gelu"
        _write_json(os.path.join(path, "config.json"), config)
    return path


@pytest.mark.parametrize("kind, layout, message", [
    ("bert", [], "unsupported architecture: model_type 'bert', architectures "
                 "['BertForMaskedLM'] in"),
    ("bert", [], "supported: LlamaForCausalLM (model_type llama), MistralForCausalLM "
                 "(model_type mistral), GPT2LMHeadModel (model_type gpt2), "
                 "Qwen2ForCausalLM (model_type qwen2), Qwen3ForCausalLM (model_type qwen3), "
                 "MixtralForCausalLM (model_type mixtral), Qwen2MoeForCausalLM (model_type "
                 "qwen2_moe), Qwen3MoeForCausalLM (model_type qwen3_moe), GptOssForCausalLM "
                 "(model_type gpt_oss), DeepseekV3ForCausalLM (model_type deepseek_v3)."),
    ("linear_rope", [], "rope scaling type 'linear' is not supported"),
    ("gelu_llama", [], "hidden_act 'gelu' is not supported"),
    ("no_config", [], "has no config.json"),
    ("no_weights", [], "holds no weights: expected one of model.safetensors,"),
    ("missing_shard", [], "lists 1 weight file(s) missing from"),
    ("missing_tensor", [], "lack 1 tensor(s) of a llama model with 4 layers, e.g. "
                           "model.layers.3.mlp.up_proj.weight"),
    ("ok", layout_flags(3, 1), "--tensor-model-parallel-size 3 does not divide the model's 8 "
                               "attention heads"),
    ("ok", layout_flags(8, 1), "--tensor-model-parallel-size 8 does not divide the model's 4 "
                               "query groups (key/value heads)"),
    ("ok", layout_flags(1, 3), "--pipeline-model-parallel-size 3 does not divide the model's "
                               "4 layers"),
    ("ok", layout_flags(1, 2, 3), "the model's 4 layers do not split into "
                                  "--pipeline-model-parallel-size 2 x "
                                  "--num-layers-per-virtual-pipeline-stage 3"),
    ("ok", layout_flags(1, 1, 2), "--num-layers-per-virtual-pipeline-stage needs "
                                  "--pipeline-model-parallel-size > 1"),
])
def test_hf_to_megatron_errors(hf_dirs, tmp_path, capsys, kind, layout, message):
    src = hf_dirs["llama_gqa"] if kind == "ok" else _damaged(tmp_path, hf_dirs, kind)
    save = tmp_path / "out"
    assert run("hf-to-megatron", "--load", src, "--save", save, *layout) == 1
    err = one_line_error(capsys)
    assert err.startswith("convert.py hf-to-megatron: error: ") and message in err, err
    assert not save.exists() and not (tmp_path / "out.partial").exists()


def test_other_errors(hf_dirs, tmp_path, capsys):
    def error(*argv):
        assert run(*argv) == 1
        return one_line_error(capsys)

    assert "Hugging Face model directory" in error(
        "hf-to-megatron", "--load", tmp_path / "nowhere", "--save", tmp_path / "out")
    assert "--tokenizer-dir" in error(
        "hf-to-megatron", "--load", hf_dirs["gpt2"], "--save", tmp_path / "out",
        "--tokenizer-dir", tmp_path / "nowhere")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "exists and is not empty" in error(
        "hf-to-megatron", "--load", hf_dirs["gpt2"], "--save", tmp_path / "full")
    assert "checkpoint directory" in error(
        "megatron-to-hf", "--load", tmp_path / "nowhere", "--save", tmp_path / "out")
    assert "holds no checkpoint (latest_checkpointed_iteration.txt is missing)" in error(
        "megatron-to-hf", "--load", tmp_path / "full", "--save", tmp_path / "out")
    assert "--save must differ from --load" in error(
        "megatron-to-megatron", "--load", tmp_path / "full", "--save", tmp_path / "full",
        *layout_flags(1, 1))

    # A checkpoint whose model has no HF counterpart (LLaMA's SwiGLU with LayerNorm).
    meg = str(tmp_path / "meg")
    assert run("hf-to-megatron", "--load", hf_dirs["llama_gqa"], "--save", meg) == 0
    full, layout, args = read_model(find_iteration_dir(meg))
    odd = str(tmp_path / "odd")
    write_model(odd, full, 4, VOCAB, True, False, TargetLayout(),
                {**args, "normalization": "LayerNorm"})
    assert "no Hugging Face equivalent: as LlamaForCausalLM (--swiglu) it has " \
           "normalization='LayerNorm' (needs 'RMSNorm')" in error(
               "megatron-to-hf", "--load", odd, "--save", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):  # argparse: usage and exit code 2
        run("megatron-to-hf", "--load", meg, "--save", tmp_path / "out", "--max-shard-size",
            "huge")


def test_failure_while_writing_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    real_write_model, real_write_weights = convert.write_model, convert.hf_io.write_weights

    def write_then_fail(real):
        def wrapped(*args, **kwargs):
            real(*args, **kwargs)
            raise OSError("disk full")
        return wrapped

    monkeypatch.setattr(convert, "write_model", write_then_fail(real_write_model))
    with pytest.raises(OSError, match="disk full"):
        run("hf-to-megatron", "--load", hf_dirs["gpt2"], "--save", tmp_path / "meg")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(convert, "write_model", real_write_model)
    assert run("hf-to-megatron", "--load", hf_dirs["gpt2"], "--save", tmp_path / "meg") == 0

    monkeypatch.setattr(convert.hf_io, "write_weights", write_then_fail(real_write_weights))
    with pytest.raises(OSError, match="disk full"):
        run("megatron-to-hf", "--load", tmp_path / "meg", "--save", tmp_path / "hf")
    assert os.listdir(tmp_path) == ["meg"]


def test_parse_size():
    parse = convert.hf_io.parse_size
    assert (parse("5GB"), parse("500MB"), parse("2KiB"), parse("123"), parse("1.5GB")) == (
        5 * 10 ** 9, 500 * 10 ** 6, 2048, 123, 1_500_000_000)
    for bad in ("", "5XB", "-1", "0"):
        with pytest.raises(ValueError):
            parse(bad)
