"""``--tokenizer-type TikTokenizer``: a local tiktoken BPE file run by tiktoken, with
Megatron-LM's special-token layout and flags.

Ids (Megatron's ``CustomTikTokenizer`` convention):

* ids 0..N-1 are special tokens, N = ``--tiktoken-num-special-tokens`` (default 1000): first
  ``--tiktoken-special-tokens`` (default ``<unk> <s> </s>``, which any list must contain), then
  fillers ``<SPECIAL_i>`` up to N;
* the file's BPE rank r is id N + r.

So ``unk`` = 0, ``bos`` = 1 (``<s>``), ``eos`` = ``eod`` = 2 (``</s>``) with the default list;
``pad`` is None. (LLaMA-3 itself appends its 256 special tokens *after* the 128000 ranks
instead; a checkpoint converted from Meta's ids needs its embedding rows moved accordingly.)
A special token's string inside the text is encoded as plain text, so a document cannot forge a
boundary: ``eod`` is only ever added by id.
"""
import os
from functools import cached_property
from typing import Dict, Iterable, List, Optional, Sequence

import tiktoken

from megatron.training.tokenizer.base import (
    MegatronTokenizer,
    as_id_list,
    check_batch,
    require_file,
)
from megatron.training.tokenizer.tiktoken_files import load_ranks

# The pre-tokenizer regexes, by --tiktoken-pattern name. The file's ranks only give the ids
# its trainer meant when the text is split the way it was split in training.
PATTERNS = {
    # Meta's LLaMA-3 (meta-llama/llama3, llama/tokenizer.py, Tokenizer.pat_str): GPT-4's
    # cl100k regex as OpenAI first published it.
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # GPT-4's cl100k_base as the tiktoken package ships it today (tiktoken_ext/openai_public.py):
    # possessive quantifiers, and whitespace that ends the text is one piece ("\s++$"), where
    # "llama3" splits it after its last newline.
    "cl100k": r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"
              r"| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
    # GPT-4o's o200k_base (tiktoken_ext/openai_public.py): cased words keep their contraction.
    "o200k": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Megatron-LM's names (megatron/training/tokenizer/tokenizer.py, PATTERN_TIKTOKEN and
    # PATTERN_TIKTOKEN_V2): v1 has no contractions and single digits; v2 is o200k's word rule
    # without contractions, with single digits.
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
DEFAULT_NUM_SPECIAL_TOKENS = 1000


def special_token_list(special_tokens: Optional[Sequence[str]],
                       num_special_tokens: int) -> List[str]:
    """The N special tokens in id order: the given ones, then ``<SPECIAL_i>`` fillers."""
    tokens = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    duplicates = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicates:
        raise ValueError(f"--tiktoken-special-tokens lists {', '.join(duplicates)} more than "
                         f"once; list each special token once.")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ValueError(f"--tiktoken-special-tokens lacks {' '.join(missing)}; the list must "
                         f"contain {' '.join(REQUIRED_SPECIAL_TOKENS)} (unk, bos, eos).")
    if len(tokens) > num_special_tokens:
        raise ValueError(f"--tiktoken-special-tokens lists {len(tokens)} tokens but "
                         f"--tiktoken-num-special-tokens is {num_special_tokens}; raise it to "
                         f"at least {len(tokens)}.")
    fillers = [f"<SPECIAL_{i}>" for i in range(len(tokens), num_special_tokens)]
    clashes = sorted(set(fillers) & set(tokens))
    if clashes:
        raise ValueError(f"--tiktoken-special-tokens: {clashes[0]} is the name of a filler "
                         f"token at another id; rename it.")
    return tokens + fillers


def byte_level_alphabet() -> Dict[int, str]:
    """A printable character per byte (GPT-2's byte-level alphabet, which Hugging Face's
    tokenizer.json uses for LLaMA-3's vocabulary): token bytes -> a lossless ``vocab`` key."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in kept}
    others = [b for b in range(256) if b not in alphabet]
    alphabet.update({b: chr(256 + n) for n, b in enumerate(others)})
    return alphabet


class TikTokenizer(MegatronTokenizer):
    """Megatron's ``TikTokenizer`` over a local BPE file (see the module docstring for ids).

    ``pattern`` names a regex in ``PATTERNS``. ``vocab_size``, when given, is the total
    vocabulary as in Megatron (``--vocab-size``): the file's ranks are cut to
    ``vocab_size - num_special_tokens``.
    """

    def __init__(self, model_file: str, pattern: str,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
                 special_tokens: Optional[Sequence[str]] = None,
                 vocab_size: Optional[int] = None):
        if pattern not in PATTERNS:
            raise ValueError(f"unknown --tiktoken-pattern {pattern!r}; choose one of: "
                             f"{', '.join(PATTERNS)}.")
        specials = special_token_list(special_tokens, num_special_tokens)
        ranks = load_ranks(require_file(model_file, "--tokenizer-model"))
        ranks = _cut_ranks(model_file, ranks, num_special_tokens, vocab_size)
        self._num_special = num_special_tokens
        self._specials = {token: i for i, token in enumerate(specials)}
        self._ranks = ranks
        self._encoding = tiktoken.Encoding(
            name=f"TikTokenizer:{os.path.basename(model_file)}", pat_str=PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self._specials)
        self._num_threads = max(1, min(8, len(os.sched_getaffinity(0))))

    @property
    def vocab_size(self) -> int:
        return self._num_special + len(self._ranks)

    @cached_property
    def vocab(self) -> Dict[str, int]:
        """Special tokens by name, BPE tokens in the byte-level alphabet (as HF shows them);
        a BPE token spelled like a special token (b"<s>") is listed under the special's id."""
        alphabet = byte_level_alphabet()
        vocab = {"".join(alphabet[b] for b in token): rank + self._num_special
                 for token, rank in self._ranks.items()}
        vocab.update(self._specials)
        return vocab

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = self._encoding.encode_ordinary(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # tiktoken releases the GIL while encoding: its threads run in parallel.
        return self._encoding.encode_ordinary_batch(list(check_batch(texts)),
                                                    num_threads=self._num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = as_id_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"cannot detokenize id {bad[0]}: TikTokenizer ids run "
                             f"0..{self.vocab_size - 1} (ids above are vocabulary padding).")
        # Invalid UTF-8 byte runs become U+FFFD, as Megatron's other tokenizers decode them.
        return self._encoding.decode(ids, errors="replace")

    @property
    def unk(self) -> int:
        return self._specials["<unk>"]

    @property
    def bos(self) -> int:
        return self._specials["<s>"]

    @property
    def eos(self) -> int:
        return self._specials["</s>"]

    @property
    def eod(self) -> int:
        return self.eos


def _cut_ranks(model_file: str, ranks: Dict[bytes, int], num_special_tokens: int,
               vocab_size: Optional[int]) -> Dict[bytes, int]:
    """Megatron's ``--vocab-size``: keep the first ``vocab_size - N`` ranks."""
    if vocab_size is None:
        return ranks
    available = num_special_tokens + len(ranks)
    if not num_special_tokens + 256 <= vocab_size <= available:
        raise ValueError(
            f"--vocab-size {vocab_size} does not fit --tokenizer-model {model_file}: with "
            f"{num_special_tokens} special tokens it must lie between {num_special_tokens + 256} "
            f"(the 256 single bytes) and {available} (all {len(ranks)} ranks of the file); "
            f"omit --vocab-size to use the whole file.")
    kept = {token: rank for token, rank in ranks.items() if rank < vocab_size - num_special_tokens}
    missing = [b for b in range(256) if bytes([b]) not in kept]
    if missing:
        raise ValueError(f"--vocab-size {vocab_size} cuts the single-byte token of byte "
                         f"0x{missing[0]:02x} (its rank is {ranks[bytes([missing[0]])]}); "
                         f"raise --vocab-size or omit it.")
    return kept
