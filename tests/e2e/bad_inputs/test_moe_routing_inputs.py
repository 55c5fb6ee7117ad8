"""DeepSeek-V3 routing settings that cannot run, as a user types them: one ``error:`` line,
exit 2, no traceback, no iteration; all refused while the flags become configs (no training).

Group-limited routing cuts the experts into --moe-router-num-groups equal groups, scores each
by its top 2 experts and keeps the --moe-router-group-topk best: the groups must divide the
experts, hold 2 experts each, number at least the groups kept, and hold the top-k experts; the
two group flags come together; the scaling factor and the group flags need experts."""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-router-score-function",
       "sigmoid"]

CASES = [
    ("groups-do-not-divide-experts", MOE + ["--moe-router-num-groups", "3",
                                            "--moe-router-group-topk", "1"],
     ["MoEConfig.moe_router_num_groups=3 is invalid: use a divisor of num_moe_experts (8)"]),
    ("one-expert-per-group", MOE + ["--moe-router-num-groups", "8",
                                    "--moe-router-group-topk", "2"],
     ["MoEConfig.moe_router_num_groups=8 is invalid: each group needs at least 2 experts"]),
    ("group-topk-above-groups", MOE + ["--moe-router-num-groups", "2",
                                       "--moe-router-group-topk", "3"],
     ["MoEConfig.moe_router_group_topk=3 is invalid: use 1..moe_router_num_groups (2)"]),
    ("topk-outside-the-kept-groups", MOE + ["--moe-router-num-groups", "4",
                                            "--moe-router-group-topk", "1",
                                            "--moe-router-topk", "3"],
     ["MoEConfig.moe_router_topk=3 is invalid: the 1 chosen groups hold only 2 experts"]),
    ("group-flag-alone", MOE + ["--moe-router-num-groups", "4"],
     ["moe_router_num_groups and moe_router_group_topk come as a pair"]),
    ("scaling-factor-without-experts", ["--moe-router-topk-scaling-factor", "2.5"],
     ["--moe-router-topk-scaling-factor has no effect without --num-experts N"]),
    ("negative-scaling-factor", MOE + ["--moe-router-topk-scaling-factor", "-1"],
     ["--moe-router-topk-scaling-factor must be > 0, got -1.0"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_deepseek_routing_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
