"""A tokenizer saved by transformers (``save_pretrained``) in a local directory."""
import os
from functools import cached_property
from typing import Dict, Iterable, List, Optional, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer, as_id_list, check_batch


class HuggingFaceTokenizer(MegatronTokenizer):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; never reaches a hub.

    ``tokenize`` returns the tokenizer's ``input_ids`` with its own special tokens (e.g. a BOS),
    as Megatron does. ``eod`` = ``eos`` = ``eos_token_id``; ``bos``/``pad`` are the tokenizer's ids;
    each is None where the tokenizer defines no such token. ``vocab_size`` counts added tokens.
    """

    def __init__(self, name_or_path: str, flag: str = "--tokenizer-name-or-path"):
        if not os.path.isdir(name_or_path):
            problem = "is a file" if os.path.exists(name_or_path) else "does not exist"
            raise FileNotFoundError(
                f"{flag} {name_or_path} {problem}: only local directories are supported (no "
                f"downloads from the Hugging Face hub). Download the tokenizer first (e.g. "
                f"`huggingface-cli download <repo> --local-dir <dir>`) and pass that directory.")
        from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(
                f"{flag} {name_or_path} holds no loadable Hugging Face tokenizer ({e}); it must "
                f"contain the files written by tokenizer.save_pretrained().") from e

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @cached_property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab()

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer(text)["input_ids"]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # A fast (Rust) tokenizer encodes a list with encode_batch.
        return self._tokenizer(list(check_batch(texts)))["input_ids"]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(as_id_list(ids))

    @property
    def eod(self) -> Optional[int]:
        return self._tokenizer.eos_token_id

    @property
    def bos(self) -> Optional[int]:
        return self._tokenizer.bos_token_id

    @property
    def eos(self) -> Optional[int]:
        return self._tokenizer.eos_token_id

    @property
    def pad(self) -> Optional[int]:
        return self._tokenizer.pad_token_id
