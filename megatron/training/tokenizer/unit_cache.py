"""A cache of token ids per whitespace-delimited unit, for GPT-2-style byte-level BPE.

GPT-2's pre-tokenizer never lets a piece cross the boundaries below, so a text can be cut there,
each unit tokenized on its own, and the ids concatenated: the result is the same. Natural text
repeats its units (Zipf), so most units are looked up instead of re-running the regex and the
BPE merges; that is what makes batch tokenization fast on few cores.

Units: a whitespace run followed by more text gives all but its last character as one unit (GPT-2's
``\\s+(?!\\S)``), and that last character starts the next unit together with the following
non-whitespace run (covering GPT-2's optional leading space). "Whitespace" is Unicode's
White_Space set, as GPT-2's regex engine defines ``\\s`` (Python's own ``\\s`` would also count
the separators U+001C..U+001F, which GPT-2 treats as punctuation).
"""
import re
from typing import Callable, Dict, List, Sequence

_WS = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_UNIT = re.compile(f"[{_WS}]+(?![^{_WS}])|[{_WS}]?[^{_WS}]+")
# Beyond this many entries the cache is dropped and refilled (bounded memory on huge corpora).
MAX_ENTRIES = 1 << 20


class UnitCache:
    def __init__(self, encode_batch: Callable[[List[str]], List[List[int]]]):
        self._encode_batch = encode_batch
        self._ids: Dict[str, List[int]] = {}

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        split = [_UNIT.findall(text) for text in texts]
        ids = self._ids
        missing = list({u for units in split for u in units if u not in ids})
        if missing:
            if len(ids) + len(missing) > MAX_ENTRIES:
                ids.clear()
            ids.update(zip(missing, self._encode_batch(missing)))
        out = []
        for units in split:
            tokens: List[int] = []
            for unit in units:
                tokens += ids[unit]
            out.append(tokens)
        return out
