"""A tokenizer saved by transformers (``save_pretrained``) in a local directory."""
import os
from functools import cached_property
from typing import Dict, Iterable, List, Optional, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer, as_id_list, check_batch


# What save_pretrained() writes for the tokenizers transformers can load from files: a fast
# tokenizer's tokenizer.json, a BPE's vocab.json (+ merges.txt), WordPiece's vocab.txt, a
# sentencepiece *.model, a tiktoken file. Without one, AutoTokenizer may still "load" a
# tokenizer of one token from a config.json alone, which fails later in the embedding.
EXPECTED_FILES = ("tokenizer.json", "vocab.json + merges.txt", "vocab.txt",
                  "a sentencepiece *.model", "*.tiktoken")


def has_tokenizer_files(directory: str) -> bool:
    names = set(os.listdir(directory))
    return bool(names & {"tokenizer.json", "vocab.json", "vocab.txt"}) or any(
        name.endswith((".model", ".tiktoken")) for name in names)


def check_tokenizer_directory(directory: str, flag: str) -> None:
    """The directory exists and holds tokenizer files; one line saying what is missing."""
    if not os.path.isdir(directory):
        problem = "is a file" if os.path.exists(directory) else "does not exist"
        raise FileNotFoundError(
            f"{flag} {directory} {problem}: only local directories are supported (no "
            f"downloads from the Hugging Face hub). Download the tokenizer first (e.g. "
            f"`huggingface-cli download <repo> --local-dir <dir>`) and pass that directory.")
    if not has_tokenizer_files(directory):
        found = sorted(os.listdir(directory))
        shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "") if found else "nothing"
        raise ValueError(
            f"{flag} {directory} holds no tokenizer files (it has: {shown}); expected one of: "
            f"{', '.join(EXPECTED_FILES)}. Pass the directory that tokenizer.save_pretrained() "
            f"wrote (or that holds the model's downloaded tokenizer files).")


class HuggingFaceTokenizer(MegatronTokenizer):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; never reaches a hub.

    ``tokenize`` returns the tokenizer's ``input_ids`` with its own special tokens (e.g. a BOS),
    as Megatron does. ``eod`` = ``eos`` = ``eos_token_id``; ``bos``/``pad`` are the tokenizer's ids;
    each is None where the tokenizer defines no such token. ``vocab_size`` counts added tokens.
    """

    def __init__(self, name_or_path: str, flag: str = "--tokenizer-name-or-path"):
        check_tokenizer_directory(name_or_path, flag)
        from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            reason = " ".join(str(e).split())  # transformers' messages span several lines
            raise ValueError(
                f"{flag} {name_or_path} holds no loadable Hugging Face tokenizer ({reason}); "
                f"it must contain the files written by tokenizer.save_pretrained().") from e
        if len(self._tokenizer) < 2:
            raise ValueError(
                f"{flag} {name_or_path} loads as a tokenizer of {len(self._tokenizer)} token(s); "
                f"its tokenizer files are incomplete: pass the directory that "
                f"tokenizer.save_pretrained() wrote.")

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
