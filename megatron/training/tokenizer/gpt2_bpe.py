"""GPT-2's byte-level BPE from vocab.json + merges.txt, run by tiktoken's Rust encoder where its
ids are provably the same (see tiktoken_bpe.py), else by the Rust ``tokenizers`` library."""
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Dict, Iterable, List, Sequence

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from megatron.training.tokenizer.base import (
    MegatronTokenizer,
    as_id_list,
    check_batch,
    require_file,
)
from megatron.training.tokenizer.tiktoken_bpe import tiktoken_encoder
from megatron.training.tokenizer.unit_cache import UnitCache

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
# tokenizers' own spellings of "no" for TOKENIZERS_PARALLELISM, which we honour for threads too.
PARALLELISM_OFF = ("", "0", "false", "f", "off", "no", "n")


class GPT2BPETokenizer(MegatronTokenizer):
    """Megatron's ``GPT2BPETokenizer``: same ids as its Python BPE and as transformers'
    GPT2Tokenizer, at Rust speed.

    ``<|endoftext|>`` in the *text* is encoded as plain characters, as Megatron's tokenizer does,
    so a document quoting it cannot forge a document boundary; ``eod`` is appended by id.
    (transformers' GPT2Tokenizer matches that with ``split_special_tokens=True``.)
    ``eod`` = ``bos`` = ``eos`` = the id of ``<|endoftext|>`` (GPT-2's only special token, which
    transformers also reports as bos/eos); ``pad`` is None.

    Encoding runs on tiktoken when ``tiktoken_encoder`` proves its ids equal (checked at the
    first encoding; a log line says when it cannot, and why); ``use_tiktoken=False`` forces
    the ``tokenizers`` path.
    ``tokenize_batch`` spreads a batch over one thread per core unless TOKENIZERS_PARALLELISM
    says no (preprocessing workers set it), as the ``tokenizers`` batch encoder does.
    """

    def __init__(self, vocab_file: str, merge_file: str, use_tiktoken: bool = True):
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
        # Built on first use: a process that never encodes (preprocessing's parent, training)
        # skips the checks' tenth of a second.
        self._fast, self._fast_built = None, not use_tiktoken
        self._vocab_file = vocab_file
        self._pool, self._pool_pid = None, None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def uses_tiktoken(self) -> bool:
        return self._tiktoken() is not None

    def _tiktoken(self):
        if not self._fast_built:
            self._fast, reason = tiktoken_encoder(self._tokenizer)
            self._fast_built = True
            if reason:
                logger.warning("GPT2BPETokenizer: not using tiktoken for %s (%s); encoding with "
                               "tokenizers instead (same ids, slower)", self._vocab_file, reason)
        return self._fast

    def tokenize(self, text: str) -> List[int]:
        if self._tiktoken() is not None:
            return self._tiktoken_ids(text)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        texts = check_batch(texts)
        if self._tiktoken() is None:
            # Same ids as tokenize() per text; repeated words are looked up, not re-encoded
            # (a cache that pays on the tokenizers path; tiktoken is faster without it).
            return self._unit_cache.tokenize_batch(texts)
        threads = self._threads()
        if threads == 1 or len(texts) < 2 * threads:
            return [self._tiktoken_ids(text) for text in texts]
        # tiktoken releases the GIL while it encodes: contiguous slices, one per thread.
        size = -(-len(texts) // threads)
        slices = [texts[i:i + size] for i in range(0, len(texts), size)]
        out: List[List[int]] = []
        for ids in self._thread_pool(threads).map(self._tiktoken_many, slices):
            out += ids
        return out

    def _tiktoken_ids(self, text: str) -> List[int]:
        try:
            return self._fast.encode_ordinary(text)
        except UnicodeEncodeError:
            # A lone surrogate: let tokenizers raise its own error, as without tiktoken.
            return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _tiktoken_many(self, texts: Sequence[str]) -> List[List[int]]:
        return [self._tiktoken_ids(text) for text in texts]

    @staticmethod
    def _threads() -> int:
        setting = os.environ.get("TOKENIZERS_PARALLELISM")
        if setting is not None and setting.strip().lower() in PARALLELISM_OFF:
            return 1
        return max(1, min(os.cpu_count() or 1, 16))

    def _thread_pool(self, threads: int) -> ThreadPoolExecutor:
        # A pool made before a fork has no threads in the child: make one per process.
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gpt2-bpe")
            self._pool_pid = os.getpid()
        return self._pool

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
