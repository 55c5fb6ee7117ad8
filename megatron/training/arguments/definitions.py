"""Megatron's flag definitions: the argparse parser, group by group (``get_parser``), and the
flags accepted for compatibility that change nothing (``NOOP_FLAGS``). Parsing, the checks
and the mapping onto configs are in parse.py and configs.py."""
import argparse
import re

from megatron.core.optimizer.optimizer_param_scheduler import (
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
)
from megatron.training.arguments.data_parallel import add_data_parallel_args
from megatron.training.arguments.fp8 import add_fp8_args
from megatron.training.arguments.moe import add_moe_args
from megatron.training.tokenizer.build import add_tokenizer_args
from megatron.training.training_config import ConfigError

# Flags accepted for compatibility that change nothing here: each only selects a CUDA kernel
# (apex / Megatron fused ops) or states what is always true in this framework.
NOOP_FLAGS = {
    "--use-flash-attn": "attention always uses torch SDPA, which runs flash attention on CUDA",
    "--causal-lm": "GPT and LLaMA models are always causal language models",
    "--no-masked-softmax-fusion": "no fused softmax kernel; SDPA does masking and softmax",
    "--no-bias-gelu-fusion": "no fused bias-GeLU kernel",
    "--no-bias-swiglu-fusion": "no fused bias-SwiGLU kernel",
    "--no-bias-dropout-fusion": "no fused bias-dropout-add kernel",
    "--no-rope-fusion": "no fused RoPE kernel",
    "--no-persist-layer-norm": "no persistent (apex) LayerNorm kernel",
    "--no-async-tensor-model-parallel-allreduce": "the backward's TP all-reduce always overlaps "
                                                  "the weight-gradient GEMM (no synchronous mode)",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and calling sys.exit(2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A value like -1e-3 is a number, not a flag (Python 3.11's argparse knows only -1 and
        # -.5 forms, and says "--lr: expected one argument").
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):
        raise ConfigError(message)


def _window_size(text: str):
    """Megatron's --window-size: "LEFT,RIGHT", also written "(LEFT, RIGHT)"."""
    parts = text.strip().strip("()").split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (two integers, e.g. "
                                         f"4095,0)") from None
    return left, right


def _add_yarn_args(g):
    """YaRN rotary scaling, Megatron's names (its MLA flags); each needs --rope-type yarn."""
    g.add_argument("--rope-type", default="rope", choices=["rope", "yarn"],
                   help="yarn: YaRN rotary scaling (gpt-oss, DeepSeek-V3, long-context Qwen); "
                        "not with --use-rope-scaling.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN: how many times the original context is stretched (gpt-oss 32).")
    g.add_argument("--original-max-position-embeddings", type=int, default=4096,
                   help="YaRN: the context length trained before scaling.")
    g.add_argument("--beta-fast", type=float, default=32.0,
                   help="YaRN: dims turning more often over the original context keep their "
                        "frequency.")
    g.add_argument("--beta-slow", type=float, default=1.0,
                   help="YaRN: dims turning less often are fully interpolated.")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: attention temperature coefficient (with --mscale-all-dim).")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN: divides the --mscale temperature (DeepSeek); 0 = plain YaRN.")
    g.add_argument("--yarn-correction-range-round-to-int",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="YaRN: round the interpolation ramp's ends to whole dims (Hugging "
                        "Face's truncate; gpt-oss uses --no-yarn-correction-range-round-to-int).")
    g.add_argument("--yarn-attention-factor", type=float, default=None,
                   help="YaRN: the cos/sin multiplier (Hugging Face's attention_factor); "
                        "default: derived from the factor and mscales.")


def _add_latent_attention_args(g):
    """Multi-latent attention (DeepSeek-V2/V3), Megatron's names and defaults; the sizes need
    --multi-latent-attention."""
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention (DeepSeek-V2/V3): queries and keys/values "
                        "from low-rank latents, a rotated key part shared by the heads; "
                        "needs --position-embedding-type rope")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA: the query latent's size; unset: queries straight from the "
                        "hidden states")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="MLA: the key/value latent's size")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="MLA: the channels of a query/key head without position")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="MLA: the rotated channels of a query/key head")
    g.add_argument("--v-head-dim", type=int, default=128,
                   help="MLA: the channels of a value head")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE on adjacent channel pairs (DeepSeek's layout, Hugging Face's "
                        "rope_interleave) instead of the two halves; MLA only")


def _add_network_args(parser):
    g = parser.add_argument_group("network size and architecture")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Default 4 * hidden; with --swiglu int(4 * hidden * 2/3 / 64) * 64.")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Default --seq-length. Learned absolute positions: the size of the "
                        "position table, so it must be >= --seq-length. RoPE has no table "
                        "(positions are computed): the value is only recorded as the model's "
                        "context (an HF export's max_position_embeddings); a --seq-length "
                        "beyond it trains anyway, with a warning.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Old spelling of --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="No learned absolute position embedding (rope if asked, else none).")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="LLaMA-3.1 RoPE scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--rope-low-freq-factor", type=float, default=1.0,
                   help="LLaMA-3.1 RoPE scaling (with --use-rope-scaling).")
    g.add_argument("--rope-high-freq-factor", type=float, default=4.0,
                   help="LLaMA-3.1 RoPE scaling (with --use-rope-scaling).")
    g.add_argument("--rope-original-max-position-embeddings", type=int, default=8192,
                   help="LLaMA-3.1 RoPE scaling: the context length before scaling (with "
                        "--use-rope-scaling).")
    _add_yarn_args(g)
    _add_latent_attention_args(g)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--RMSNorm", action="store_true",
                   help="Old spelling of --normalization RMSNorm.")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float,
                   default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP with gate * sigmoid(1.702 * gate) in place of SwiGLU's SiLU "
                        "(gpt-oss); the --ffn-hidden-size default stays 4 * hidden (the 2/3 "
                        "rule is --swiglu's).")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="with --swiglu or --quick-geglu: added to the up half before the "
                        "product (gpt-oss: 1).")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="with --swiglu or --quick-geglu: clamp the gate half to at most this "
                        "and the up half to +-this (gpt-oss: 7).")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GeLU's tanh approximation (GPT-2's 'gelu_new') instead of the exact one.")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize each query and key head before RoPE (Qwen3); with "
                        "--multi-latent-attention the query and key/value latents "
                        "(Megatron's meaning; DeepSeek-V3 has them)")
    g.add_argument("--window-size", type=_window_size, default=None,
                   help="sliding-window attention: LEFT,RIGHT tokens a query sees around "
                        "itself (RIGHT 0: causal); Hugging Face's sliding_window S is S-1,0")
    g.add_argument("--window-attn-skip-freq", type=int, default=None,
                   help="with --window-size: every N-th layer keeps full attention (gpt-oss 2)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction (DeepSeek-V3): D modules after the model, "
                        "depth k predicting the token k + 1 further ahead")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="with --mtp-num-layers: the MTP losses' weight (their mean times it "
                        "is added to the loss)")
    g.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"),
                   default="vanilla",
                   help="attention softmax: learnable adds a learned logit per head to the "
                        "denominator (gpt-oss's attention sinks), off-by-one a fixed 0")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--allow-math-attention", action="store_true",
                   help="On CUDA, accept a configuration in which SDPA would run its math "
                        "kernel ([b, heads, s, s] scores per layer: slow, out of memory at long "
                        "sequences), or, under --context-parallel-size, its fp32 reference "
                        "block kernel (attention dropout, packed documents) at more than 4096 "
                        "tokens per rank; without it such a run stops at start saying why.")
    for flag, why in NOOP_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"Accepted, no effect: {why}.")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Split each sequence over this many ranks (ring attention); the "
                        "world is TP x CP x DP x PP.")
    g.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p",
                   help="How context-parallel attention sees the other ranks' keys and "
                        "values: p2p passes blocks around a ring, overlapped with compute; "
                        "all_gather gathers them once (simpler, more memory).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--pipeline-schedule", choices=("1f1b", "interleaved", "zb-h1", "zbv"),
                   default=None,
                   help="Ours: 1f1b, interleaved (needs virtual stages), zb-h1 (zero bubble, "
                        "1F1B's memory) or zbv (zero bubble, 2 chunks per rank in a V: rank r "
                        "holds stages r and 2PP-1-r). Default: interleaved iff "
                        "--num-layers-per-virtual-pipeline-stage is given, else 1f1b.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Old spelling of --recompute-granularity selective.")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="full: recompute whole layers (see --recompute-method). selective: "
                        "recompute the attention core only where it keeps the s x s softmax "
                        "(the unfused kernel: CPU with attention dropout, or CUDA's math "
                        "kernel); with flash / memory-efficient attention it is a no-op "
                        "(nothing to save, no recompute cost).")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--distribute-saved-activations", action="store_true")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 params; gradients are accumulated and reduced in fp32 (as in "
                        "Megatron-LM) unless --grad-reduce-in-bf16.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: accumulate and reduce gradients in bf16 (half the "
                        "gradient memory and traffic, less exact sums).")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon"],
                   help="muon: Newton-Schulz orthogonalized momentum for the transformer "
                        "layers' matrices, AdamW (the --adam-* settings) for the rest.")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_DECAY_STYLES)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=WD_INCR_STYLES)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    _add_muon_args(g)
    _add_qk_clip_args(g)
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="fp32 main params and optimizer state (the distributed optimizer's "
                        "or FSDP2's shard of them) in host memory, the step on the host "
                        "(torch's fused CPU AdamW): gradients go to the host and params back "
                        "every step (FSDP2: torch's CPUOffloadPolicy, per layer).")


def _add_muon_args(g):
    """Megatron-LM's --muon-* names (--muon-ns-dtype is ours)."""
    g.add_argument("--muon-momentum", type=float, default=0.95)
    g.add_argument("--muon-use-nesterov", action="store_true")
    g.add_argument("--muon-num-ns-steps", type=int, default=5,
                   help="Newton-Schulz iterations per orthogonalization.")
    g.add_argument("--muon-scale-mode", default="spectral",
                   choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   help="The update's scale for an out x in matrix: sqrt(max(out, in)), "
                        "sqrt(out / in), sqrt(max(1, out / in)).")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="Times the scale (0.2 with spectral: Moonlight's AdamW-matched RMS).")
    g.add_argument("--muon-split-qkv", action="store_true",
                   help="Orthogonalize Q, K and V of the fused QKV weight apart.")
    g.add_argument("--muon-tp-mode", default="duplicated",
                   choices=["duplicated", "blockwise", "distributed"],
                   help="duplicated: all-gather a TP-sharded matrix and orthogonalize it whole "
                        "on every TP rank (Megatron's names; blockwise and distributed are "
                        "refused: see docs/architecture.md).")
    g.add_argument("--muon-scalar-optimizer", default="adam", choices=["adam"],
                   help="The optimizer of the non-matrix parameters.")
    g.add_argument("--muon-ns-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="dtype of the Newton-Schulz matmuls (bf16: torch.optim.Muon's).")


def _add_qk_clip_args(g):
    """Megatron-LM's QK-clip flags (MuonClip, Kimi K2), with any --optimizer."""
    g.add_argument("--qk-clip", action="store_true",
                   help="After each step, scale the query and key rows of every attention head "
                        "whose largest pre-softmax logit of the step passed --qk-clip-threshold "
                        "(Kimi K2's MuonClip). With any --optimizer: Muon is where logits blow "
                        "up, but the clip only rescales weights after the update.")
    g.add_argument("--qk-clip-threshold", type=float, default=100.0,
                   help="tau: the largest logit a head keeps (Kimi K2: 100).")
    g.add_argument("--qk-clip-alpha", type=float, default=0.5,
                   help="The clip's share on the queries: W_q rows times gamma^alpha, W_k rows "
                        "times gamma^(1 - alpha), gamma = tau / max logit.")
    g.add_argument("--log-max-attention-logit", action="store_true",
                   help="Print the largest pre-softmax attention logit of each logged "
                        "iteration (on with --qk-clip), without clipping.")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default micro batch x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM (Slurm, preemption): finish the iteration, save, exit 0.")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="Skip (and log) an update whose gradients are not finite (default).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--max-consecutive-nan-iterations", type=int, default=3,
                   help="Stop (saving the last good state) after this many skipped updates in "
                        "a row with non-finite gradients.")
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic"])
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="How long a collective waits for the other ranks before the job fails "
                        "(also how long ranks wait for rank 0 to build dataset indices).")
    g.add_argument("--job-name", default=None,
                   help="A name for the run, printed at the head of its summary (so in its log)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="Per-device peak for MFU, in TFLOP/s. Default: 989 (H100 SXM dense "
                        "BF16) on CUDA; on CPU none, and MFU is not printed.")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="Compute each weight gradient separately and add it to the DDP buffer "
                        "(default: the weight-gradient GEMM accumulates into it directly).")
    g.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each layer's element-wise regions (norms, residual adds, "
                        "activation, RoPE, the cross entropy); GEMMs, attention and TP "
                        "collectives stay eager. Default: on where the device is CUDA and "
                        "Triton imports (the fused path), off on CPU; --no-torch-compile runs "
                        "every op eagerly.")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the model's architecture (layers, sizes, heads, positions and "
                        "RoPE, norms, activation, biases, experts) from the args recorded in "
                        "the checkpoint at --load, over the command line's; the tokenizer "
                        "flags stay this run's.")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist (default): every rank writes its own shard (safetensors "
                        "files and a JSON index), loadable at any TP/PP/VPP/DP; torch: "
                        "Megatron's mp_rank_* files. Both load whatever the flag says.")
    g.add_argument("--skip-disk-space-check", action="store_true",
                   help="Train even when --save's file system has less free space than one "
                        "checkpoint needs (a warning instead of the error before iteration "
                        "1; the save then fails unless space is freed meanwhile).")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="Timers printed at --log-interval: 1 adds forward-backward, optimizer "
                        "and all-grads-sync; 2 also forward-compute and batch-generator.")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="Timer report across ranks: the max, min and max, or every rank.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learning-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                   action="store_false")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--wandb-project", default=None,
                   help="Log the TensorBoard scalars to this W&B project too (from the last "
                        "rank; offline when WANDB_MODE is unset and W&B cannot be reached).")
    g.add_argument("--wandb-exp-name", default=None, help="The W&B run's name.")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Where the W&B run's files go (default: <--save>/wandb, else ./wandb).")
    g.add_argument("--pipeline-trace-dir", default=None,
                   help="Ours (Megatron has none): write each rank's pipeline schedule trace "
                        "(forward, backward, waits) of one iteration as DIR/trace_rankNNNNN.json;"
                        " draw it with tools/plot_pipeline.py DIR --out FILE.png.")
    g.add_argument("--pipeline-trace-iteration", type=int, default=2,
                   help="Ours: the iteration --pipeline-trace-dir traces (default 2, past the "
                        "first iteration's warm-up).")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="'prefix' or 'w1 prefix1 w2 prefix2 ...' (one or many words).")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-impl", default="mmap", choices=["mmap"],
                   help="Accepted, no effect: .bin/.idx mmap is the only format.")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def get_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron arguments", allow_abbrev=False)
    for add in (_add_network_args, _add_parallel_args, _add_mixed_precision_args,
                _add_optimizer_args, _add_training_args, _add_checkpoint_args,
                _add_logging_args, _add_data_args):
        add(parser)
    add_data_parallel_args(parser)
    add_moe_args(parser)
    add_fp8_args(parser)
    add_tokenizer_args(parser)
    return parser
