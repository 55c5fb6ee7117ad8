"""gpt-oss through the converter, in miniature: a random GptOssForCausalLM (learned sinks,
alternating 4-token windows, YaRN, biased experts and router, the clamped quick-GeGLU). HF ->
Megatron at TP 2 x EP 2 writes flags that rebuild every feature; verify.py computes HF's logits
from the checkpoint (fp32, 1e-5); Megatron -> HF gives back a GptOssForCausalLM with every
weight bit for bit, and generate.py continues a prompt from it as the original model does."""
import os

import torch

from tests.e2e.runner import ROOT, run_script
from tests.hf_checkpoints import (
    assert_generate_continues_as,
    converter,
    megatron_flags,
    read_safetensors_dir,
    save_tokenizer,
)


def _gpt_oss(path):
    import transformers

    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8}
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.4, rope_parameters=yarn,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # non-trivial biases, sinks and router, so their mapping counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    save_tokenizer(path, 256)
    return path


def test_gpt_oss_converts_both_ways_and_computes_hf_logits(tmp_path, capsys):
    import transformers

    src = _gpt_oss(str(tmp_path / "hf"))
    meg, back = tmp_path / "meg", tmp_path / "back"
    convert = converter()
    assert convert.main(["hf-to-megatron", "--load", src, "--save", str(meg),
                         "--tensor-model-parallel-size", "2",
                         "--expert-model-parallel-size", "2",
                         "--expert-tensor-parallel-size", "1"]) == 0
    flags = megatron_flags(meg)
    for flag in ("--quick-geglu", "--moe-router-bias", "--add-qkv-bias",
                 "--no-yarn-correction-range-round-to-int"):
        assert flag in flags, flag
    assert "--disable-bias-linear" not in flags
    assert flags[flags.index("--softmax-type") + 1] == "learnable"
    assert flags[flags.index("--window-size") + 1] == "3,0"
    assert flags[flags.index("--window-attn-skip-freq") + 1] == "2"
    assert flags[flags.index("--activation-func-clamp-value") + 1] == "0.4"

    ids = ",".join(str(i) for i in range(3, 19))
    proc = run_script(os.path.join(ROOT, "tools", "checkpoint", "verify.py"), [
        "--hf-dir", src, "--load", meg, "--token-ids", ids, "--tolerance", "1e-5"], nproc=4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    max_diff = float(proc.stdout.split("max |logit diff|: ")[1].split()[0])
    assert max_diff <= 1e-5, proc.stdout

    assert convert.main(["megatron-to-hf", "--load", str(meg), "--save", str(back)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "GptOssForCausalLM"
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(back))
    assert set(after) == set(before) and "model.layers.1.self_attn.sinks" in after
    for name, value in after.items():
        assert torch.equal(value, before[name]), name

    assert_generate_continues_as(
        back, transformers.AutoModelForCausalLM.from_pretrained(src).eval(), capsys)
