"""Pretrain a GPT model: torchrun --nproc-per-node N pretrain_gpt.py [Megatron flags]."""
from megatron.core.models import GPTModel
from megatron.training.gpt_step import forward_step, train_valid_test_datasets_provider
from megatron.training.pretrain import pretrain


def model_provider(configs, pre_process=True, post_process=True, layer_range=None):
    kwargs = dict(configs.model_kwargs)
    return GPTModel(configs.transformer, kwargs.pop("vocab_size"), pre_process=pre_process,
                    post_process=post_process, layer_range=layer_range, **kwargs)


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step)
