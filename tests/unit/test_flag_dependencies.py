"""arguments/dependencies.py: every flag that means something only with another is refused
alone, with its one-line message, and parses with its partner; a flag counts as given only
when the command line set it to a value other than its default."""
import argparse

import pytest

from megatron.training.arguments import ConfigError, get_parser, parse_args, validate_args
from megatron.training.arguments.dependencies import DEPENDENCIES
from tests.unit.test_arguments import small

MOE = ["--num-experts", "4"]
BY_SAMPLES = [a for a in small() if a not in ("--train-iters", "10")] + ["--train-samples",
                                                                          "100"]

# (flag, needs) -> (the command line with the flag alone, what to add so that it parses).
# small(): learned positions, Adam, fp32, PP = CP = 1, no MoE, no --save/--load/logging dirs.
EXAMPLES = {
    **{(flag, "--num-experts N"): (small(flag, *value), MOE) for flag, value in {
        "--moe-layer-freq": ["2"], "--moe-ffn-hidden-size": ["32"],
        "--moe-router-topk": ["4"], "--moe-router-score-function": ["sigmoid"],
        "--moe-router-pre-softmax": [], "--moe-router-topk-norm": [],
        "--moe-router-load-balancing-type": ["seq_aux_loss"], "--moe-aux-loss-coeff": ["0.01"],
        "--moe-z-loss-coeff": ["0.001"], "--moe-router-enable-expert-bias": [],
        "--moe-router-bias-update-rate": ["0.01"], "--moe-router-bias": [],
        "--moe-router-num-groups": ["2"], "--moe-router-group-topk": ["1"],
        "--moe-router-topk-scaling-factor": ["2.5"],
        "--moe-expert-capacity-factor": ["1.0"],
        "--moe-token-drop-policy": ["position"], "--moe-pad-expert-input-to-capacity": [],
        "--moe-shared-expert-intermediate-size": ["24"], "--moe-shared-expert-gate": [],
        "--moe-grouped-gemm": [], "--moe-token-dispatcher-type": ["allgather"],
        "--expert-model-parallel-size": ["2"], "--expert-tensor-parallel-size": ["2"]}.items()},
    # The flags with a second partner inside MoE (their next rows) need it too, to parse.
    **{(flag, "--num-experts N"): (small(flag, *value), MOE + partner) for flag, value, partner in (
        ("--moe-router-bias-update-rate", ["0.01"], ["--moe-router-enable-expert-bias"]),
        ("--moe-token-drop-policy", ["position"], ["--moe-expert-capacity-factor", "1"]),
        ("--moe-pad-expert-input-to-capacity", [], ["--moe-expert-capacity-factor", "1"]),
        ("--moe-shared-expert-gate", [], ["--moe-shared-expert-intermediate-size", "8"]))},
    ("--moe-router-bias-update-rate", "--moe-router-enable-expert-bias"): (
        small(*MOE, "--moe-router-bias-update-rate", "0.01"), ["--moe-router-enable-expert-bias"]),
    ("--moe-token-drop-policy", "--moe-expert-capacity-factor F"): (
        small(*MOE, "--moe-token-drop-policy", "position"), ["--moe-expert-capacity-factor", "1"]),
    ("--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor F"): (
        small(*MOE, "--moe-pad-expert-input-to-capacity"), ["--moe-expert-capacity-factor", "1"]),
    ("--moe-shared-expert-gate", "--moe-shared-expert-intermediate-size N"): (
        small(*MOE, "--moe-shared-expert-gate"), ["--moe-shared-expert-intermediate-size", "8"]),
    **{(flag, "--pipeline-model-parallel-size N (N >= 2)"): (
        small(flag, *value), ["--pipeline-model-parallel-size", "2"]) for flag, value in {
        "--pipeline-schedule": ["1f1b"], "--account-for-embedding-in-pipeline-split": [],
        "--account-for-loss-in-pipeline-split": []}.items()},
    ("--cp-comm-type", "--context-parallel-size N (N >= 2)"): (
        small("--cp-comm-type", "all_gather"), ["--context-parallel-size", "2"]),
    ("--overlap-param-gather", "--use-distributed-optimizer"): (
        small("--overlap-param-gather"), ["--use-distributed-optimizer"]),
    ("--shard-gradients", "--use-distributed-optimizer"): (
        small("--shard-gradients"), ["--use-distributed-optimizer"]),
    ("--fp8-param-gather", "--use-distributed-optimizer"): (
        small("--fp8-format", "e4m3", "--fp8-param-gather"), ["--use-distributed-optimizer"]),
    ("--fp8-param-gather", "--fp8-format e4m3|hybrid"): (
        small("--use-distributed-optimizer", "--fp8-param-gather"), ["--fp8-format", "e4m3"]),
    ("--reduce-bucket-size", "--overlapped-distributed-optimizer"): (
        small("--reduce-bucket-size=2e8"), ["--overlapped-distributed-optimizer"]),
    ("--no-reshard-after-forward", "--use-torch-fsdp2"): (
        small("--no-reshard-after-forward"), ["--use-torch-fsdp2"]),
    ("--fsdp2-reduce-gradients-once", "--use-torch-fsdp2"): (
        small("--fsdp2-reduce-gradients-once"), ["--use-torch-fsdp2"]),
    **{(flag, "--recompute-granularity full"): (
        small(flag, *value), ["--recompute-granularity", "full"]) for flag, value in {
        "--recompute-method": ["uniform"], "--recompute-num-layers": ["1"],
        "--distribute-saved-activations": []}.items()},
    **{(flag, "--fp16"): (small(flag, value), ["--fp16"]) for flag, value in {
        "--loss-scale": "128", "--initial-loss-scale": "65536", "--min-loss-scale": "2",
        "--loss-scale-window": "500", "--hysteresis": "3"}.items()},
    ("--grad-reduce-in-bf16", "--bf16"): (small("--grad-reduce-in-bf16"), ["--bf16"]),
    **{(flag, "--swiglu or --quick-geglu"): (small(flag, value), ["--quick-geglu"])
       for flag, value in {"--glu-linear-offset": "1", "--activation-func-clamp-value": "7"
                           }.items()},
    ("--window-attn-skip-freq", "--window-size LEFT,0"): (
        small("--window-attn-skip-freq", "2"), ["--window-size", "7,0"]),
    ("--mtp-loss-scaling-factor", "--mtp-num-layers D"): (
        small("--mtp-loss-scaling-factor", "0.3"), ["--mtp-num-layers", "1"]),
    **{(flag, "--multi-latent-attention"): (
        small(flag, *value), ["--multi-latent-attention", "--position-embedding-type", "rope"])
       for flag, value in {"--q-lora-rank": ["12"], "--kv-lora-rank": ["16"],
                           "--qk-head-dim": ["8"], "--qk-pos-emb-head-dim": ["4"],
                           "--v-head-dim": ["6"], "--rotary-interleaved": []}.items()},
    **{(flag, "--fp8-format e4m3|hybrid"): (small(flag, *value), ["--fp8-format", "e4m3"])
       for flag, value in {"--fp8-recipe": ["rowwise"], "--fp8-margin": ["1"],
                           "--first-last-layers-bf16": []}.items()},
    **{(flag, "--first-last-layers-bf16"): (
        small("--fp8-format", "e4m3", flag, "2"), ["--first-last-layers-bf16"])
       for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16")},
    **{(flag, "--fp8-recipe delayed"): (
        small("--fp8-format", "e4m3", flag, value), ["--fp8-recipe", "delayed"])
       for flag, value in (("--fp8-amax-history-len", "4"), ("--fp8-amax-compute-algo", "max"))},
    **{(flag, "--position-embedding-type rope"): (
        small(flag, *value), ["--position-embedding-type", "rope"]) for flag, value in {
        "--rotary-base": ["500000"], "--rotary-percent": ["0.5"],
        "--use-rope-scaling": [], "--rope-type": ["yarn"]}.items()},
    **{(flag, "--rope-type yarn"): (
        small("--position-embedding-type", "rope", flag, *value), ["--rope-type", "yarn"])
       for flag, value in {"--rotary-scaling-factor": ["32"],
                           "--original-max-position-embeddings": ["8192"],
                           "--beta-fast": ["16"], "--beta-slow": ["2"], "--mscale": ["0.707"],
                           "--mscale-all-dim": ["0.707"],
                           "--no-yarn-correction-range-round-to-int": [],
                           "--yarn-attention-factor": ["1.2"]}.items()},
    **{(flag, "--use-rope-scaling"): (
        small("--position-embedding-type", "rope", flag, value), ["--use-rope-scaling"])
       for flag, value in {"--rope-scaling-factor": "16", "--rope-low-freq-factor": "2",
                           "--rope-high-freq-factor": "8",
                           "--rope-original-max-position-embeddings": "4096"}.items()},
    ("--lr-wsd-decay-style", "--lr-decay-style WSD"): (
        small("--lr-wsd-decay-style", "linear"), ["--lr-decay-style", "WSD"]),
    ("--lr-wsd-decay-iters", "--lr-decay-style WSD"): (
        small("--lr-wsd-decay-iters", "4"), ["--lr-decay-style", "WSD"]),
    ("--lr-wsd-decay-samples", "--lr-decay-style WSD"): (
        BY_SAMPLES + ["--lr-wsd-decay-samples", "40"], ["--lr-decay-style", "WSD"]),
    ("--lr-warmup-init", "a warmup (--lr-warmup-iters, --lr-warmup-samples or "
                         "--lr-warmup-fraction)"): (
        small("--lr-warmup-init", "1e-5"), ["--lr-warmup-iters", "2"]),
    ("--sgd-momentum", "--optimizer sgd"): (small("--sgd-momentum", "0.5"),
                                            ["--optimizer", "sgd"]),
    **{(flag, "--optimizer adam"): (small("--optimizer", "sgd", flag, value),
                                    ["--optimizer", "adam"])
       for flag, value in {"--adam-beta1": "0.8", "--adam-beta2": "0.95",
                           "--adam-eps": "1e-6"}.items()},
    **{(flag, "--optimizer muon"): (small(flag, *value), ["--optimizer", "muon"])
       for flag, value in {"--muon-momentum": ["0.9"], "--muon-use-nesterov": [],
                           "--muon-num-ns-steps": ["6"], "--muon-scale-mode": ["shape_scaling"],
                           "--muon-extra-scale-factor": ["0.2"], "--muon-split-qkv": [],
                           "--muon-ns-dtype": ["bf16"]}.items()},
    **{(flag, "--qk-clip"): (small(flag, value), ["--qk-clip"])
       for flag, value in {"--qk-clip-threshold": "50", "--qk-clip-alpha": "0.3"}.items()},
    **{(flag, "--save DIR"): (small(flag, *value), ["--save", "ck"]) for flag, value in {
        "--save-interval": ["5"], "--no-save-optim": [], "--no-save-rng": [],
        "--async-save": []}.items()},
    **{(flag, "--load DIR"): (small(flag, *value), ["--load", "ck"]) for flag, value in {
        "--no-load-optim": [], "--no-load-rng": [], "--finetune": [],
        "--ckpt-step": ["3"]}.items()},
    ("--ckpt-format", "--save DIR or --load DIR"): (small("--ckpt-format", "torch"),
                                                    ["--load", "ck"]),
    ("--tensorboard-queue-size", "--tensorboard-dir DIR"): (
        small("--tensorboard-queue-size", "10"), ["--tensorboard-dir", "tb"]),
    **{(flag, "--tensorboard-dir DIR or --wandb-project NAME"): (
        small(flag), ["--wandb-project", "p"]) for flag in (
        "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard")},
    ("--wandb-exp-name", "--wandb-project NAME"): (small("--wandb-exp-name", "run"),
                                                   ["--wandb-project", "p"]),
    ("--wandb-save-dir", "--wandb-project NAME"): (small("--wandb-save-dir", "wb"),
                                                   ["--wandb-project", "p"]),
    ("--pipeline-trace-iteration", "--pipeline-trace-dir DIR"): (
        small("--pipeline-trace-iteration", "3"), ["--pipeline-trace-dir", "traces"]),
    **{(flag, "--tokenizer-type TikTokenizer"): (
        small(flag, *value), ["--tokenizer-type", "TikTokenizer"]) for flag, value in {
        "--tiktoken-pattern": ["llama3"], "--tiktoken-num-special-tokens": ["10"],
        "--tiktoken-special-tokens": ["<unk>", "<s>", "</s>"]}.items()},
}
ROWS = {(row.flag, row.needs): row for row in DEPENDENCIES}


def test_every_row_has_an_example_and_names_a_real_flag():
    assert len(ROWS) == len(DEPENDENCIES)  # no row twice
    assert set(EXAMPLES) == set(ROWS)
    known = get_parser()._option_string_actions
    assert all(row.flag in known for row in DEPENDENCIES)


@pytest.mark.parametrize("key", list(ROWS), ids=[f"{f} needs {n}" for f, n in ROWS])
def test_flag_alone_is_refused_and_parses_with_its_partner(key):
    row, (alone, partner) = ROWS[key], EXAMPLES[key]
    with pytest.raises(ConfigError) as info:
        parse_args(alone)
    assert str(info.value) == row.message()
    assert str(info.value) == (f"{row.flag} has no effect without {row.needs}: add "
                               f"{row.needs} or drop {row.flag}.")
    parse_args(alone + partner)


def test_the_message_of_the_issue():
    with pytest.raises(ConfigError, match=r"^--moe-router-topk has no effect without "
                                          r"--num-experts N: add --num-experts N or drop "
                                          r"--moe-router-topk\.$"):
        parse_args(small("--moe-router-topk=4"))  # the --flag=value form counts too


@pytest.mark.parametrize("extra", [
    ["--expert-model-parallel-size", "1"], ["--moe-router-topk", "2"],
    ["--cp-comm-type", "p2p"], ["--reduce-bucket-size", "5e8"], ["--adam-beta1", "0.9"],
    ["--ckpt-format", "torch_dist"], ["--pipeline-trace-iteration", "2"]],
    ids=lambda extra: extra[0])
def test_a_flag_given_at_its_default_value_is_let_through(extra):
    """It changes nothing with or without its partner (Megatron's scripts pass some)."""
    parse_args(small(*extra))


def test_only_the_command_line_counts():
    """A Namespace from a checkpoint has no command line; a value after -- is no flag."""
    args = get_parser().parse_args(small())
    args.moe_router_topk, args.loss_scale = 4, 128.0
    assert validate_args(args).moe_router_topk == 4
    parser = get_parser()
    parser.add_argument("rest", nargs="*")
    assert parse_args(small("--", "--fp16", "--loss-scale"), parser).rest == [
        "--fp16", "--loss-scale"]


def test_an_abbreviation_counts_where_the_parser_allows_them():
    parser = get_parser()
    parser.allow_abbrev = True  # ours does not; a script's own parser might
    with pytest.raises(ConfigError, match="^--moe-aux-loss-coeff has no effect without"):
        parse_args(small("--moe-aux-loss", "0.01"), parser)
    assert isinstance(parse_args(small("--moe-aux-loss", "0.01", *MOE), parser),
                      argparse.Namespace)
