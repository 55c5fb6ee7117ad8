"""Converted checkpoints compute what Hugging Face computes: random tiny HF models converted
with tools/checkpoint/convert.py (in this process), then tools/checkpoint/verify.py as torchrun
would run it (in the warm rank pool; the failing one launched for real) at TP=2 x PP=2 (LLaMA,
GQA), TP=4 (LLaMA-3 rope scaling, rope theta 5e5, a prompt through the HF tokenizer) and
TP=2 x PP=2 x VPP=2 (GPT-2, tied embeddings), and loaded into another layout than it was saved
in; a checkpoint of other weights fails it; and training starts from a converted checkpoint
(the converter's flags file) with HF's loss on its first batch.

Tolerance 1e-5 (fp32): HF's eager attention and our SDPA and the TP reductions sum in different
orders (observed ~1e-6). One fixture starts the runs (the real launch beside the warm ones).
"""
import importlib.util
import os
import re
import shlex
import signal
import sys

import numpy as np
import pytest
import torch

from tests.e2e.runner import ROOT, finish, start_script

TOL = 1e-5
VOCAB, LAYERS = 100, 4
VERIFY = "tools/checkpoint/verify.py"
TOKENS = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3,2,3,8,4"
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def build_hf_model(kind, seed=0):
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1))
    else:
        # LLaMA-3 at TP=4: 8 heads in 4 groups, head dim 16 (rope frequencies in every band).
        extra = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                     rope_theta=500000.0, rope_scaling=ROPE_SCALING) if kind == "llama3" \
            else dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=LAYERS,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, **extra))
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is checked too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def convert(hf_dir, save, tp, pp, layers_per_virtual_stage=None, ckpt_format="torch"):
    """tools/checkpoint/convert.py hf-to-megatron, run in this process (a folder of scripts:
    imported from its directory)."""
    tools = os.path.join(ROOT, "tools", "checkpoint")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import convert as converter

    argv = ["hf-to-megatron", "--load", str(hf_dir), "--save", str(save),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--ckpt-format", ckpt_format]
    if layers_per_virtual_stage:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_virtual_stage)]
    assert converter.main(argv) == 0


def save_word_tokenizer(directory):
    """A word-level HF tokenizer ('w0' .. 'w98', unknown words -> 99) saved next to a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(
        str(directory))


def train_flags(load):
    """pretrain_llama.py from a converted checkpoint: the flags the converter wrote (model,
    layout, --load), then another layout (TP=2 x PP=1 x DP=2; saved at TP=2 x PP=2) and mock
    data over the model's vocabulary."""
    with open(os.path.join(load, "megatron_flags.txt")) as f:
        flags = shlex.split(" ".join(line for line in f if not line.startswith("#")))
    assert flags[:2] == ["--load", str(load)]
    return flags + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """HF models and their converted checkpoints; every torchrun started at once."""
    root = tmp_path_factory.mktemp("verify")
    hf = {kind: build_hf_model(kind) for kind in ("llama", "llama3", "gpt2")}
    for kind, model in hf.items():
        model.save_pretrained(str(root / f"hf_{kind}"))
    save_word_tokenizer(root / "hf_llama3")
    build_hf_model("llama", seed=1).save_pretrained(str(root / "hf_llama_other_seed"))
    convert(root / "hf_llama", root / "llama_tp2pp2", 2, 2)
    convert(root / "hf_llama3", root / "llama3_tp4", 4, 1)
    convert(root / "hf_gpt2", root / "gpt2_tp2pp2vpp2", 2, 2, layers_per_virtual_stage=1)
    convert(root / "hf_llama_other_seed", root / "llama_other_seed", 1, 1)
    convert(root / "hf_llama", root / "llama_sharded", 2, 2, ckpt_format="torch_dist")

    def verify(kind, load, *flags, nproc=4, warm=True):
        return start_script(VERIFY, ["--hf-dir", root / f"hf_{kind}", "--load", root / load,
                                     *flags], nproc, warm=warm)

    started = {
        "llama-gqa-TP2xPP2": verify("llama", "llama_tp2pp2", "--token-ids", TOKENS),
        "llama3-rope-scaling-TP4": verify("llama3", "llama3_tp4", "--prompt",
                                          "w3 w1 w4 w1 w5 w9 w2 w6 w5 w35 w8 w97 unknown"),
        "gpt2-tied-TP2xPP2xVPP2": verify("gpt2", "gpt2_tp2pp2vpp2", "--token-ids", TOKENS),
        "llama-gqa-resharded-to-PP2xVPP2": verify(
            "llama", "llama_tp2pp2", "--token-ids", TOKENS, "--pipeline-model-parallel-size",
            "2", "--num-layers-per-virtual-pipeline-stage", "1", nproc=2),
        "llama-gqa-sharded-format-at-TP2xPP2": verify(
            "llama", "llama_sharded", "--token-ids", TOKENS, "--tensor-model-parallel-size",
            "2", "--pipeline-model-parallel-size", "2"),
        "other-seed": verify("llama", "llama_other_seed", "--token-ids", TOKENS, nproc=1,
                             warm=False),  # fails: a real launch
        "train": start_script("pretrain_llama.py", train_flags(root / "llama_tp2pp2"), 4),
    }
    runs = _Runs(started)
    yield root, hf, runs
    runs.stop()


class _Runs:
    """The started scripts; ``result(name)`` waits for one (once) and returns its output."""

    def __init__(self, started):
        self.started, self.done = started, {}

    def result(self, name):
        if name not in self.done:
            self.done[name] = finish(self.started[name], timeout=240)
        return self.done[name]

    def stop(self):  # a failed test leaves none running (torchrun's workers included)
        for popen in self.started.values():
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.communicate()


def _verified(proc):
    """(compared logits, max diff, mean KL, agreeing tokens, tokens) printed by verify.py."""
    out = proc.stdout
    count = int(re.search(r"= (\d+) logits compared", out).group(1))
    max_diff = float(re.search(r"max \|logit diff\|: ([0-9.e+-]+)", out).group(1))
    kl = float(re.search(r"mean KL\(HF \|\| ours\) per token: ([0-9.e+-]+)", out).group(1))
    agree, tokens = map(int, re.search(r"argmax agreement: (\d+)/(\d+)", out).groups())
    return count, max_diff, kl, agree, tokens


@pytest.mark.parametrize("name, layout", [
    ("llama-gqa-TP2xPP2", "TP=2 x PP=2,"),
    ("llama3-rope-scaling-TP4", "TP=4 x PP=1,"),
    ("gpt2-tied-TP2xPP2xVPP2", "TP=2 x PP=2 x VPP=2"),
    ("llama-gqa-resharded-to-PP2xVPP2", "TP=1 x PP=2 x VPP=2"),
    ("llama-gqa-sharded-format-at-TP2xPP2", "TP=2 x PP=2,"),
])
def test_converted_checkpoint_gives_hf_logits(setup, name, layout):
    proc = setup[2].result(name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert layout in proc.stdout and "note:" not in proc.stdout  # configs agree
    count, max_diff, kl, agree, tokens = _verified(proc)
    assert tokens >= 12 and count == tokens * VOCAB  # something was compared
    assert max_diff <= TOL and kl <= 1e-9 and agree == tokens
    assert "PASSED" in proc.stdout


def test_prompt_is_tokenized_with_the_hf_tokenizer(setup):
    proc = setup[2].result("llama3-rope-scaling-TP4")
    assert re.search(r"verify: 13 tokens x 100 vocab", proc.stdout), proc.stdout[-2000:]


def test_checkpoint_of_other_weights_fails(setup):
    proc = setup[2].result("other-seed")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    count, max_diff, kl, agree, tokens = _verified(proc)
    assert count == tokens * VOCAB and max_diff > 1e-2 and kl > 1e-4
    assert "FAILED: max |logit diff|" in proc.stderr and "> tolerance 1.0e-04" in proc.stderr


def test_training_starts_from_converted_checkpoint_with_hf_loss(setup):
    """pretrain_llama.py --load CONVERTED (a release: weights only, iteration 0) at another
    layout: its first loss is HF's mean loss over the same first global batch (mock samples
    0..3, which depend only on the seed and their index)."""
    from megatron.core.datasets.mock_dataset import MockGPTDataset

    root, hf, runs = setup
    proc = runs.result("train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at iteration 0" in proc.stdout and "resharded from TP=2 x PP=2" in proc.stdout
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    assert len(losses) == 2 and np.isfinite(losses).all()
    data = MockGPTDataset(2 * 4, 16, VOCAB, seed=1234, split_name="train")
    text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(4)])
    with torch.no_grad():  # each sample's mean token loss, averaged (as the loop reports it)
        logits = hf["llama"](text[:, :-1]).logits
        per_sample = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), text[:, 1:], reduction="none").mean(1)
    # The log prints 7 significant digits: <= 5e-6 of rounding, plus fp32 sums (~1e-6).
    assert abs(losses[0] - per_sample.mean().item()) <= 1e-5


# --- errors found before anything starts (in this process) ---------------------------------

def _verify_module():
    spec = importlib.util.spec_from_file_location("verify", os.path.join(ROOT, VERIFY))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_errors_name_the_problem(setup, tmp_path, capsys):
    root = setup[0]
    verify = _verify_module()
    hf_dir = str(root / "hf_llama")

    def error(*argv):
        code = verify.main([str(a) for a in argv])
        return code, capsys.readouterr().err

    code, err = error("--hf-dir", tmp_path, "--load", root / "llama_tp2pp2")
    assert code == 2 and "no config.json" in err
    code, err = error("--hf-dir", hf_dir, "--load", tmp_path / "missing")
    assert code == 1 and "no such directory" in err
    code, err = error("--hf-dir", hf_dir, "--load", tmp_path)
    assert code == 1 and "there is no checkpoint there" in err
    code, err = error("--hf-dir", hf_dir, "--load", root / "llama_tp2pp2", "--ckpt-step", "5")
    assert code == 1 and "--ckpt-step 5" in err
    foreign = tmp_path / "foreign"
    (foreign / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (foreign / "latest_checkpointed_iteration.txt").write_text("10")
    torch.save({"model": {}, "iteration": 10}, foreign / "iter_0000010" / "mp_rank_00" /
               "model_optim_rng.pt")
    code, err = error("--hf-dir", hf_dir, "--load", foreign)
    assert code == 1 and "not a checkpoint written by this project" in err
    code, err = error("--hf-dir", hf_dir, "--load", root / "llama_tp2pp2", "--token-ids", "1,x")
    assert code == 2 and "comma-separated integers" in err

    args = verify.get_parser().parse_args(["--hf-dir", hf_dir, "--load", "x",
                                           "--prompt", "hello"])
    with pytest.raises(ValueError, match="--token-ids 1,2,3 instead of a prompt"):
        verify.hf_reference(args)  # rank 0's step: a model saved without a tokenizer
    args.prompt, args.token_ids = None, "1,2,100"
    with pytest.raises(ValueError, match=r"token id 100 is outside the vocabulary \(0..99\)"):
        verify.hf_reference(args)
