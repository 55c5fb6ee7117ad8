"""Megatron's tokenizer flags, and the one function that turns them into a tokenizer."""
import argparse
import logging
from typing import Optional, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.training.tokenizer.null import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.tiktoken_tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    PATTERNS,
    TikTokenizer,
)
from megatron.training.tokenizer.vocab_padding import padded_vocab_size

logger = logging.getLogger(__name__)

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "PretrainedFromHF",  # Megatron-DeepSpeed's name for HuggingFaceTokenizer
    "TikTokenizer",
    "NullTokenizer",
)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES,
                       help="Which tokenizer to build.")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="GPT2BPETokenizer: GPT-2's vocab.json.")
    group.add_argument("--merge-file", type=str, default=None,
                       help="GPT2BPETokenizer: GPT-2's merges.txt.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePieceTokenizer, Llama2Tokenizer: the sentencepiece .model "
                            "file. HuggingFaceTokenizer: accepted instead of "
                            "--tokenizer-name-or-path, as in Megatron. TikTokenizer: the "
                            "tiktoken BPE file ('base64 rank' lines, as LLaMA-3's "
                            "tokenizer.model) or Megatron's vocabulary JSON.")
    group.add_argument("--tokenizer-name-or-path", type=str, default=None,
                       help="HuggingFaceTokenizer: a local directory written by "
                            "save_pretrained() (hub names are not downloaded).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: ids 0..N-1; the end-of-document id is N. "
                            "TikTokenizer: optional total vocabulary; the file's ranks are cut "
                            "to N minus the special tokens. Other tokenizers have their own "
                            "vocabulary: give more embedding rows with --padded-vocab-size.")
    group.add_argument("--tiktoken-pattern", type=str, default=None, choices=tuple(PATTERNS),
                       help="TikTokenizer: the pre-tokenizer regex the file was trained with: "
                            "llama3 (LLaMA-3), cl100k (GPT-4), o200k (GPT-4o), v1/v2 "
                            "(Megatron-LM's).")
    group.add_argument("--tiktoken-num-special-tokens", type=int,
                       default=DEFAULT_NUM_SPECIAL_TOKENS,
                       help="TikTokenizer: ids 0..N-1 are special tokens; BPE rank r is id N+r.")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="TikTokenizer: the first special tokens, in id order; must contain "
                            "<unk> <s> </s> (the default list). The rest are <SPECIAL_i>.")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this times the tensor-parallel "
                            "size, for equal TP shards and efficient GEMMs.")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="Exactly this many embedding rows, for any tokenizer (a model "
                            "padded by its authors: Qwen's 151936 rows for ~151669 tokens). "
                            "At least the tokenizer's vocabulary and divisible by the "
                            "tensor-parallel size; replaces --make-vocab-size-divisible-by. "
                            "Rows past the tokenizer's tokens stay out of the softmax; "
                            "checkpoints keep them.")
    return parser


def build_tokenizer(tokenizer_type: Optional[str], *, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    tokenizer_name_or_path: Optional[str] = None,
                    vocab_size: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                    tensor_model_parallel_size: int = 1, tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
                    tiktoken_special_tokens: Optional[Sequence[str]] = None,
                    padded_vocab_size_flag: Optional[int] = None) -> MegatronTokenizer:
    """Build the tokenizer and set its ``padded_vocab_size`` (the embedding's row count)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        problem = ("--tokenizer-type is required" if tokenizer_type is None
                   else f"unknown --tokenizer-type {tokenizer_type!r}")
        raise ValueError(f"{problem}; choose one of: {', '.join(TOKENIZER_TYPES)}.")

    def need(value, flag: str, what: str):
        if value is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag} ({what}).")
        return value

    if tokenizer_type == "GPT2BPETokenizer":
        tokenizer = GPT2BPETokenizer(
            need(vocab_file, "--vocab-file", "GPT-2's vocab.json"),
            need(merge_file, "--merge-file", "GPT-2's merges.txt"))
    elif tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        model = need(tokenizer_model, "--tokenizer-model", "a sentencepiece .model file")
        cls = Llama2Tokenizer if tokenizer_type == "Llama2Tokenizer" else SentencePieceTokenizer
        tokenizer = cls(model)
    elif tokenizer_type in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        # Megatron passes the directory as --tokenizer-model; keep that working.
        if tokenizer_name_or_path is None and tokenizer_model is not None:
            tokenizer = HuggingFaceTokenizer(tokenizer_model, flag="--tokenizer-model")
        else:
            tokenizer = HuggingFaceTokenizer(need(
                tokenizer_name_or_path, "--tokenizer-name-or-path",
                "a local directory written by save_pretrained()"))
    elif tokenizer_type == "TikTokenizer":
        tokenizer = TikTokenizer(
            need(tokenizer_model, "--tokenizer-model", "a tiktoken BPE file"),
            need(tiktoken_pattern, "--tiktoken-pattern",
                 f"the regex the file was trained with: one of {', '.join(PATTERNS)}"),
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=tiktoken_special_tokens, vocab_size=vocab_size)
    else:
        tokenizer = NullTokenizer(need(vocab_size, "--vocab-size", "ids 0..N-1, eod N"))

    if vocab_size is not None and vocab_size != tokenizer.vocab_size and \
            tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        # Silently ignoring it would build an embedding of another size than the user asked.
        raise ValueError(
            f"--vocab-size {vocab_size} does not apply to --tokenizer-type {tokenizer_type} "
            f"(its vocabulary is the tokenizer's {tokenizer.vocab_size} tokens); to give the "
            f"embedding {vocab_size} rows pass --padded-vocab-size {vocab_size} instead.")
    tokenizer.padded_vocab_size = padded_vocab_size(
        tokenizer.vocab_size, padded_vocab_size_flag, make_vocab_size_divisible_by,
        tensor_model_parallel_size)
    logger.info("built %s: padded vocab from %d to %d (divisible by %d x TP %d)",
                tokenizer_type, tokenizer.vocab_size, tokenizer.padded_vocab_size,
                make_vocab_size_divisible_by, tensor_model_parallel_size)
    return tokenizer


def build_tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizer:
    """``build_tokenizer`` from parsed flags; TP size is 1 where the namespace has none."""
    tensor_model_parallel_size = getattr(args, "tensor_model_parallel_size", None)
    return build_tokenizer(
        getattr(args, "tokenizer_type", None),
        vocab_file=getattr(args, "vocab_file", None),
        merge_file=getattr(args, "merge_file", None),
        tokenizer_model=getattr(args, "tokenizer_model", None),
        tokenizer_name_or_path=getattr(args, "tokenizer_name_or_path", None),
        vocab_size=getattr(args, "vocab_size", None),
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
        tensor_model_parallel_size=(1 if tensor_model_parallel_size is None
                                    else tensor_model_parallel_size),
        tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
        tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens",
                                            DEFAULT_NUM_SPECIAL_TOKENS),
        tiktoken_special_tokens=getattr(args, "tiktoken_special_tokens", None),
        padded_vocab_size_flag=getattr(args, "padded_vocab_size", None),
    )
