"""Megatron's NullTokenizer: text is already ids (mock data, benchmarks)."""
from functools import cached_property
from typing import Dict, Iterable, List

from megatron.training.tokenizer.base import MegatronTokenizer, as_id_list


class NullTokenizer(MegatronTokenizer):
    """Whitespace-separated integers <-> ids. ``--vocab-size N`` gives ids 0..N-1 plus
    ``eod`` = N, so ``vocab_size`` = N + 1 (Megatron's convention). ``bos``/``eos``/``pad`` are
    None. Token strings are the decimal ids.
    """

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size N with N a positive integer "
                             f"(ids 0..N-1, end-of-document id N); got {vocab_size!r}.")
        self._eod = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @cached_property
    def vocab(self) -> Dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                token_id = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer reads whitespace-separated integer ids; "
                                 f"got {word!r}.") from None
            if not 0 <= token_id <= self._eod:
                raise ValueError(f"NullTokenizer id {token_id} is outside 0..{self._eod} "
                                 f"(--vocab-size {self._eod} plus the end-of-document id).")
            ids.append(token_id)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in as_id_list(ids))

    @property
    def eod(self) -> int:
        return self._eod
