"""Tokenizers selected by ``--tokenizer-type``, with Megatron's flags and names."""
from megatron.training.tokenizer.base import MegatronTokenizer
from megatron.training.tokenizer.build import (
    TOKENIZER_TYPES,
    add_tokenizer_args,
    build_tokenizer,
    build_tokenizer_from_args,
)
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.training.tokenizer.null import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "add_tokenizer_args",
    "build_tokenizer",
    "build_tokenizer_from_args",
]
