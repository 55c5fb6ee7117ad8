"""The mixture-of-experts flags (Megatron's names) and their mapping onto MoEConfig."""
import argparse
import ast
from typing import Optional

from megatron.core.transformer.moe.moe_config import (
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    TOKEN_DISPATCHERS,
    TOKEN_DROP_POLICIES,
    MoEConfig,
)


def _layer_freq(text: str):
    """Megatron's --moe-layer-freq: N (every N-th layer is MoE) or a 0/1 list per layer,
    written as a list ("[1,0,1,0]") or Megatron's list expression ("([1]*3+[0])")."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        tree = None
    allowed = (ast.Expression, ast.BinOp, ast.List, ast.Constant, ast.Add, ast.Mult, ast.Load)
    if tree is None or not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a list of 0/1")
    # Only list literals of constants, + and * are left: evaluating cannot run user code.
    value = eval(compile(tree, "<moe-layer-freq>", "eval"), {"__builtins__": {}})
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of 0/1")
    return value


def add_moe_args(parser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (unset: a dense model)")
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="every N-th layer is MoE, or a 0/1 list per layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (Qwen2-MoE)")
    g.add_argument("--moe-router-topk-norm", action="store_true",
                   help="renormalise the top-k probabilities (HF's norm_topk_prob)")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                   default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: cut the experts into N groups and let each "
                        "token choose among its --moe-router-group-topk best (DeepSeek-V3's "
                        "n_group)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="groups each token may route to (DeepSeek-V3's topk_group)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiply the gate weights by this after any renormalisation "
                        "(DeepSeek-V3's routed_scaling_factor)")
    g.add_argument("--moe-router-bias", action="store_true",
                   help="a learned bias on the router's logits, trained like its weight "
                        "(gpt-oss's router bias); unrelated to --moe-router-enable-expert-bias")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-token-drop-policy", choices=TOKEN_DROP_POLICIES, default="probs")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Qwen2-MoE's sigmoid gate on the shared expert")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-token-dispatcher-type", choices=TOKEN_DISPATCHERS,
                   default="alltoall")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="each expert's own TP size (default --tensor-model-parallel-size)")


def moe_config_from_args(args) -> Optional[MoEConfig]:
    """None for a dense model (no --num-experts)."""
    if getattr(args, "num_experts", None) is None:  # saved args may predate the flags
        return None
    return MoEConfig(
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_norm=args.moe_router_topk_norm,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        # saved args may predate these three
        moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
        moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        moe_router_bias=getattr(args, "moe_router_bias", False),  # saved args may predate it
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_grouped_gemm=args.moe_grouped_gemm, moe_layer_freq=args.moe_layer_freq,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type)
