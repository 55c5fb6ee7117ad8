"""Megatron flags -> configs: a real Megatron-LLaMA launch line, the current spellings, and every
validation message."""
import shlex

import pytest
import torch

from megatron.training.arguments import NOOP_FLAGS, ConfigError, build_configs, parse_args

LAUNCH = """--finetune --sequence-parallel --tensor-model-parallel-size 2
--pipeline-model-parallel-size 1 --num-layers 40 --hidden-size 5120 --num-attention-heads 40
--seq-length 2048 --max-position-embeddings 2048 --no-position-embedding
--use-rotary-position-embeddings --swiglu --ffn-hidden-size 13824 --disable-bias-linear --RMSNorm
--attention-dropout 0 --hidden-dropout 0 --layernorm-epsilon 1e-6 --causal-lm
--tokenizer-type PretrainedFromHF --tokenizer-name-or-path {tok} --make-vocab-size-divisible-by 1
--init-method-std 0.01 --micro-batch-size 2 --global-batch-size 64 --train-iters 1000
--lr 6.0e-5 --lr-decay-iters 10 --lr-warmup-iters 5 --min-lr 6.0e-6
--override-opt_param-scheduler --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
--clip-grad 1.0 --weight-decay 0.1 --overlapped-distributed-optimizer --reduce-bucket-size=2e8
--no-gradient-accumulation-fusion --dataloader-type cyclic --data-impl mmap
--data-path "0.2 {d}/D1 0.3 {d}/D2 0.5 {d}/D3" --split 98,2,0 --eval-interval 1000
--eval-iters 10 --save-interval 100 --save {ck} --load {ck} --no-load-optim --log-interval 1
--tensorboard-dir {tb} --tensorboard-queue-size 1000 --log-timers-to-tensorboard
--log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --job-name NAME --bf16
--recompute-activations --recompute-granularity selective --use-flash-attn"""


@pytest.fixture
def files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("D1", "D2", "D3"):
        for ext in (".bin", ".idx"):
            (data / f"{name}{ext}").write_bytes(b"")
    (tmp_path / "tok").mkdir()
    return dict(d=str(data), tok=str(tmp_path / "tok"), ck=str(tmp_path / "ck"),
                tb=str(tmp_path / "tb"))


def launch_argv(files):
    return shlex.split(LAUNCH.format(**files))


def small(*extra):
    """A minimal valid command line (mock data, NullTokenizer) plus ``extra``."""
    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 100")
    return shlex.split(base) + list(extra)


def error_of(argv, world_size=1):
    with pytest.raises(ConfigError) as info:
        build_configs(parse_args(argv), world_size)
    return str(info.value)


def test_launch_line_maps_to_configs(files):
    args = parse_args(launch_argv(files))
    cfg = build_configs(args, world_size=8)
    t, o, d, s, tr = cfg.transformer, cfg.optimizer, cfg.ddp, cfg.scheduler_kwargs, cfg.training
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) == (2, 1)
    assert t.sequence_parallel and t.virtual_pipeline_model_parallel_size is None
    assert (t.num_layers, t.hidden_size, t.num_attention_heads) == (40, 5120, 40)
    assert t.num_query_groups == 40 and t.kv_channels == 128
    assert t.max_position_embeddings == 2048 and t.position_embedding_type == "rope"
    assert t.activation == "swiglu" and t.ffn_hidden_size == 13824
    assert not t.add_bias_linear and not t.add_qkv_bias
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == 1e-6
    assert t.attention_dropout == 0.0 and t.hidden_dropout == 0.0 and t.init_method_std == 0.01
    assert t.params_dtype == torch.bfloat16 and o.bf16 and not o.fp16
    assert o.params_dtype == torch.bfloat16
    assert t.recompute_granularity == "selective" and t.recompute_method is None
    assert o.overlapped_distributed_optimizer and not o.use_distributed_optimizer and o.sharded
    assert (o.lr, o.min_lr, o.adam_beta1, o.adam_beta2) == (6e-5, 6e-6, 0.9, 0.95)
    assert (o.clip_grad, o.weight_decay) == (1.0, 0.1)
    assert d.bucket_size == 200_000_000 and isinstance(args.reduce_bucket_size, int)
    assert d.use_distributed_optimizer and d.overlap_grad_reduce and d.overlap_param_gather
    assert d.grad_reduce_in_fp32  # Megatron-LM: bf16 gradients are accumulated in fp32
    # Megatron's scheduler counts samples: iterations x global batch.
    assert s["max_lr"] == 6e-5 and s["min_lr"] == 6e-6 and s["lr_decay_style"] == "cosine"
    assert s["lr_warmup_steps"] == 5 * 64 and s["lr_decay_steps"] == 10 * 64
    assert s["wd_incr_steps"] == 1000 * 64 and s["start_wd"] == s["end_wd"] == 0.1
    assert s["override_opt_param_scheduler"] and not s["use_checkpoint_opt_param_scheduler"]
    prefixes, weights = cfg.dataset.blend()
    assert prefixes == [f"{files['d']}/D{i}" for i in (1, 2, 3)]
    assert weights == pytest.approx([0.2, 0.3, 0.5])
    assert cfg.dataset.split_weights == pytest.approx([0.98, 0.02, 0.0])
    assert cfg.dataset.seq_length == 2048 and not cfg.dataset.mock
    assert (tr.micro_batch_size, tr.global_batch_size, tr.data_parallel_size) == (2, 64, 4)
    assert tr.num_microbatches == 8 and tr.train_iters == 1000 and tr.train_samples is None
    assert (tr.eval_interval, tr.eval_iters, tr.save_interval, tr.log_interval) == (1000, 10,
                                                                                   100, 1)
    assert tr.save == tr.load == files["ck"] and tr.no_load_optim and not tr.no_load_rng
    assert tr.finetune and tr.dataloader_type == "cyclic" and tr.job_name == "NAME"
    assert tr.tensorboard_dir == files["tb"] and tr.tensorboard_queue_size == 1000
    assert tr.log_timers_to_tensorboard and tr.log_batch_size_to_tensorboard
    assert tr.log_validation_ppl_to_tensorboard and tr.log_learning_rate_to_tensorboard
    assert tr.device is None and tr.peak_tflops is None
    assert cfg.model_kwargs["share_embeddings_and_output_weights"]
    # Accepted no-ops are recorded, and args stay plain data for checkpoints.
    assert args.use_flash_attn and args.causal_lm and not args.gradient_accumulation_fusion
    assert args.data_impl == "mmap" and args.tokenizer_type == "PretrainedFromHF"
    assert all(isinstance(v, (type(None), bool, int, float, str, list)) for v in vars(args).values())


def test_modern_spellings():
    argv = small("--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
                 "--position-embedding-type", "rope", "--group-query-attention",
                 "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                 "--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "32",
                 "--swiglu", "--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "1e6",
                 "--accumulate-allreduce-grads-in-fp32", "--fp16", "--seed", "7",
                 "--loss-scale-window", "500", "--initial-loss-scale", "65536",
                 "--min-loss-scale", "2", "--hysteresis", "3", "--adam-eps", "1e-6",
                 "--lr-warmup-fraction", "0.1", "--lr-warmup-init", "1e-5",
                 "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
                 "--end-weight-decay", "0.1", "--lr-decay-style", "WSD",
                 "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "4",
                 "--use-checkpoint-opt_param-scheduler", "--no-load-rng", "--ckpt-step", "20",
                 "--async-save", "--save", "ck", "--load", "ck", "--exit-interval", "5",
                 "--exit-duration-in-mins", "1.5",
                 "--eval-iters", "3", "--device", "cpu", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1",
                 "--distribute-saved-activations")
    cfg = build_configs(parse_args(argv), world_size=4)
    t, o, d, s, tr = cfg.transformer, cfg.optimizer, cfg.ddp, cfg.scheduler_kwargs, cfg.training
    assert t.normalization == "RMSNorm" and t.position_embedding_type == "rope"
    assert t.num_query_groups == 2 and t.rotary_base == 500000.0 and t.rope_scaling_factor == 32
    assert t.activation == "swiglu" and t.ffn_hidden_size == 128  # int(4*64*2/3 / 64) * 64
    assert t.virtual_pipeline_model_parallel_size == 2 and t.params_dtype == torch.float16
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == (
        "full", "uniform", 1) and t.distribute_saved_activations
    assert not cfg.model_kwargs["share_embeddings_and_output_weights"]
    assert o.fp16 and o.use_distributed_optimizer and o.adam_eps == 1e-6
    assert (o.loss_scale_window, o.initial_loss_scale, o.min_loss_scale, o.hysteresis) == (
        500, 65536, 2, 3)
    assert d.use_distributed_optimizer and d.overlap_grad_reduce and d.overlap_param_gather
    assert d.grad_reduce_in_fp32 and d.bucket_size == 1_000_000
    gbs = 2 * 2  # default global batch: micro x DP (world 4 / PP 2)
    assert tr.global_batch_size == gbs and s["lr_decay_steps"] == 10 * gbs
    assert s["lr_warmup_steps"] == pytest.approx(0.1 * 10 * gbs) and s["init_lr"] == 1e-5
    assert (s["start_wd"], s["end_wd"], s["wd_incr_style"]) == (0.0, 0.1, "linear")
    assert s["wsd_decay_steps"] == 4 * gbs and s["lr_wsd_decay_style"] == "linear"
    assert s["use_checkpoint_opt_param_scheduler"]
    assert tr.seed == 7 and cfg.dataset.seed == 7 and cfg.dataset.mock
    assert cfg.dataset.vocab_size == 100 and tr.no_load_rng and tr.ckpt_step == 20
    assert tr.async_save and tr.exit_interval == 5 and tr.exit_duration_in_mins == 1.5
    assert tr.eval_iters == 3 and tr.device == "cpu"


def test_train_samples_and_pipeline_split():
    argv = [a for a in small() if a not in ("--train-iters", "10")] + [
        "--train-samples", "1000", "--lr-warmup-samples", "100", "--lr-decay-samples", "800",
        "--pipeline-model-parallel-size", "2", "--num-layers", "5",
        "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3"]
    cfg = build_configs(parse_args(argv), world_size=2)
    s = cfg.scheduler_kwargs
    assert (s["lr_warmup_steps"], s["lr_decay_steps"], s["wd_incr_steps"]) == (100, 800, 1000)
    assert cfg.transformer.num_layers_in_first_pipeline_stage == 2
    assert cfg.training.train_samples == 1000 and cfg.training.train_iters is None
    cfg = build_configs(parse_args(small("--pipeline-model-parallel-size", "2", "--num-layers",
                                         "6", "--account-for-embedding-in-pipeline-split",
                                         "--account-for-loss-in-pipeline-split")), 2)
    assert cfg.transformer.account_for_loss_in_pipeline_split


def test_swiglu_default_ffn_and_old_position_flags():
    args = parse_args(small("--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32"))
    assert args.ffn_hidden_size == 10880  # Megatron: int((4 * 4096 * 2 / 3) / 64) * 64
    args = parse_args(small("--no-position-embedding"))
    assert args.position_embedding_type == "none"
    assert parse_args(small()).max_position_embeddings == 32  # defaults to --seq-length


def test_llama3_rope_scaling_and_gelu_flags():
    """Every field of LLaMA-3.1 RoPE scaling has a flag (checkpoint conversion writes them),
    and --openai-gelu selects GPT-2's tanh GeLU."""
    t = build_configs(parse_args(small(
        "--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "16",
        "--rope-low-freq-factor", "2", "--rope-high-freq-factor", "8",
        "--rope-original-max-position-embeddings", "4096"))).transformer
    assert (t.rope_scaling_factor, t.rope_low_freq_factor, t.rope_high_freq_factor,
            t.rope_original_max_position_embeddings) == (16.0, 2.0, 8.0, 4096)
    t = build_configs(parse_args(small())).transformer
    assert (t.rope_scaling_factor, t.rope_low_freq_factor, t.rope_high_freq_factor,
            t.rope_original_max_position_embeddings) == (None, 1.0, 4.0, 8192)  # LLaMA-3.1's
    assert t.activation == "gelu"
    assert build_configs(parse_args(small("--openai-gelu"))).transformer.activation == \
        "gelu_tanh"


@pytest.mark.parametrize("flag", sorted(NOOP_FLAGS))
def test_noop_flags_are_accepted(flag):
    assert getattr(parse_args(small(flag)), flag.lstrip("-").replace("-", "_"))


def test_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown flag --lr-warmup-itrs; did you mean "
                                          r"--lr-warmup-iters"):
        parse_args(small("--lr-warmup-itrs", "5"))
    with pytest.raises(ConfigError, match="unknown flag --tensor-parallel-size; did you mean "
                                          "--tensor-model-parallel-size"):
        parse_args(small("--tensor-parallel-size=2"))
    with pytest.raises(ConfigError, match="unknown flag --zzzz$"):
        parse_args(small("--zzzz"))
    with pytest.raises(ConfigError, match="invalid choice"):  # argparse errors raise too
        parse_args(small("--optimizer", "lion"))
    with pytest.raises(ConfigError, match="not a whole number"):
        parse_args(small("--ddp-bucket-size", "1.5"))


@pytest.mark.parametrize("extra, world, message", [
    (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by "
                                      "--micro-batch-size 2 x data-parallel size 2"),
    (["--tensor-model-parallel-size", "3", "--num-attention-heads", "4"], 3,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups",
      "2"], 4, "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--pipeline-model-parallel-size", "3"], 3, "cannot be split evenly over 3 pipeline"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4"], 2,
     "model flags: TransformerConfig"),
    (["--mock-data", "--data-path", "x"], 1, "exactly one data source"),
])
def test_world_and_model_errors(extra, world, message):
    assert message in error_of(small(*extra), world)


@pytest.mark.parametrize("extra, message", [
    (["--fp16", "--bf16"], "--fp16 and --bf16 are exclusive"),
    (["--use-distributed-optimizer", "--overlapped-distributed-optimizer"],
     "--use-distributed-optimizer and --overlapped-distributed-optimizer are exclusive"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--train-samples", "100"], "exactly one of --train-iters or --train-samples (got both)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both set the warmup"),
    (["--lr-decay-samples", "8"], "replace --lr-decay-samples with the -iters spelling"),
    (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--recompute-activations", "--recompute-granularity", "full"],
     "--recompute-activations means --recompute-granularity selective"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "need --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x "
     "--num-layers-per-virtual-pipeline-stage 3"),
    (["--max-position-embeddings", "16"], "--seq-length 32 is longer than "
     "--max-position-embeddings 16, the size of the learned position table"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-high-freq-factor",
      "1"],
     "--rope-high-freq-factor 1.0 must be greater than --rope-low-freq-factor 1.0"),
    (["--swiglu", "--openai-gelu"], "--swiglu and --openai-gelu both choose the MLP activation"),
    (["--max-consecutive-nan-iterations", "0"], "--max-consecutive-nan-iterations must be >= 1"),
    (["--pipeline-trace-dir", "t", "--pipeline-trace-iteration", "11"],
     "--pipeline-trace-iteration 11 is not an iteration of this run: pick one from 1 to "
     "--train-iters 10."),
    (["--pipeline-trace-dir", "t", "--pipeline-trace-iteration", "0"],
     "--pipeline-trace-iteration 0 is not an iteration of this run"),
])
def test_flag_errors(extra, message):
    with pytest.raises(ConfigError) as info:
        parse_args(small(*extra))
    assert message in str(info.value)


def test_pipeline_trace_flags():
    assert build_configs(parse_args(small()), 1).training.pipeline_trace_dir is None
    # Without a trace directory the iteration is not checked (the default 2 > --train-iters 1).
    parse_args([a if a != "10" else "1" for a in small()])
    t = build_configs(parse_args(small("--pipeline-trace-dir", "traces",
                                       "--pipeline-trace-iteration", "10")), 1).training
    assert (t.pipeline_trace_dir, t.pipeline_trace_iteration) == ("traces", 10)


def test_train_samples_below_one_global_batch():
    argv = [a for a in small("--global-batch-size", "8", "--train-samples", "7")
            if a not in ("--train-iters", "10")]
    assert "--train-samples 7 is less than one global batch (8)" in error_of(argv)


def test_neither_train_length_and_required_flags():
    argv = [a for a in small() if a not in ("--train-iters", "10")]
    with pytest.raises(ConfigError, match=r"--train-samples \(got neither\)"):
        parse_args(argv)
    with pytest.raises(ConfigError, match="--lr is required"):
        parse_args([a for a in small() if a not in ("--lr", "1e-3")])


@pytest.mark.parametrize("extra, message", [
    (["--lr-warmup-iters", "20"], "--lr-warmup-iters 20 must be < --lr-decay-iters 10"),
    (["--lr-warmup-fraction", "1.0"], "learning-rate flags: OptimizerParamScheduler: "
                                      "--lr-warmup-iters/--lr-warmup-samples (20.0) must be"),
    (["--min-lr", "1"], "--min-lr (1.0) must be <= --lr"),
    (["--fp16", "--initial-loss-scale", "0.5"],
     "optimizer flags: need 0 < --min-loss-scale <= --initial-loss-scale"),
    (["--recompute-granularity", "full"], "full recomputation needs recompute_method"),
])
def test_config_constructor_errors_are_wrapped(extra, message):
    assert message in error_of(small(*extra))


def test_missing_files(files, tmp_path):
    argv = launch_argv(files)
    (tmp_path / "data" / "D2.idx").unlink()
    assert f"--data-path: missing data file(s) {files['d']}/D2.idx" in error_of(argv, 8)
    argv = [a.replace(files["tok"], str(tmp_path / "nope")) for a in launch_argv(files)]
    (tmp_path / "data" / "D2.idx").write_bytes(b"")
    assert f"--tokenizer-name-or-path {tmp_path / 'nope'}: no such file" in error_of(argv, 8)
    argv = small("--tokenizer-type", "SentencePieceTokenizer")
    assert "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model" in error_of(argv)
    argv = [a for a in small() if a not in ("--tokenizer-type", "NullTokenizer")]
    assert "--tokenizer-type is required" in error_of(argv)
    argv = [a for a in small() if a not in ("--vocab-size", "100")]
    assert "NullTokenizer needs --vocab-size" in error_of(argv)
    # With --mock-data, --data-path files are not looked for (the dataset config rejects both).
    assert "missing data" not in error_of(small("--data-path", str(tmp_path / "x")))


def test_tokenizer_supplies_vocab():
    from megatron.training.tokenizer import build_tokenizer_from_args
    args = parse_args(small("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                            "8"))
    tokenizer = build_tokenizer_from_args(args)
    cfg = build_configs(args, world_size=2, tokenizer=tokenizer)
    assert cfg.model_kwargs["vocab_size"] == tokenizer.vocab_size == 101  # ids + eod
    assert cfg.model_kwargs["padded_vocab_size"] == 112
    assert args.padded_vocab_size is None  # the flag stays the user's: saved args say so
    assert cfg.dataset.eod_token == tokenizer.eod == 100


def test_mock_data_with_a_tokenizer_file(files):
    """pretrain checks the flags before loading the tokenizer: with --mock-data the vocabulary
    is the tokenizer's, so that first check needs no --vocab-size."""
    argv = small()[:-4] + ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                           files["tok"]]  # small() ends with NullTokenizer --vocab-size 100
    assert build_configs(parse_args(argv)).dataset.mock


def test_bf16_gradients_are_reduced_in_fp32_unless_asked():
    """Megatron-LM's rule: --bf16 turns on fp32 gradient accumulation and reduction;
    --grad-reduce-in-bf16 keeps them in bf16; fp32/fp16 runs are unchanged."""
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-4",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--mock-data",
            "--train-iters", "1"]
    grads_fp32 = {flags: build_configs(parse_args(base + list(flags))).ddp.grad_reduce_in_fp32
                  for flags in [(), ("--bf16",), ("--bf16", "--grad-reduce-in-bf16"),
                                ("--fp16",), ("--fp16", "--accumulate-allreduce-grads-in-fp32")]}
    assert grads_fp32 == {
        (): False, ("--bf16",): True, ("--bf16", "--grad-reduce-in-bf16"): False,
        ("--fp16",): False, ("--fp16", "--accumulate-allreduce-grads-in-fp32"): True}


def _numeric_dests():
    from megatron.training.arguments import get_parser

    return {a.dest for a in get_parser()._actions
            if getattr(a.type, "__name__", "") in ("int", "float", "_int_from_float")}


def test_every_numeric_flag_has_a_range():
    from megatron.training.arguments.ranges import FLAG_RANGES

    checked_elsewhere = {"timing_log_level", "pipeline_trace_iteration"}
    assert _numeric_dests() - checked_elsewhere == set(FLAG_RANGES)


@pytest.mark.parametrize("extra, message", [
    (["--hidden-size", "-8"], "--hidden-size must be >= 1, got -8."),
    (["--num-layers", "0"], "--num-layers must be >= 1, got 0."),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0."),
    (["--ffn-hidden-size", "-1"], "--ffn-hidden-size must be >= 1, got -1."),
    (["--seq-length", "0"], "--seq-length must be >= 1, got 0."),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0."),
    (["--global-batch-size", "-4"], "--global-batch-size must be >= 1, got -4."),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0."),
    (["--train-iters", "-5"], "--train-iters must be >= 1, got -5."),
    (["--tensor-model-parallel-size", "0"],
     "--tensor-model-parallel-size must be >= 1, got 0 (1 = no tensor parallelism)."),
    (["--pipeline-model-parallel-size", "-2"], "--pipeline-model-parallel-size must be >= 1"),
    (["--lr", "-0.001"], "--lr must be >= 0, got -0.001 (the peak learning rate, e.g. 3e-4)."),
    (["--lr", "nan"], "--lr must be >= 0, got nan"),
    (["--lr", "-1e-3"], "--lr must be >= 0, got -0.001"),  # a number, not a flag
    (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1 (0 = no evaluation)."),
    (["--hidden-dropout", "1.5"],
     "--hidden-dropout must be in [0, 1), got 1.5 (a dropout probability; 0 = no dropout)."),
    (["--attention-dropout", "-0.1"], "--attention-dropout must be in [0, 1), got -0.1"),
    (["--hidden-dropout", "1"], "--hidden-dropout must be in [0, 1), got 1.0"),
    (["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1), got 1.0"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0."),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1], got 1.5"),
    (["--seed", "0"], "--seed must be >= 1, got 0 (Megatron's rule)."),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1."),
    (["--init-method-std", "inf"], "--init-method-std must be > 0, got inf."),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1, got 0 (elements per bucket)."),
    (["--num-workers", "-1"], "--num-workers must be >= 0, got -1"),
    (["--qk-clip", "--qk-clip-threshold", "0"], "--qk-clip-threshold must be > 0, got 0.0"),
    (["--qk-clip", "--qk-clip-alpha", "1.5"], "--qk-clip-alpha must be in [0, 1], got 1.5"),
])
def test_ranges_are_checked_before_any_other_rule(extra, message):
    with pytest.raises(ConfigError) as info:
        parse_args(small(*extra))
    assert str(info.value) == message or str(info.value).startswith(message)


@pytest.mark.parametrize("extra", [
    ["--hidden-dropout", "0", "--attention-dropout", "0.99"], ["--eval-iters", "0"],
    ["--clip-grad", "0"], ["--num-workers", "0"], ["--lr", "0"], ["--lr-warmup-fraction", "1"],
    ["--adam-beta1", "0"], ["--lr-warmup-iters", "0"], ["--rotary-percent", "1"]])
def test_range_boundaries_that_are_valid(extra):
    parse_args(small(*extra))


def test_saved_args_without_a_numeric_flag_still_validate():
    from megatron.training.arguments import get_parser, validate_args

    args = get_parser().parse_args(small())
    del args.peak_tflops  # a checkpoint written before the flag existed
    assert validate_args(args).hidden_size == 64


def test_rope_seq_length_past_max_positions_warns_once_from_rank_0(capsys, monkeypatch):
    argv = small("--position-embedding-type", "rope", "--max-position-embeddings", "16")
    assert parse_args(argv).seq_length == 32  # accepted: RoPE has no position table
    warning = capsys.readouterr().err
    assert warning == ("warning: --seq-length 32 is longer than --max-position-embeddings 16: "
                       "RoPE computes every position, so training uses all 32, but the model "
                       "records a context of 16 (an HF export's max_position_embeddings); pass "
                       "--max-position-embeddings 32 to record the length trained on, or, to "
                       "extend a model trained at 16 positions, --use-rope-scaling "
                       "--rope-scaling-factor 2 --rope-original-max-position-embeddings 16.\n")
    parse_args(argv + ["--use-rope-scaling"])  # scaling on already: only the recorded length
    assert capsys.readouterr().err.endswith("to record the length trained on.\n")
    monkeypatch.setenv("RANK", "1")
    parse_args(argv)
    assert capsys.readouterr().err == ""
    parse_args(small("--position-embedding-type", "rope"))  # equal lengths: silent
    assert capsys.readouterr().err == ""


def test_core_configs_reject_bad_sizes_themselves():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    for kwargs, message in (
            (dict(hidden_size=-8), "hidden_size must be >= 1, got -8"),
            (dict(ffn_hidden_size=0), "ffn_hidden_size must be >= 1 (or None), got 0"),
            (dict(hidden_dropout=1.5), "hidden_dropout must be in [0, 1), got 1.5"),
            (dict(max_position_embeddings=0), "max_position_embeddings must be >= 1, got 0"),
            (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size must be >= 1")):
        with pytest.raises(ValueError) as info:
            TransformerConfig(**kwargs)
        assert message in str(info.value)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size must be >= 1, got 0"):
        ModelParallelConfig(pipeline_model_parallel_size=0)
    for kwargs, message in ((dict(lr=-1.0), "--lr must be >= 0, got -1.0"),
                            (dict(adam_beta1=1.0), "--adam-beta1 must be in [0, 1), got 1.0"),
                            (dict(adam_eps=0.0), "--adam-eps must be > 0, got 0.0")):
        with pytest.raises(ValueError) as info:
            OptimizerConfig(**kwargs)
        assert message in str(info.value)


def test_compiled_element_wise_path_is_cuda_s_default(monkeypatch):
    """--torch-compile / --no-torch-compile win; without either, the compiled path runs where
    the device is CUDA and Triton imports (inductor's GPU backend), the eager one on CPU."""
    from megatron.training.arguments import configs

    def compiled(*flags):
        return configs.torch_compile_of(parse_args(small(*flags)))

    triton = {"present": True}  # this CPU machine's torch comes without it
    monkeypatch.setattr(configs.importlib.util, "find_spec",
                        lambda name: (triton["present"] or None) if name == "triton" else True)
    assert compiled("--device", "cuda") is True
    assert compiled("--device", "cuda", "--no-torch-compile") is False
    assert compiled("--device", "cpu") is False
    assert compiled("--device", "cpu", "--torch-compile") is True
    monkeypatch.setenv("MEGATRON_DEVICE", "cpu")
    assert compiled() is False  # --device auto: this machine's device
    assert build_configs(parse_args(small())).transformer.torch_compile is False
    triton["present"] = False
    assert compiled("--device", "cuda") is False  # no Triton: eager, not a failed compile
