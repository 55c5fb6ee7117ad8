"""Pretrain a LLaMA model: torchrun --nproc-per-node N pretrain_llama.py [Megatron flags].

LLaMA's architecture flags (RMSNorm, SwiGLU, rotary embeddings, no biases, untied output) are
given on the command line as with Megatron; see shtools/ for complete launch lines.
"""
from megatron.core.enums import ModelType
from megatron.core.models import LlamaModel
from megatron.training.gpt_step import (
    forward_step,
    model_provider_for,
    train_valid_test_datasets_provider,
)
from megatron.training.guards.errors import shutdown_distributed
from megatron.training.pretrain import pretrain

model_provider = model_provider_for(LlamaModel)


def main():
    """The command ``pip install .`` installs (megatron-pretrain-*); python/torchrun this file."""
    pretrain(train_valid_test_datasets_provider, model_provider,
             ModelType.encoder_or_decoder, forward_step)
    shutdown_distributed()


if __name__ == "__main__":
    main()
