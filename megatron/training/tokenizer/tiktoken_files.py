"""Reading a tiktoken BPE file into ``{token bytes: rank}``, with one-line errors naming the file,
the line and the fix.

Two layouts are read, told apart by their first character:

* tiktoken's own (LLaMA-3's ``tokenizer.model``, OpenAI's ``*.tiktoken``): one
  ``base64(token bytes) rank`` per line;
* Megatron-LM's / NeMo's vocabulary JSON: a list of ``{"rank", "token_bytes", "token_str"}``
  objects, ``token_bytes`` in base64, entry i of rank i.

Either way the ranks must be unique and run 0..n-1, and all 256 single bytes must be tokens:
tiktoken's byte-level BPE cannot encode a byte it has no token for.
"""
import base64
import binascii
import json
import re
from typing import Dict, Iterator, Tuple

FORMAT_HINT = ("a tiktoken BPE file has one 'base64(token bytes) rank' per line (as LLaMA-3's "
               "tokenizer.model)")
# Base64, digits and whitespace are all a tiktoken file holds; anything else is another format.
NOT_TEXT = re.compile(rb"[^\x20-\x7e\t\n\r]")


def load_ranks(path: str) -> Dict[bytes, int]:
    """``{token bytes: rank}`` of the file at ``path`` (either layout), validated."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise ValueError(f"--tokenizer-model {path} is empty; {FORMAT_HINT}.")
    if data.lstrip()[:1] == b"{":
        raise ValueError(f"--tokenizer-model {path} is a JSON object, not a tiktoken BPE file "
                         f"(a Hugging Face tokenizer.json needs --tokenizer-type "
                         f"HuggingFaceTokenizer with its directory); {FORMAT_HINT}, or Megatron's "
                         f"vocabulary JSON is a list.")
    if data.lstrip()[:1] == b"[":
        ranks = _ranks_from_json(path, data)
    else:
        ranks = _ranks_from_lines(path, data)
    _check_contiguous(path, ranks)
    _check_single_bytes(path, ranks)
    return ranks


def _numbered_lines(path: str, data: bytes) -> Iterator[Tuple[int, str]]:
    binary = NOT_TEXT.search(data)
    if binary:
        lineno = data.count(b"\n", 0, binary.start()) + 1
        raise ValueError(
            f"--tokenizer-model {path} line {lineno} is not text: this is not a tiktoken "
            f"BPE file (a sentencepiece .model, e.g. LLaMA-2's tokenizer.model, needs "
            f"--tokenizer-type Llama2Tokenizer or SentencePieceTokenizer); {FORMAT_HINT}.")
    for lineno, line in enumerate(data.decode("ascii").split("\n"), start=1):
        if line.strip():
            yield lineno, line.strip()


def _ranks_from_lines(path: str, data: bytes) -> Dict[bytes, int]:
    ranks: Dict[bytes, int] = {}
    line_of_token: Dict[bytes, int] = {}
    line_of_rank: Dict[int, int] = {}
    for lineno, line in _numbered_lines(path, data):
        where = f"--tokenizer-model {path} line {lineno}"
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{where} has {len(fields)} fields ({_clip(line)!r}); "
                             f"{FORMAT_HINT}.")
        token = _decode_base64(fields[0], where)
        rank = _parse_rank(fields[1], where)
        if token in line_of_token:
            raise ValueError(f"{where}: token {token!r} is already on line "
                             f"{line_of_token[token]}; each token must appear once.")
        if rank in line_of_rank:
            raise ValueError(f"{where}: rank {rank} is already used on line "
                             f"{line_of_rank[rank]}; each rank must appear once.")
        ranks[token], line_of_token[token], line_of_rank[rank] = rank, lineno, lineno
    return ranks


def _ranks_from_json(path: str, data: bytes) -> Dict[bytes, int]:
    try:
        entries = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--tokenizer-model {path} starts like Megatron's vocabulary JSON but "
                         f"is not valid JSON ({e}); fix the file or write it in tiktoken's "
                         f"format: {FORMAT_HINT}.") from None
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model {path}: Megatron's vocabulary JSON must be a list.")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        where = f"--tokenizer-model {path} entry {i}"
        if not isinstance(entry, dict) or not {"rank", "token_bytes"} <= set(entry):
            raise ValueError(f"{where} is not an object with 'rank' and 'token_bytes' "
                             f"({_clip(repr(entry))}); Megatron's vocabulary JSON lists "
                             f'{{"rank": i, "token_bytes": base64, "token_str": ...}}.')
        rank = entry["rank"]
        if rank != i or isinstance(rank, bool):
            raise ValueError(f"{where} has rank {rank!r}; entry i must have rank i.")
        token = _decode_base64(str(entry["token_bytes"]), where)
        if token in ranks:
            raise ValueError(f"{where}: token {token!r} is already entry {ranks[token]}; "
                             f"each token must appear once.")
        ranks[token] = rank
    return ranks


def _decode_base64(text: str, where: str) -> bytes:
    try:
        token = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        token = b""
    if not token:
        raise ValueError(f"{where}: {_clip(text)!r} is not a token in base64; {FORMAT_HINT}.")
    return token


def _parse_rank(text: str, where: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{where}: the rank {_clip(text)!r} is not a non-negative integer; "
                         f"{FORMAT_HINT}.")
    return int(text)


def _check_contiguous(path: str, ranks: Dict[bytes, int]) -> None:
    # Ranks are unique (checked while reading), so they run 0..n-1 iff the largest is n-1.
    largest = max(ranks.values())
    if largest != len(ranks) - 1:
        missing = min(set(range(len(ranks))) - set(ranks.values()))
        raise ValueError(f"--tokenizer-model {path}: ranks must run 0..n-1 without gaps, but "
                         f"{len(ranks)} tokens have ranks up to {largest} (rank {missing} is "
                         f"missing); renumber the ranks in merge order.")


def _check_single_bytes(path: str, ranks: Dict[bytes, int]) -> None:
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (", ..." if len(missing) > 8
                                                                 else "")
        raise ValueError(f"--tokenizer-model {path} lacks the single-byte tokens of "
                         f"{len(missing)} byte(s) ({shown}); a byte-level BPE needs all 256 "
                         f"bytes as tokens, or text with those bytes cannot be encoded.")


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
