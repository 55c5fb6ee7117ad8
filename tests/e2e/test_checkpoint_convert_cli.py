"""Checkpoint conversion as a user runs it: the shell wrappers (hence tools/checkpoint/convert.py
as a process) both ways, training from the converted checkpoint with the flags the converter
wrote, that trained checkpoint back to Hugging Face, and an error's exit code. The conversions
themselves are covered in tests/unit/test_checkpoint_convert.py."""
import os
import subprocess

import torch

from tests.e2e.runner import ROOT, parse_iterations, run_script
from tests.hf_checkpoints import VOCAB, build_model, converter, read_safetensors_dir, save_model

SHTOOLS = os.path.join(ROOT, "shtools", "checkpoint_conversion")


def _shell(script, env, *args):
    proc = subprocess.run(["bash", os.path.join(SHTOOLS, script), *map(str, args)], cwd=ROOT,
                          env=dict(os.environ, PYTHON="python", **env), capture_output=True,
                          text=True, timeout=300)
    return proc


def test_convert_train_and_convert_back(tmp_path):
    src = save_model(build_model("llama3_rope_tied"), str(tmp_path / "hf"))
    meg, back = tmp_path / "meg", tmp_path / "back"
    proc = _shell("hf_to_megatron.sh", {"HF_DIR": src, "SAVE": str(meg), "TP": "2", "PP": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "wrote a release checkpoint (sharded format, loads at any layout; flags for TP=2 x " \
        "PP=2) of llama" in proc.stdout  # the default format, as training's
    assert sorted(os.listdir(meg / "release")) == ["metadata.json", "shard_00000.safetensors"]
    assert "writing Megatron checkpoint files: [" in proc.stderr  # progress
    proc = _shell("megatron_to_hf.sh", {}, meg, back, "--", "--max-shard-size", "40KB")
    assert proc.returncode == 0, proc.stderr
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(back))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)

    # Train from it with the flags the converter wrote (another layout: TP 1 x PP 1).
    with open(meg / "megatron_flags.txt") as f:
        flags = " ".join(line for line in f.read().splitlines() if not line.startswith("#"))
    flags = flags.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
    flags = flags.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1")
    trained = tmp_path / "trained"
    proc = run_script("pretrain_llama.py", flags.split() + [
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--save", trained])
    assert [i for i, _, _ in parse_iterations(proc)] == [1, 2]
    assert f"loaded checkpoint from {meg}/release at iteration 0" in proc.stdout

    # The trained checkpoint (args written by pretrain) back to Hugging Face, in process.
    convert = converter()
    assert convert.main(["megatron-to-hf", "--load", str(trained), "--save",
                         str(tmp_path / "trained_hf")]) == 0
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained_hf")
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_type"] == \
        "llama3"
    changed = model.state_dict()["model.embed_tokens.weight"]
    assert changed.shape == (VOCAB, 64) and not torch.equal(
        changed, before["model.embed_tokens.weight"])  # two steps of training
    assert os.path.isfile(tmp_path / "trained_hf" / "tokenizer.json")


def test_torch_format_from_the_shell(tmp_path):
    src = save_model(build_model("llama_gqa", num_layers=2), str(tmp_path / "hf"))
    meg, back = tmp_path / "meg", tmp_path / "back"
    proc = _shell("hf_to_megatron.sh", {"HF_DIR": src, "SAVE": str(meg), "TP": "2",
                                        "CKPT_FORMAT": "torch"})
    assert proc.returncode == 0, proc.stderr
    assert "wrote a release checkpoint (TP=2 x PP=1) of llama" in proc.stdout
    assert sorted(os.listdir(meg / "release")) == ["mp_rank_00", "mp_rank_01"]
    proc = _shell("megatron_to_hf.sh", {}, meg, back)
    assert proc.returncode == 0, proc.stderr
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(back))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_error_exit_code(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    proc = _shell("hf_to_megatron.sh", {}, tmp_path / "bert", tmp_path / "out", 2)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "convert.py hf-to-megatron: error: unsupported architecture: model_type 'bert'")
    assert not (tmp_path / "out").exists()
    assert _shell("megatron_to_hf.sh", {}).returncode == 2  # usage
