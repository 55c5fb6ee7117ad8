"""Megatron's model-type enum, which ``pretrain()`` takes as in Megatron-LM."""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1  # GPT, LLaMA: one stack of layers split over pipeline stages
