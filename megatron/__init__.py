"""A Megatron-style framework for pretraining large language models."""
__version__ = "0.1.0"
