"""Weights that do not fit the architecture they come with, given to
tools/checkpoint/convert.py: a config.json whose sizes disagree with the tensors, or lack one
(transformers would fill in its own default), one tensor cut to another shape, a truncated
safetensors shard, and our own checkpoints with a tensor that disagrees with their saved args.
Each case: exit 1, one ``error:`` line naming the tensor (or field, or file) and the fix, no
traceback, and no output directory (nor its ``.partial`` staging copy) left behind."""
import json
import shutil

import pytest
import torch

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.hf_checkpoints import build_model, save_model

pytestmark = pytest.mark.slow  # each case starts the converter

CONVERT = "tools/checkpoint/convert.py"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"  # 8 heads of 8 + 2 x 4 groups: 128
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"  # [gate; up] of 96 each: 192 rows


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny LLaMA (hidden 64, FFN 96, 8 heads in 4 groups, 2 layers) saved by
    save_pretrained in one safetensors file and in 20 KB shards, and converted once to our
    torch format (one mp_rank_00 file, easy to tamper with)."""
    root = tmp_path_factory.mktemp("shapes")
    model = build_model("llama_gqa", num_layers=2)
    save_model(model, str(root / "hf"), tokenizer=False)
    save_model(model, str(root / "hf_sharded"), "safetensors_sharded", tokenizer=False)
    proc = run(CONVERT, ["hf-to-megatron", "--load", root / "hf", "--save", root / "megatron",
                         "--ckpt-format", "torch"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def _copy(models, name, tmp_path):
    shutil.copytree(models / name, tmp_path / name)
    return tmp_path / name


def _edit_config(hf_dir, edit) -> None:
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _refused(command, load, save, *fragments):
    proc = run(CONVERT, [command, "--load", load, "--save", save])
    line = assert_clean_error(proc, 1, *fragments)
    assert not save.exists() and not save.with_name(save.name + ".partial").exists()
    return line


# --------------------------------------------------------------------------------------------
# hf-to-megatron: the weights are the truth, config.json must describe them.
def test_intermediate_size_that_disagrees_with_the_weights(models, tmp_path):
    hf = _copy(models, "hf", tmp_path)
    _edit_config(hf, lambda c: c.update(intermediate_size=48))  # the tensors have 96
    _refused("hf-to-megatron", hf, tmp_path / "out",
             "model.layers.0.mlp.gate_proj.weight has shape [96, 64]",
             "config.json implies [48, 64]", str(hf / "config.json"))


def test_missing_hidden_size_is_not_filled_with_a_default(models, tmp_path):
    hf = _copy(models, "hf", tmp_path)
    _edit_config(hf, lambda c: c.pop("hidden_size"))  # LlamaConfig's default: 4096
    _refused("hf-to-megatron", hf, tmp_path / "out", "hidden_size", str(hf / "config.json"),
             "no default is assumed")


def test_one_tensor_of_the_wrong_shape(models, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _copy(models, "hf", tmp_path)
    path = str(hf / "model.safetensors")
    state = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = state[name][:32].clone()  # half of its 64 rows; the others stay right
    save_file(state, path, metadata={"format": "pt"})
    _refused("hf-to-megatron", hf, tmp_path / "out", f"{name} has shape [32, 64]",
             "implies [64, 64]")


def test_truncated_safetensors_shard(models, tmp_path):
    hf = _copy(models, "hf_sharded", tmp_path)
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    line = _refused("hf-to-megatron", hf, tmp_path / "out", str(shard),
                    "damaged or truncated", "re-download")
    assert "SafetensorError" not in line and "deserializing" not in line  # not the library's


# --------------------------------------------------------------------------------------------
# Our own checkpoints: every tensor must have the shape the saved args give it.
def _tamper(megatron_dir, name, rows: int) -> None:
    """Keep the first ``rows`` rows of tensor ``name`` (the file stays a valid torch file)."""
    path = megatron_dir / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    state["model"][name] = state["model"][name][:rows].clone()
    torch.save(state, path)


def test_megatron_to_hf_with_a_tensor_the_args_do_not_describe(models, tmp_path):
    ckpt = _copy(models, "megatron", tmp_path)
    _tamper(ckpt, QKV, 64)
    _refused("megatron-to-hf", ckpt, tmp_path / "hf", f"{QKV} has shape [64, 64]",
             "implies [128, 64]")


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2"]],
                         ids=["format-conversion", "reshard"])
def test_megatron_to_megatron_with_a_tensor_the_args_do_not_describe(models, tmp_path, layout):
    ckpt = _copy(models, "megatron", tmp_path)
    _tamper(ckpt, FC1, 96)
    save = tmp_path / "new"
    proc = run(CONVERT, ["megatron-to-megatron", "--load", ckpt, "--save", save, *layout])
    assert_clean_error(proc, 1, f"{FC1} has shape [96, 64]", "implies [192, 64]")
    assert not save.exists() and not (tmp_path / "new.partial").exists()
