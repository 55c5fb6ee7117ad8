"""tiktoken's Rust encoder for a GPT-2-style BPE, used only where its ids are provably the same.

GPT2BPETokenizer's reference is the ``tokenizers`` BPE built from vocab.json + merges.txt with
GPT-2's byte-level pre-tokenizer (no prefix space). tiktoken is several times faster on the
same job but runs a different algorithm, so ``tiktoken_encoder`` builds it only when the
conditions below hold, and otherwise returns the reason (the caller keeps the tokenizers BPE).

The two algorithms, on one piece (a regex match) cut into single-byte parts:
  HF: while some adjacent pair (x, y) is in the merge list, merge the one of lowest merge rank
      (leftmost among equals). It only ever makes bytes and merge results.
  tiktoken: if the whole piece is a token, emit it. Otherwise, while some adjacent pair's
      concatenation x+y is a token, merge the one whose token has the lowest rank (leftmost
      among equals). The rank is also the id it emits.
We give tiktoken the ranks R = {byte b: id(b)} + {merge result t: id(t)} and nothing else.

Conditions (checked on the files):
  C1. Every byte's GPT-2 character is in the vocabulary, and the ids in R are distinct.
  C2. No two merges make the same token, and merge results use only the byte alphabet.
  C3. The ids of merge results increase strictly with merge rank.
  C4. Every merge result t is "self-reachable": HF's BPE of t's own bytes is [t].
  C5. The pre-tokenizers cut text the same way: the same GPT-2 regex, and the two regex
      engines (Oniguruma in tokenizers, fancy-regex in tiktoken) agree on \\p{L}, \\p{N} and \\s
      for every code point (checked once per pair of library versions: about a second, the
      verdict then cached in the temp directory).

Why they suffice. Take a piece; suppose both algorithms have the same parts so far (true at
the start: single bytes, which exist by C1), a state HF reaches.
  (i) If adjacent parts x, y have x+y = t in R, then (x, y) is t's merge. Because HF reached a
      state with x and y as parts, HF run on t's bytes alone passes through [x, y] (merges
      inside a span never depend on what lies outside it: the lowest-ranked pair inside the
      span is taken first either way). From [x, y] HF can only merge (x, y) or stop; by C4 it
      ends at [t], so (x, y) is a merge, and by C2 the one that makes t.
  (ii) So both see the same candidate pairs (the adjacent pairs in the merge list), and by C3
      order them the same way: id(x+y) rises with rank(x, y), equal only for the same merge;
      both take the leftmost of equals. They make the same merge, and by induction end with
      the same parts, whose ids are the vocabulary's (R holds the vocabulary's ids).
  (iii) tiktoken's shortcut (a whole piece that is a token) gives [t], and HF's merging of
      the piece gives [t] too by C4 (bytes are trivially so).
Tokens in neither set (e.g. ``<|endoftext|>``) are never produced by HF and are not given to
tiktoken; ``<|endoftext|>`` in text is therefore plain text for both (encode_ordinary).

Text HF rejects (a lone surrogate) raises here too rather than being replaced as tiktoken's
own wrapper would, so the same documents are refused.
"""
import json
import logging
import os
import tempfile
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

# GPT-2's pre-tokenizer regex, as tokenizers' ByteLevel(use_regex=True) applies it.
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                r"""|\s+(?!\S)|\s+""")
# The character classes the pattern depends on, each with its complement (for tokenizers).
CLASSES = ((r"\p{L}", r"\P{L}"), (r"\p{N}", r"\P{N}"), (r"\s", r"\S"))
# What a BPE model must look like for the argument above (tokenizers' JSON field names).
PLAIN_BPE = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "byte_fallback": False, "ignore_merges": False}


def byte_alphabet() -> Dict[str, int]:
    """GPT-2's printable character for each byte -> the byte: printable Latin-1 bytes stand for
    themselves, the other 68 are shifted to 256 and up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in set(printable)]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return alphabet


def _code_points() -> str:
    return "".join(map(chr, [*range(0xD800), *range(0xE000, 0x110000)]))


def _compute_classes_agree() -> bool:
    import tiktoken
    from tokenizers import Regex, pre_tokenizers

    text = _code_points()
    byte_ranks = {bytes([b]): b for b in range(256)}
    for cls, complement in CLASSES:
        # tiktoken encodes only the matches: with byte ranks that is the class's members.
        members = tiktoken.Encoding(f"class{cls}", pat_str=cls + "+", special_tokens={},
                                    mergeable_ranks=byte_ranks)
        rust = bytes(members._core_bpe.encode_ordinary(text))
        split = pre_tokenizers.Split(Regex(complement + "+"), behavior="removed")
        onig = "".join(piece for start in range(0, len(text), 4096)
                       for piece, _ in split.pre_tokenize_str(text[start:start + 4096]))
        if rust != onig.encode("utf-8"):
            return False
    return True


@lru_cache(maxsize=None)
def regex_classes_agree() -> bool:
    """C5's engine check over every code point (about a second), cached on disk by version."""
    import tiktoken
    import tokenizers

    key = f"{tokenizers.__version__}-{tiktoken.__version__}"
    path = os.path.join(tempfile.gettempdir(), f"megatron-gpt2-regex-classes-{key}.txt")
    try:  # only a verdict this user wrote: another user could plant one in a shared /tmp
        if os.stat(path).st_uid == os.getuid():
            with open(path, encoding="utf-8") as f:
                return f.read() == "agree"
    except OSError:
        pass
    agree = _compute_classes_agree()
    try:  # a read-only temp dir only costs the check again next time
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            f.write("agree" if agree else "differ")
        os.replace(f.name, path)
    except OSError:
        pass
    return agree


def _byte_table() -> Dict[int, int]:
    """For str.translate: GPT-2 character -> its byte as a code point below 256; any other
    code point below 0x144 -> U+FFFF, so that encoding the result as Latin-1 fails for them
    (as it does for code points the table leaves alone, all above 0x143)."""
    table = {cp: 0xFFFF for cp in range(0x144)}
    table.update({ord(char): byte for char, byte in byte_alphabet().items()})
    return table


def mergeable_ranks(model: dict, self_encoded: List[int]
                    ) -> Tuple[Optional[Dict[bytes, int]], str]:
    """(R, "") when C1-C4 hold for the tokenizers BPE ``model`` (its JSON: vocab, merges, ...),
    given HF's ids for the merge results' own texts, concatenated; else (None, the first
    failed condition)."""
    for field, want in PLAIN_BPE.items():
        if model.get(field, want) != want:
            return None, f"the BPE model sets {field}={model[field]!r}"
    vocab, alphabet = model["vocab"], byte_alphabet()
    missing = [char for char in alphabet if char not in vocab]
    if missing:
        return None, f"{len(missing)} byte token(s) not in the vocabulary (e.g. {missing[0]!r})"
    ranks = {bytes([byte]): vocab[char] for char, byte in alphabet.items()}
    tokens = merge_results(model)
    ids = [vocab[token] for token in tokens]  # tokenizers has checked they are all there
    if self_encoded != ids:  # C4, found one token at a time only when it fails
        return None, not_self_reachable(tokens, ids, self_encoded)
    table, previous_id = _byte_table(), -1
    for rank, (token, token_id) in enumerate(zip(tokens, ids)):
        try:
            key = token.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            return None, f"merge {rank} makes {token!r}, which has characters outside the bytes"
        if key in ranks:
            return None, f"merge {rank} makes {token!r}, which another merge makes too"
        if token_id <= previous_id:
            return None, (f"merge {rank} makes {token!r} with id {token_id}, not above the "
                          f"previous merge's id {previous_id}: ids do not follow merge order")
        ranks[key] = previous_id = token_id
    if len(set(ranks.values())) != len(ranks):
        return None, "two mergeable tokens share an id"
    return ranks, ""


def merge_results(model: dict) -> List[str]:
    return ["".join(p.split(" ", 1) if isinstance(p, str) else p) for p in model["merges"]]


def not_self_reachable(tokens: List[str], ids: List[int], self_encoded: List[int]) -> str:
    """Which token fails C4: the first whose ids in ``self_encoded`` are not its own."""
    for rank, (token, token_id) in enumerate(zip(tokens, ids)):
        if rank >= len(self_encoded) or self_encoded[rank] != token_id:
            return f"token {token!r} (merge {rank}) does not encode to itself"
    return "the merge results do not encode to themselves"


def tiktoken_encoder(hf_tokenizer) -> Tuple[Optional[object], str]:
    """(an encoder with ``encode_ordinary(text) -> ids``, "") when tiktoken provably gives the
    same ids as ``hf_tokenizer`` (a tokenizers.Tokenizer: BPE model, GPT-2 byte-level
    pre-tokenizer without prefix space); else (None, why not)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    from tokenizers import Tokenizer, pre_tokenizers

    model = json.loads(hf_tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        return None, f"the model is {model.get('type')}, not BPE"
    # C4: HF's BPE of each merge result's own characters, all in one call: the results are
    # joined by spaces and split there (no GPT-2 byte character is whitespace).
    bare = Tokenizer(hf_tokenizer.model)
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    encode = getattr(bare, "encode_batch_fast", bare.encode_batch)
    self_encoded = encode([" ".join(merge_results(model))], add_special_tokens=False)[0].ids
    ranks, reason = mergeable_ranks(model, self_encoded)
    if ranks is None:
        return None, reason
    if not regex_classes_agree():
        return None, ("the installed tokenizers and tiktoken disagree on \\p{L}, \\p{N} or \\s "
                      "for some character")
    encoding = tiktoken.Encoding("gpt2-style-bpe", pat_str=GPT2_PATTERN,
                                 mergeable_ranks=ranks, special_tokens={})
    # The core raises on unencodable text (lone surrogates), as tokenizers does.
    return encoding._core_bpe, ""
