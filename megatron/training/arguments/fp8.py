"""The FP8 flags (Megatron's names) and their mapping onto megatron.core.fp8.Fp8Config."""
from typing import Optional

from megatron.core.fp8 import FORMATS, RECIPES, Fp8Config
from megatron.core.fp8.config import AMAX_COMPUTE_ALGOS


def add_fp8_args(parser) -> None:
    g = parser.add_argument_group("FP8")
    g.add_argument("--fp8-format", choices=FORMATS, default=None,
                   help="train the transformer layers' linears with FP8 GEMMs: e4m3 for every "
                        "operand, or hybrid (e5m2 output gradients); unset: no FP8")
    g.add_argument("--fp8-recipe", choices=RECIPES, default="tensorwise",
                   help="current scaling per tensor, per row, or in DeepSeek-V3's 1x128 "
                        "activation tiles and 128x128 weight blocks; or delayed: per tensor, "
                        "scales from an amax history of earlier steps")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed: the steps of amax history each scale is computed from")
    g.add_argument("--fp8-amax-compute-algo", choices=AMAX_COMPUTE_ALGOS,
                   default="most_recent",
                   help="delayed: the history's most recent amax, or its max")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="scale so that each group's amax lands 2^margin below the largest "
                        "FP8 value")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="with the distributed optimizer and --fp8-recipe tensorwise, "
                        "blockwise or delayed: "
                        "all-gather the FP8 linears' updated weights as FP8 bytes (half of "
                        "bf16's), which their forward then uses as they are")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first and last transformer layers' GEMMs in high precision")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def fp8_config_from_args(args) -> Optional[Fp8Config]:
    """None without --fp8-format (saved args may predate the flags)."""
    if getattr(args, "fp8_format", None) is None:
        return None
    ends = bool(args.first_last_layers_bf16)
    return Fp8Config(format=args.fp8_format, recipe=args.fp8_recipe, margin=args.fp8_margin,
                     layers_at_start_in_high_precision=args.num_layers_at_start_in_bf16
                     if ends else 0,
                     layers_at_end_in_high_precision=args.num_layers_at_end_in_bf16
                     if ends else 0,
                     amax_history_len=getattr(args, "fp8_amax_history_len", 1),
                     amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "most_recent"))
