"""tools/checkpoint/convert.py on the mixtures of experts: tiny random Mixtral, Qwen2-MoE (a
dense layer, a gated shared expert, qkv biases) and Qwen3-MoE (q/k norms) saved with
save_pretrained, converted to Megatron at TP=2 x EP=2 (expert TP 2) in the sharded format
(and Qwen3-MoE in the torch format too) and back: every tensor of model.safetensors equal to
the original's, bit for bit. The torch format's expert files hold what training writes (each
(expert TP, PP, EP) position's experts by global number, cut over expert TP). Then the
converted checkpoints run: pretrain_llama.py (the converter's flags, TP=2 x EP=2 with expert
TP 1, world 2) loads one and its first loss is HF's on the same batch, and verify.py passes
at EP=2.

Tolerance 1e-5 (fp32): HF's eager attention and per-expert loop vs our SDPA and grouped
experts, and the TP/EP reductions, sum in other orders (observed ~1e-6 and below); the log
prints 7 significant digits.
"""
import os
import re
import shlex
import signal

import pytest
import torch

from tests.e2e.runner import finish, start_script
from tests.hf_checkpoints import converter, read_safetensors_dir
from tests.unit.test_hf_moe_conversion import VOCAB, build_hf_model

TOL = 1e-5
TOKENS = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3"
CASES = [("mixtral", "torch_dist"), ("qwen2_moe", "torch_dist"), ("qwen3_moe", "torch_dist"),
         ("qwen3_moe", "torch")]


def _convert(*argv):
    assert converter().main([str(a) for a in argv]) == 0


def _to_megatron(hf_dir, save, ckpt_format):
    _convert("hf-to-megatron", "--load", hf_dir, "--save", save, "--tensor-model-parallel-size",
             2, "--expert-model-parallel-size", 2, "--ckpt-format", ckpt_format)


def _train_flags(load):
    """The converter's flags (TP=2 x EP=2, SP), expert TP 1 (a world of 2), one iteration of
    4 mock samples over the model's vocabulary."""
    with open(os.path.join(load, "megatron_flags.txt")) as f:
        flags = shlex.split(" ".join(line for line in f if not line.startswith("#")))
    assert "--expert-model-parallel-size" in flags and "--sequence-parallel" in flags
    return flags + [
        "--expert-tensor-parallel-size", "1", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3", "--lr-decay-style",
        "constant", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        str(VOCAB - 1), "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """HF models, their conversions, and the two runs (started at once: 2 cores)."""
    root = tmp_path_factory.mktemp("moe_conversion")
    hf = {}
    for name in ("mixtral", "qwen2_moe", "qwen3_moe"):
        hf[name] = build_hf_model(name)
        hf[name].save_pretrained(str(root / f"hf_{name}"))
    for name, fmt in CASES:
        _to_megatron(root / f"hf_{name}", root / f"{name}_{fmt}", fmt)
    started = {
        "train": start_script("pretrain_llama.py", _train_flags(root / "qwen2_moe_torch_dist"),
                              2),
        "verify": start_script("tools/checkpoint/verify.py", [
            "--hf-dir", root / "hf_mixtral", "--load", root / "mixtral_torch_dist",
            "--token-ids", TOKENS, "--expert-model-parallel-size", "2"], 2)}
    done = {}

    def result(key):
        if key not in done:
            done[key] = finish(started[key], timeout=240)
        return done[key]

    yield root, hf, result
    for popen in started.values():
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()


@pytest.mark.parametrize("name, fmt", CASES)
def test_round_trip_is_bitwise(setup, name, fmt):
    root = setup[0]
    back = root / f"back_{name}_{fmt}"
    _convert("megatron-to-hf", "--load", root / f"{name}_{fmt}", "--save", back)
    before, after = read_safetensors_dir(str(root / f"hf_{name}")), read_safetensors_dir(
        str(back))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    import transformers

    config = transformers.AutoConfig.from_pretrained(back)
    original = setup[1][name].config
    for field in ("num_hidden_layers", "num_experts_per_tok", "hidden_size", "vocab_size"):
        assert getattr(config, field) == getattr(original, field), field
    if name == "qwen2_moe":
        assert config.mlp_only_layers == [1] and config.shared_expert_intermediate_size == 20


def test_sharded_format_holds_experts_by_global_number(setup):
    from megatron.training.checkpointing.offline import checkpoint_tensors

    tensors = checkpoint_tensors(str(setup[0] / "qwen2_moe_torch_dist" / "release"))
    hf = setup[1]["qwen2_moe"].state_dict()
    fc1 = tensors["model/decoder.layers.2.mlp.experts.3.linear_fc1.weight"]
    assert torch.equal(fc1, hf["model.layers.2.mlp.experts.gate_up_proj"][3])
    assert not any(".layers.1.mlp.experts" in n for n in tensors)  # the dense layer
    assert "model/decoder.layers.1.mlp.linear_fc1.weight" in tensors


def test_torch_format_expert_files_are_what_training_writes(setup):
    """mp_rank_{etp}_{pp}_{ep}/experts.pt: EP rank e holds experts 2e, 2e+1, cut over expert
    TP like linear_fc1 (stride 2: each rank its gate and up rows) and linear_fc2 (dim 1)."""
    release = setup[0] / "qwen3_moe_torch" / "release"
    assert sorted(os.listdir(release)) == ["mp_rank_00", "mp_rank_00_000_000",
                                           "mp_rank_00_000_001", "mp_rank_01",
                                           "mp_rank_01_000_000", "mp_rank_01_000_001"]
    hf = setup[1]["qwen3_moe"].state_dict()
    for etp in range(2):
        for ep in range(2):
            path = release / f"mp_rank_{etp:02d}_000_{ep:03d}" / "experts.pt"
            state = torch.load(path, weights_only=True)
            assert state["layout"]["expert_model_parallel_size"] == 2
            assert len(state["model"]) == 3 * 2 * 2  # layers x local experts x (fc1, fc2)
            for g in (2 * ep, 2 * ep + 1):
                gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"][g]
                gate, up = gate_up.chunk(2)
                rows = slice(12 * etp, 12 * (etp + 1))
                fc1 = state["model"][f"decoder.layers.1.mlp.experts.{g}.linear_fc1.weight"]
                assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]))
                fc2 = state["model"][f"decoder.layers.1.mlp.experts.{g}.linear_fc2.weight"]
                down = hf["model.layers.1.mlp.experts.down_proj"][g]
                assert torch.equal(fc2, down[:, rows])
    dense = torch.load(release / "mp_rank_01" / "model_optim_rng.pt", weights_only=True)
    assert not any(".experts." in n for n in dense["model"])
    assert dense["layout"]["expert_tensor_parallel_size"] == 2


def test_training_loads_it_with_hf_loss(setup):
    """pretrain_llama.py at TP=2 x EP=2 from the converted Qwen2-MoE: the first loss is HF's
    mean loss over the same 4 mock samples (each sample's mean token loss, averaged)."""
    from megatron.core.datasets.mock_dataset import MockGPTDataset

    root, hf, result = setup
    proc = result("train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loaded checkpoint from" in proc.stdout and "at iteration 0" in proc.stdout
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    data = MockGPTDataset(4, 16, VOCAB, seed=1234, split_name="train")
    text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(4)])
    with torch.no_grad():
        logits = hf["qwen2_moe"](text[:, :-1]).logits
        per_sample = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), text[:, 1:], reduction="none").mean(1)
    assert len(losses) == 1 and abs(losses[0] - per_sample.mean().item()) <= TOL


def test_verify_passes_at_ep2(setup):
    proc = setup[2]("verify")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ours at TP=1 x PP=1 x EP=2 x expert TP=1" in proc.stdout
    diff = float(re.search(r"max \|logit diff\|: ([0-9.e+-]+)", proc.stdout).group(1))
    assert diff <= TOL and "argmax agreement: 16/16" in proc.stdout and "note:" not in proc.stdout


def test_reshard_to_ep4_torch_format_and_back_is_bitwise(setup):
    """megatron-to-megatron: the sharded Mixtral cut for TP=1 x EP=4 in the torch format."""
    root = setup[0]
    _convert("megatron-to-megatron", "--load", root / "mixtral_torch_dist", "--save",
             root / "mixtral_ep4", "--tensor-model-parallel-size", 1,
             "--expert-model-parallel-size", 4, "--ckpt-format", "torch")
    names = sorted(os.listdir(root / "mixtral_ep4" / "release"))
    assert names == ["mp_rank_00"] + [f"mp_rank_00_000_{e:03d}" for e in range(4)]
    _convert("megatron-to-hf", "--load", root / "mixtral_ep4", "--save", root / "ep4_hf")
    before = read_safetensors_dir(str(root / "hf_mixtral"))
    after = read_safetensors_dir(str(root / "ep4_hf"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_generate_runs_on_the_converted_model(setup, capsys):
    """generate.py on the HF directory written from the TP2 x EP2 checkpoint: the original
    model's greedy continuation."""
    import importlib.util

    from tests.e2e.runner import ROOT
    from tests.hf_checkpoints import save_tokenizer

    root, hf = setup[0], setup[1]
    save_tokenizer(str(root / "tokenizer"))
    _convert("megatron-to-hf", "--load", root / "qwen3_moe_torch", "--save", root / "gen",
             "--tokenizer-dir", root / "tokenizer")
    spec = importlib.util.spec_from_file_location(
        "generate", os.path.join(ROOT, "tools", "checkpoint", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    capsys.readouterr()
    assert generate.main(["--hf-dir", str(root / "gen"), "--prompt", "w3 w4 w5",
                          "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    with torch.no_grad():
        ids = hf["qwen3_moe"].generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4,
                                       do_sample=False, pad_token_id=2)[0, 3:].tolist()
    ids = ids[:ids.index(2)] if 2 in ids else ids  # generation stops at </s> (id 2)
    assert f"-> {' '.join(f'w{i}' for i in ids)!r}" in printed
