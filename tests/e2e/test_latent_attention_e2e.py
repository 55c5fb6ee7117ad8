"""pretrain_llama.py with DeepSeek-V3's multi-latent attention (both latents and their norms,
interleaved RoPE under YaRN with mscale_all_dim, a value head narrower than the query/key
head) at TP=2 with sequence parallelism x PP=2 on 4 processes gives one process's losses,
10 iterations and the validations, within 1e-5 (fp32)."""
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without

TOL = 1e-5
MLA = ("--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 16 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --rotary-interleaved "
       "--rope-type yarn --rotary-scaling-factor 4 --original-max-position-embeddings 4 "
       "--mscale 1 --mscale-all-dim 1").split()


def test_latent_attention_tp2_sp_pp2_equals_one_process():
    model = without(TINY, "--train-iters") + ["--train-iters", "10"] + LLAMA + MLA
    single, single_valid = parse_losses(run_script("pretrain_llama.py", model))
    parallel, parallel_valid = parse_losses(run_script(
        "pretrain_llama.py", model + ["--tensor-model-parallel-size", "2",
                                      "--sequence-parallel",
                                      "--pipeline-model-parallel-size", "2"], nproc=4))
    assert len(single) == 10 and len(single_valid) == len(parallel_valid) > 0
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
