"""DeepSeek-V3 through the converter, in miniature: a random DeepseekV3ForCausalLM (multi-latent
attention with the query latent, a dense first layer, 8 experts in 4 groups of which 2 are
chosen, sigmoid routing with the correction bias and a scaling factor, a shared expert). HF ->
Megatron at TP 2 x EP 2 writes flags that rebuild every feature; verify.py computes HF's logits
from the checkpoint at TP 2 x EP 2 (fp32, 1e-5); Megatron -> HF gives back a DeepseekV3ForCausalLM with every
weight (and the correction bias buffer) bit for bit, and generate.py continues a prompt from it
as the original model does."""
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


def deepseek_v3_model(**overrides):
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=12,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2), **overrides})
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, router and correction bias (a buffer), so
        for p in model.parameters():  # their mapping counts
            p.add_(torch.randn_like(p) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return model.eval()


def test_deepseek_v3_converts_both_ways_and_computes_hf_logits(tmp_path, capsys):
    import transformers

    src = str(tmp_path / "hf")
    deepseek_v3_model().save_pretrained(src)
    save_tokenizer(src, 256)
    meg, back = tmp_path / "meg", tmp_path / "back"
    convert = converter()
    assert convert.main(["hf-to-megatron", "--load", src, "--save", str(meg),
                         "--tensor-model-parallel-size", "2",
                         "--expert-model-parallel-size", "2",
                         "--expert-tensor-parallel-size", "1"]) == 0
    flags = megatron_flags(meg)
    for flag in ("--multi-latent-attention", "--rotary-interleaved", "--qk-layernorm",
                 "--moe-router-enable-expert-bias", "--moe-router-topk-norm"):
        assert flag in flags, flag
    assert "--group-query-attention" not in flags and "--moe-shared-expert-gate" not in flags
    expected = {"--q-lora-rank": "12", "--kv-lora-rank": "16", "--qk-head-dim": "8",
                "--qk-pos-emb-head-dim": "4", "--v-head-dim": "6", "--kv-channels": "12",
                "--moe-router-score-function": "sigmoid", "--moe-router-num-groups": "4",
                "--moe-router-group-topk": "2", "--moe-router-topk-scaling-factor": "2.5",
                "--moe-shared-expert-intermediate-size": "12", "--moe-layer-freq": "[0,1,1]"}
    for flag, value in expected.items():
        assert flags[flags.index(flag) + 1] == value, flag

    ids = ",".join(str(i) for i in range(3, 19))
    proc = run_script(os.path.join(ROOT, "tools", "checkpoint", "verify.py"), [
        "--hf-dir", src, "--load", meg, "--token-ids", ids, "--tolerance", "1e-5",
        "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1"], nproc=4)  # MLA's heads split over TP
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TP=2 x PP=1 x EP=2 x expert TP=1" in proc.stdout, proc.stdout
    assert "note:" not in proc.stdout, proc.stdout  # no architecture field differs
    max_diff = float(proc.stdout.split("max |logit diff|: ")[1].split()[0])
    assert max_diff <= 1e-5, proc.stdout

    assert convert.main(["megatron-to-hf", "--load", str(meg), "--save", str(back)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.first_k_dense_replace == 1 and model.config.n_group == 4
    before, after = read_safetensors_dir(src), read_safetensors_dir(str(back))
    assert set(after) == set(before)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in after
    for name, value in after.items():
        assert torch.equal(value, before[name]), name

    assert_generate_continues_as(
        back, transformers.AutoModelForCausalLM.from_pretrained(src).eval(), capsys)
