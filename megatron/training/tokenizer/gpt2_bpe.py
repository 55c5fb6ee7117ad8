"""GPT-2's byte-level BPE from vocab.json + merges.txt, run by the Rust ``tokenizers`` library."""
from functools import cached_property
from typing import Dict, Iterable, List, Sequence

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from megatron.training.tokenizer.unit_cache import UnitCache
from megatron.training.tokenizer.base import (
    MegatronTokenizer,
    as_id_list,
    check_batch,
    require_file,
)

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """Megatron's ``GPT2BPETokenizer``: same ids as its Python BPE and as transformers'
    GPT2Tokenizer, at Rust speed.

    ``<|endoftext|>`` in the *text* is encoded as plain characters, as Megatron's tokenizer does,
    so a document quoting it cannot forge a document boundary; ``eod`` is appended by id.
    (transformers' GPT2Tokenizer matches that with ``split_special_tokens=True``.)
    ``eod`` = ``bos`` = ``eos`` = the id of ``<|endoftext|>`` (GPT-2's only special token, which
    transformers also reports as bos/eos); ``pad`` is None.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        require_file(vocab_file, "--vocab-file")
        require_file(merge_file, "--merge-file")
        try:
            model = BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            reason = " ".join(str(e).split())
            raise ValueError(
                f"could not read GPT-2 BPE files --vocab-file {vocab_file} and --merge-file "
                f"{merge_file} ({reason}); they must be GPT-2's vocab.json and merges.txt.") from e
        tokenizer = Tokenizer(model)
        # GPT-2 splits words itself with the byte-level regex; no leading space is invented.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        eod = tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(
                f"--vocab-file {vocab_file} has no {EOD_TOKEN} token, which GPT2BPETokenizer uses "
                f"as its end-of-document id; add it to the vocabulary (train with "
                f"special_tokens=['{EOD_TOKEN}']) or use another --tokenizer-type.")
        self._tokenizer = tokenizer
        self._eod = eod
        # Rust's batch encoder without offset tracking where the installed version has it.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._unit_cache = UnitCache(self._encode_ids)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # Same ids as tokenize() per text; repeated words are looked up, not re-encoded.
        return self._unit_cache.tokenize_batch(check_batch(texts))

    def _encode_ids(self, texts: List[str]) -> List[List[int]]:
        return [e.ids for e in self._encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        # Invalid UTF-8 byte runs become U+FFFD, like Megatron's errors='replace'.
        return self._tokenizer.decode(as_id_list(ids), skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod
