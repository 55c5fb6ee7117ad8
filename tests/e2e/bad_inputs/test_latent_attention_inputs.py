"""Bad multi-latent attention settings, as a user types them: one ``error:`` line naming the
flag and the fix, exit 2, no traceback, no iteration. (Every MLA size without
--multi-latent-attention: the dependency table, tests/unit/test_flag_dependencies.py.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY, without

MLA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]

CASES = [
    ("size-without-mla", TINY + LLAMA + ["--kv-lora-rank", "16"],
     ["--kv-lora-rank has no effect without --multi-latent-attention: add "
      "--multi-latent-attention or drop --kv-lora-rank."]),
    ("without-rope", without(TINY + LLAMA, "--position-embedding-type") + MLA,
     ["multi-latent attention rotates qk_pos_emb_head_dim channels of each query and key: it "
      "needs --position-embedding-type rope"]),
    ("with-sinks", TINY + LLAMA + MLA + ["--softmax-type", "learnable"],
     ["multi-latent attention does not run attention sinks (--softmax-type learnable): drop "
      "--softmax-type."]),
    ("with-a-window", TINY + LLAMA + MLA + ["--window-size", "4,0"],
     ["multi-latent attention does not run sliding windows: drop --window-size."]),
    ("with-query-groups", TINY + LLAMA + MLA + ["--group-query-attention",
                                                "--num-query-groups", "2"],
     ["multi-latent attention has a key and a value per head, not 2 groups"]),
    ("odd-rotated-dim", TINY + LLAMA + MLA + ["--qk-pos-emb-head-dim", "3"],
     ["qk_pos_emb_head_dim must be even (RoPE turns channel pairs), got 3."]),
    ("zero-rank", TINY + LLAMA + MLA + ["--kv-lora-rank", "0"],
     ["--kv-lora-rank must be >= 1, got 0"]),
]


@pytest.mark.parametrize("flags,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_latent_attention_setting(flags, fragments):
    assert_clean_error(run("pretrain_llama.py", flags), 2, *fragments)
