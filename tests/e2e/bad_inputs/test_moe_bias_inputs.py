"""gpt-oss-style MoE settings that cannot run, as a user types them: one ``error:`` line, exit
2, no traceback, no iteration; all refused while the flags become configs (no training).

- Biased experts (no --disable-bias-linear) with expert tensor parallelism: each expert-TP
  rank would add fc2's bias to its partial output, so the sum would hold it ETP times.
- The activation's clamp or offset without a gated activation: the dependency table.
"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import TINY

# pretrain_gpt.py: biases on (GPT-2's default); quick-GeGLU experts as gpt-oss's
GPT_OSS_MOE = ["--quick-geglu", "--num-experts", "4", "--moe-router-bias"]
ETP_2 = ["--expert-tensor-parallel-size", "2"]
BIASED_ETP = ["MoE experts with biases (no --disable-bias-linear) need "
              "expert_tensor_parallel_size 1, got 2",
              "add --expert-tensor-parallel-size 1 or --disable-bias-linear."]

CASES = [
    ("biased-experts-with-etp", GPT_OSS_MOE + ETP_2, {"WORLD_SIZE": "2"}, BIASED_ETP),
    ("clamped-biased-experts-with-etp",
     GPT_OSS_MOE + ETP_2 + ["--activation-func-clamp-value", "7", "--glu-linear-offset", "1"],
     {"WORLD_SIZE": "2"}, BIASED_ETP),
    ("clamp-without-gated-activation", ["--activation-func-clamp-value", "7"], None,
     ["--activation-func-clamp-value has no effect without --swiglu or --quick-geglu"]),
    ("quick-geglu-and-swiglu", ["--quick-geglu", "--swiglu"], None,
     ["--swiglu and --quick-geglu both choose the MLP activation; give one."]),
    ("negative-clamp", ["--quick-geglu", "--activation-func-clamp-value", "-1"], None,
     ["--activation-func-clamp-value must be > 0, got -1.0"]),
]


@pytest.mark.parametrize("extra,env,fragments", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_gpt_oss_moe_setting(extra, env, fragments):
    assert_clean_error(run("pretrain_gpt.py", TINY + extra, env), 2, *fragments)
