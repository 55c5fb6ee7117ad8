"""What pretrain_gpt.py and pretrain_llama.py share: the model provider, the datasets provider
and the forward step (batch from the data iterator, per-token loss masked and averaged; the
reported loss is this rank's, averaged over DP once per iteration by train_step/evaluate)."""
from typing import Sequence

import torch

from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.core.packed_seq_params import packed_seq_params_from_eod
from megatron.training.batch import get_batch_from_config
from megatron.training.timers import get_timers


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
    mask = loss_mask.float()
    loss = (per_token_loss.float() * mask).sum() / mask.sum()
    # Detached and local: no collective, no host sync per microbatch (train_step reduces).
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model, configs):
    data = configs.dataset
    timer = get_timers()("batch-generator", log_level=2)
    timer.start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch_from_config(
        data_iterator, data, configs.training.micro_batch_size)
    timer.stop()
    # Packed documents attend within themselves: boundaries, not a [b, 1, s, s] mask (one
    # host copy of the EOD positions per microbatch).
    packed = packed_seq_params_from_eod(tokens, data.eod_token) \
        if data.reset_attention_mask and tokens is not None else None
    per_token_loss = model(
        tokens, position_ids=position_ids if data.reset_position_ids else None,
        labels=labels, packed_seq_params=packed)
    return per_token_loss, lambda output: loss_func(loss_mask, output)
