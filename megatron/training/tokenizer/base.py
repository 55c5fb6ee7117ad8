"""The interface every ``--tokenizer-type`` implements, and small helpers they share."""
import os
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Dict, Iterable, List, Optional, Sequence


class MegatronTokenizer(ABC):
    """Text <-> token ids, with Megatron's names.

    ``eod``, ``bos``, ``eos`` and ``pad`` are ints, or None where the tokenizer has no such
    token (Megatron raises NotImplementedError there; an ``is None`` test is easier to use).
    ``padded_vocab_size`` is set by ``build_tokenizer``: the embedding's row count.
    """

    padded_vocab_size: Optional[int] = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, before padding for tensor parallelism."""

    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""

    @cached_property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string. Cached: real vocabularies have 50k-250k entries."""
        return {i: token for token, i in self.vocab.items()}

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Ids of one text."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of many texts; subclasses with a native batch encoder override this."""
        return [self.tokenize(text) for text in check_batch(texts)]

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids."""

    @property
    def eod(self) -> Optional[int]:
        """End-of-document id, appended between documents by data preprocessing."""
        return None

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def eos(self) -> Optional[int]:
        return None

    @property
    def pad(self) -> Optional[int]:
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, "
                f"padded_vocab_size={self.padded_vocab_size}, eod={self.eod}, bos={self.bos}, "
                f"eos={self.eos}, pad={self.pad})")


def check_batch(texts: Sequence[str]) -> Sequence[str]:
    # A str is a sequence of characters: without this check it would be tokenized char by char.
    if isinstance(texts, str):
        raise TypeError("tokenize_batch takes a list of texts; use tokenize() for a single text.")
    return texts


def as_id_list(ids: Iterable[int]) -> List[int]:
    """Plain ints, so numpy arrays and torch tensors (e.g. a sample from the dataset) decode too."""
    return [int(i) for i in ids]


def optional_id(token_id: Optional[int]) -> Optional[int]:
    """sentencepiece and friends say "no such token" with -1; we say None."""
    if token_id is None or token_id < 0:
        return None
    return int(token_id)


def require_file(path: str, flag: str) -> str:
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{flag} {path} {what}; pass the path of an existing file.")
    return path
