"""Tokenizers over a sentencepiece ``--tokenizer-model``: plain, and LLaMA's BOS convention."""
from functools import cached_property
from typing import Dict, Iterable, List, Optional, Sequence

import sentencepiece

from megatron.training.tokenizer.base import (
    MegatronTokenizer,
    as_id_list,
    check_batch,
    optional_id,
    require_file,
)


def load_sentencepiece(model_file: str) -> sentencepiece.SentencePieceProcessor:
    require_file(model_file, "--tokenizer-model")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
        reason = " ".join(str(e).split())  # one line, whatever the library said
        raise ValueError(f"--tokenizer-model {model_file} is not a sentencepiece model ({reason}); "
                         f"pass a .model file written by sentencepiece's trainer.") from e


class SentencePieceTokenizer(MegatronTokenizer):
    """The model's own pieces and ids, nothing added.

    ``bos``/``eos``/``pad`` are the model's ids, None where the model sets them to -1;
    ``eod`` = ``eos``. Unlike Megatron's BERT/T5-oriented ``_SentencePieceTokenizer``, no
    <CLS>/<SEP>/<EOD>/<MASK> ids are appended, so ``vocab_size`` is the model's piece count.
    """

    def __init__(self, model_file: str):
        self._sp = load_sentencepiece(model_file)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @cached_property
    def vocab(self) -> Dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # A list goes through sentencepiece's C++ batch encoder (multi-threaded).
        return self._sp.encode(list(check_batch(texts)))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode(as_id_list(ids))

    @property
    def eod(self) -> Optional[int]:
        return self.eos

    @property
    def bos(self) -> Optional[int]:
        return optional_id(self._sp.bos_id())

    @property
    def eos(self) -> Optional[int]:
        return optional_id(self._sp.eos_id())

    @property
    def pad(self) -> Optional[int]:
        return optional_id(self._sp.pad_id())


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: ``tokenize`` prepends BOS and adds no EOS by default
    (text completion), ``eod`` = ``eos``. Control strings such as "<s>" in the text stay
    plain text, as with sentencepiece itself.
    """

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos is None or self.eos is None:
            raise ValueError(
                f"--tokenizer-model {model_file} has no BOS or EOS piece (bos_id="
                f"{self._sp.bos_id()}, eos_id={self._sp.eos_id()}); Llama2Tokenizer needs both. "
                f"Train the model with bos_id and eos_id set, or use --tokenizer-type "
                f"SentencePieceTokenizer.")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        return self._wrap(self._sp.encode(text), bos, eos)

    def tokenize_batch(self, texts: Sequence[str], bos: bool = True,
                       eos: bool = False) -> List[List[int]]:
        return [self._wrap(ids, bos, eos) for ids in self._sp.encode(list(check_batch(texts)))]

    def _wrap(self, ids: List[int], bos: bool, eos: bool) -> List[int]:
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])
