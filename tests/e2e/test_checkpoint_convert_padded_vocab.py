"""A model padded by its authors (Qwen: 151,936 embedding rows for ~151,669 tokens), in
miniature: a random Qwen2 of 300 rows with a 260-token tokenizer (300 is no multiple of 128).
HF -> Megatron keeps the 300 rows and says --padded-vocab-size 300 in megatron_flags.txt; our
logits equal HF's (fp32, verify.py); training runs from those flags with the HF tokenizer; the
trained checkpoint converts back to a 300-row Qwen2ForCausalLM that transformers loads."""
import os
import shlex

import torch

from tests.e2e.runner import ROOT, parse_iterations, run_script
from tests.hf_checkpoints import converter, read_safetensors_dir, save_tokenizer

ROWS, TOKENS = 300, 260


def _qwen2(path):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and q/k/v biases, so their mapping is checked
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    save_tokenizer(path, TOKENS)
    return path


def _flags(checkpoint_dir):
    with open(os.path.join(checkpoint_dir, "megatron_flags.txt")) as f:
        return shlex.split(" ".join(ln for ln in f.read().splitlines() if not ln.startswith("#")))


def test_padded_vocabulary_survives_conversion_and_training(tmp_path, capsys):
    import transformers

    src = _qwen2(str(tmp_path / "hf"))
    meg, trained, back = tmp_path / "meg", tmp_path / "trained", tmp_path / "back"
    convert = converter()
    assert convert.main(["hf-to-megatron", "--load", src, "--save", str(meg)]) == 0
    assert f"--padded-vocab-size {ROWS}" in capsys.readouterr().err  # the note says so
    flags = _flags(meg)
    assert flags[flags.index("--padded-vocab-size") + 1] == str(ROWS)
    assert "--add-qkv-bias" in flags and "--make-vocab-size-divisible-by" not in flags

    # Our model from the checkpoint computes HF's logits (all 300 rows, ids of real tokens).
    ids = ",".join(str(i) for i in torch.randint(0, TOKENS, (16,), generator=torch.Generator()
                                                 .manual_seed(1)).tolist())
    proc = run_script(os.path.join(ROOT, "tools", "checkpoint", "verify.py"), [
        "--hf-dir", src, "--load", meg, "--token-ids", ids, "--tolerance", "1e-5"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"16 tokens x {ROWS} vocab" in proc.stdout
    max_diff = float(proc.stdout.split("max |logit diff|: ")[1].split()[0])
    assert max_diff <= 1e-5, proc.stdout

    # Two iterations from the flags as written (HF tokenizer: 260 tokens, 300 rows).
    proc = run_script("pretrain_llama.py", flags + [
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--log-interval", "1",
        "--eval-iters", "0", "--save", trained])
    assert [i for i, _, _ in parse_iterations(proc)] == [1, 2], proc.stderr[-2000:]
    assert f"loaded checkpoint from {meg}/release at iteration 0" in proc.stdout

    assert convert.main(["megatron-to-hf", "--load", str(trained), "--save", str(back)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == ROWS
    before, after = read_safetensors_dir(src), model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert after[name].shape == (ROWS, 64), name
        assert not torch.equal(after[name][:TOKENS], before[name][:TOKENS]), name  # trained
        # The padding rows came through (no token reaches them: only weight decay moves
        # them), not zeros as rows dropped by the checkpoint would be.
        torch.testing.assert_close(after[name][TOKENS:], before[name][TOKENS:], rtol=0,
                                   atol=1e-4)
    assert after["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
