"""Qwen3 dense through the converter, in miniature: a random Qwen3ForCausalLM with a head dim
of its own (32, with hidden 64 and 4 heads), q/k norms and tied embeddings. HF -> Megatron at
TP 2 writes flags that say --qk-layernorm and --kv-channels 32; verify.py computes HF's logits
from the checkpoint (fp32, 1e-5); Megatron -> HF gives back a Qwen3ForCausalLM with every
weight bit for bit."""
import os

import torch

from tests.e2e.runner import ROOT, run_script
from tests.hf_checkpoints import converter, megatron_flags, read_safetensors_dir, save_tokenizer


def _qwen3(path):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, so the q/k norms' mapping is checked
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    save_tokenizer(path, 256)
    return path


def test_qwen3_converts_both_ways_and_computes_hf_logits(tmp_path):
    import transformers

    src = _qwen3(str(tmp_path / "hf"))
    meg, back = tmp_path / "meg", tmp_path / "back"
    convert = converter()
    assert convert.main(["hf-to-megatron", "--load", src, "--save", str(meg),
                         "--tensor-model-parallel-size", "2"]) == 0
    flags = megatron_flags(meg)
    assert "--qk-layernorm" in flags and flags[flags.index("--kv-channels") + 1] == "32"
    assert "--untie-embeddings-and-output-weights" not in flags

    ids = ",".join(str(i) for i in range(3, 19))
    proc = run_script(os.path.join(ROOT, "tools", "checkpoint", "verify.py"), [
        "--hf-dir", src, "--load", meg, "--token-ids", ids, "--tolerance", "1e-5"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    max_diff = float(proc.stdout.split("max |logit diff|: ")[1].split()[0])
    assert max_diff <= 1e-5, proc.stdout

    assert convert.main(["megatron-to-hf", "--load", str(meg), "--save", str(back)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 32
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(back))
    assert set(after) <= set(before) and "model.layers.1.self_attn.k_norm.weight" in after
    for name, value in after.items():
        assert torch.equal(value, before[name]), name
