"""The tokenizer sidecar: a small JSON file beside a `.bin/.idx` pair, `<prefix>.tokenizer.json`,
saying which tokenizer made the tokens (its fingerprint: type, source, vocab size, vocabulary
sha256) and the largest token id in the `.bin`.

Megatron's own files stay as they are (the `.idx` is byte-identical to Megatron's format), so
a pair without a sidecar (made by Megatron) still loads; with one, training can refuse a corpus
made with another tokenizer, and check every id against the vocabulary without reading the
`.bin`. The file is plain JSON (loading it runs no code) and written atomically."""
import json
import os
from typing import Dict, Optional

from megatron.core.datasets.indexed_dataset import IndexedDatasetError

SIDECAR_SUFFIX = ".tokenizer.json"  # Megatron writes only .bin/.idx: no name collides
FORMAT = "megatron-tokenizer-sidecar"
VERSION = 1
_FIX = "re-run tools/preprocess_data.py to rewrite it, or delete it to train without the check"


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def write_sidecar(prefix: str, tokenizer: Dict, max_token_id: Optional[int]) -> str:
    """Write the sidecar of the pair at ``prefix`` (call after the pair is in place): to a
    temporary name in the same directory, then renamed, so a reader never sees half of it."""
    path = sidecar_path(prefix)
    record = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer,
              "max_token_id": None if max_token_id is None else int(max_token_id)}
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def remove_sidecar(prefix: str) -> None:
    """Drop a previous run's sidecar before its pair is replaced: a new pair must never sit
    beside an old sidecar that describes other tokens."""
    try:
        os.remove(sidecar_path(prefix))
    except FileNotFoundError:
        pass


def read_sidecar(prefix: str) -> Optional[Dict]:
    """The sidecar of ``prefix`` ({"tokenizer": {...}, "max_token_id": int or None}), None when
    the pair has none; IndexedDatasetError naming the file when it is unreadable."""
    path = sidecar_path(prefix)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexedDatasetError(f"{path}: not a readable tokenizer sidecar ({exc}); "
                                  f"{_FIX}") from None
    tokenizer = record.get("tokenizer") if isinstance(record, dict) else None
    largest = record.get("max_token_id") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or record.get("format") != FORMAT
            or not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("sha256"), str)
            or not (largest is None or (isinstance(largest, int) and largest >= 0))):
        raise IndexedDatasetError(f"{path}: not a tokenizer sidecar of this format (want "
                                  f"'format': '{FORMAT}', a 'tokenizer' with its 'sha256' and "
                                  f"an integer 'max_token_id'); {_FIX}")
    return record
