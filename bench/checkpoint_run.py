"""The run the checkpoint benchmarks save and load: a LLaMA of about ``--size-gb`` of params +
Adam state, built as ``pretrain()`` builds it (one process, or one DP rank under torchrun),
with its training step. Shared by bench/checkpoint.py and bench/checkpoint_formats.py."""
import functools
import math
import os

import torch.distributed as dist

from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.arguments import build_configs, parse_args as parse_megatron
from megatron.training.checkpointing import save_checkpoint
from megatron.training.data.samplers import build_pretraining_data_loader, cyclic_iter
from megatron.training.gpt_step import forward_step, model_provider_for
from megatron.training.initialize import initialize_megatron
from megatron.training.tokenizer.build import build_tokenizer_from_args
from megatron.training.training import build_model, train_step

GB = 1e9
VOCAB = 32000


def model_shape(size_gb: float):
    """(hidden, ffn, layers) of an untied LLaMA with a 32000-token vocabulary whose
    params + Adam state (12 bytes/param) come closest to ``size_gb``."""
    params = size_gb * GB / 12
    vocab = math.ceil((VOCAB + 1) / 128) * 128  # NullTokenizer adds eod; padded to 128

    def count(hidden, ffn, layers):
        return 2 * vocab * hidden + hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn
                                                       + 2 * hidden)

    # hidden from 2*V*h + 6 layers * 12 h^2 = params, to a multiple of 64
    hidden = (-2 * vocab + math.sqrt(4 * vocab ** 2 + 4 * 72 * params)) / (2 * 72)
    hidden = max(64, 64 * round(hidden / 64))
    ffn = max(64, 64 * round(8 * hidden / 3 / 64))
    layers = min(range(1, 65), key=lambda n: abs(count(hidden, ffn, n) - params))
    return hidden, ffn, layers


def megatron_argv(args, root, dp=1, extra=""):
    """The run's flags; at ``dp`` data-parallel ranks one microbatch each (``extra``: more
    flags, e.g. --use-distributed-optimizer)."""
    hidden, ffn, layers = model_shape(args.size_gb)
    return (f"--num-layers {layers} --hidden-size {hidden} --ffn-hidden-size {ffn} "
            f"--num-attention-heads {hidden // 64} --seq-length {args.seq} "
            f"--max-position-embeddings {args.seq} --normalization RMSNorm --swiglu "
            f"--position-embedding-type rope --disable-bias-linear "
            f"--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
            f"--micro-batch-size 1 --global-batch-size {dp} --train-iters 100000 --lr 1e-4 "
            f"--lr-decay-style constant --weight-decay 0.1 --clip-grad 1.0 --mock-data "
            f"--tokenizer-type NullTokenizer --vocab-size {VOCAB} --num-workers 0 "
            f"--device cpu --save {root} --load {root} {extra}").split()


class Run:
    """What pretrain() builds, and its training step: one process, or one DP rank under
    torchrun (bench/checkpoint_formats.py)."""

    def __init__(self, args, root, extra=""):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.margs = parse_megatron(megatron_argv(args, root, world, extra))
        tokenizer = build_tokenizer_from_args(self.margs)
        self.configs = c = build_configs(self.margs, world, tokenizer)
        t = c.training
        initialize_megatron(1, 1, None, t.seed, t.device)
        self.model = build_model(functools.partial(model_provider_for(LlamaModel), configs=c),
                                 c.transformer, c.ddp, t.seed)
        self.optimizer = get_megatron_optimizer(c.optimizer, self.model)
        c.transformer.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(self.optimizer, **c.scheduler_kwargs)
        train, _, _ = build_train_valid_test_datasets(c.dataset, [10_000, 0, 0])
        self.data = cyclic_iter(build_pretraining_data_loader(
            train, 0, "cyclic", t.micro_batch_size, 0, dist.get_rank(), world, t.seed))
        self.forward_step = functools.partial(forward_step, configs=c)
        self.iteration = 0

    @property
    def module(self):
        return unwrap_model(self.model[0])

    @property
    def adam(self):
        return self.optimizer.optimizer

    def step(self):
        train_step(self.forward_step, self.data, self.model, self.optimizer, self.scheduler,
                   1, self.margs.seq_length, 1)
        self.iteration += 1

    def save(self, root, writer):
        save_checkpoint(root, self.iteration, self.model, self.optimizer, self.scheduler,
                        self.configs, vars(self.margs), self.iteration, 0, writer)

    def state_tensors(self):
        """(name, tensor) of every param and its Adam state, as they are now."""
        out = []
        for name, p in self.module.named_parameters():
            out.append((name, p))
            for k in ("exp_avg", "exp_avg_sq"):
                out.append((f"{name}.{k}", self.adam.state[p][k]))
        return out
