"""What pretrain_gpt.py and pretrain_llama.py share: the model provider, the datasets provider
and the forward step (batch from the data iterator, per-token loss masked and averaged; the
reported loss is this rank's, averaged over DP once per iteration by train_step/evaluate)."""
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.training.data.batch import get_batch_and_documents, shard_for_context_parallel
from megatron.training.logging.timers import get_timers


def model_provider_for(model_class):
    """A model provider building ``model_class`` (GPTModel or LlamaModel) chunks from configs."""
    def model_provider(configs, pre_process=True, post_process=True, layer_range=None):
        kwargs = dict(configs.model_kwargs)
        return model_class(configs.transformer, kwargs.pop("vocab_size"),
                           pre_process=pre_process, post_process=post_process,
                           layer_range=layer_range, **kwargs)
    return model_provider


def train_valid_test_datasets_provider(num_samples: Sequence[int], configs):
    return build_train_valid_test_datasets(configs.dataset, num_samples)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """The masked mean over the microbatch's tokens. Under context parallelism each rank has
    2 of the 2 x CP chunks of every sequence: the sum and count are summed over CP (one small
    all-reduce), and the loss to differentiate is this rank's sum over the global count,
    times CP, because DDP averages gradients over DP x CP (Megatron's convention)."""
    mask = loss_mask.float()
    total, count = (per_token_loss.float() * mask).sum(), mask.sum()
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        loss = total / count
        # Detached and local: no collective, no host sync per microbatch (train_step reduces).
        return loss, {"lm loss": loss.detach()}
    both = torch.stack((total.detach(), count))
    dist.all_reduce(both, group=parallel_state.get_context_parallel_group())
    return total * cp / both[1], {"lm loss": both[0] / both[1]}


def forward_step(data_iterator, model, configs):
    data = configs.dataset
    timer = get_timers()("batch-generator", log_level=2)
    timer.start()
    # Packed documents attend within themselves: boundaries, not a [b, 1, s, s] mask, from
    # the whole sequence, computed from the host batch (no device-to-host read).
    (tokens, labels, loss_mask, _, position_ids), packed = get_batch_and_documents(
        data_iterator, data, configs.training.micro_batch_size)
    context_parallel = parallel_state.get_context_parallel_world_size() > 1
    tokens, labels, loss_mask, position_ids = shard_for_context_parallel(
        tokens, labels, loss_mask, position_ids)
    timer.stop()
    # Under CP the positions are not 0..s-1: the model needs them (RoPE, learned positions).
    # Multi-token prediction's losses are masked in the model (the mask shifted per depth).
    transformer = getattr(configs, "transformer", None)
    mtp = {"loss_mask": loss_mask} if getattr(transformer, "mtp_num_layers", None) else {}
    per_token_loss = model(
        tokens, position_ids=position_ids if data.reset_position_ids or context_parallel
        else None, labels=labels, packed_seq_params=packed, **mtp)
    return per_token_loss, lambda output: loss_func(loss_mask, output)
