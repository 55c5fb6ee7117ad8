"""A task (a batch of JSONL lines, or a Parquet row group) -> token arrays per key, with the
bad lines or rows it held; runs in the worker processes (or in the main one, --workers 1)."""
import itertools
import json
import os
from typing import Dict, List, NamedTuple, Set, Tuple

import numpy as np

from megatron.core.datasets.indexed_dataset import best_fitting_dtype
from megatron.training.corpus.readers import RowGroupTask, read_row_group

MAX_SEEN_KEYS = 50  # keys of skipped lines remembered, to suggest --json-keys


class Encoded(NamedTuple):
    arrays: Dict[str, Tuple[np.ndarray, np.ndarray]]  # key -> (tokens, document lengths)
    problems: List[tuple]  # (line or row, where, category, detail), in input order
    lines: int
    rows: int
    text_bytes: int  # of the lines, or of the text cells of the rows
    blank: int  # blank lines
    seen_keys: Set[str]  # keys of the skipped JSON objects: what --json-keys could have been


class Encoder:
    """Bad lines and rows (malformed JSON, a missing, null or non-string key, text the
    tokenizer rejects or that tokenizes to nothing) are skipped for every key, so document i of
    each key's dataset comes from the same line or row."""

    def __init__(self, args, tokenizer):
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = tokenizer
        self.dtype = np.dtype(best_fitting_dtype(tokenizer.vocab_size))

    def encode(self, task) -> Encoded:
        if isinstance(task, RowGroupTask):
            return self._encode_rows(task)
        return self._encode_lines(task)

    def _encode_lines(self, batch):
        problems, linenos, blank, seen_keys = [], [], 0, set()
        texts = {key: [] for key in self.keys}
        for lineno, line in enumerate(batch.lines, batch.first_line):
            if not line.strip():
                blank += 1
                continue
            problem, doc = self._parse(line)
            if problem:
                problems.append((lineno, batch.where(lineno)) + problem)
                if isinstance(doc, dict) and len(seen_keys) < MAX_SEEN_KEYS:
                    seen_keys.update(doc)
                continue
            linenos.append(lineno)
            for key in self.keys:
                texts[key].append(doc[key])
        arrays = self._documents(batch, linenos, texts, problems)
        return Encoded(arrays, problems, len(batch.lines), 0, sum(map(len, batch.lines)), blank,
                       seen_keys)

    def _encode_rows(self, task):
        parts, problems, rows, text_bytes = [], [], 0, 0
        for first_row, columns, nbytes in read_row_group(task, self.keys):
            count = len(columns[self.keys[0]])
            numbers, texts = [], {key: [] for key in self.keys}
            for i, row in enumerate(range(first_row, first_row + count)):
                problem = self._check_cells(columns, i)
                if problem:
                    problems.append((row, task.where(row)) + problem)
                    continue
                numbers.append(row)
                for key in self.keys:
                    texts[key].append(columns[key][i])
            parts.append(self._documents(task, numbers, texts, problems))
            rows, text_bytes = rows + count, text_bytes + nbytes
        return Encoded(self._concatenate(parts), problems, 0, rows, text_bytes, 0, set())

    def _parse(self, line):
        try:
            doc = json.loads(line.rstrip(b"\r\n"))  # keeps error columns clean
        except ValueError as e:  # JSONDecodeError and invalid UTF-8 alike
            return ("malformed JSON", str(e)), None
        if not isinstance(doc, dict):
            return ("malformed JSON", f"a JSON {type(doc).__name__}, not an object"), None
        for key in self.keys:
            if key not in doc:
                return (f"missing key '{key}'", f"has keys {sorted(doc)[:10]}"), doc
            if not isinstance(doc[key], str):
                return (f"non-string '{key}'", f"a JSON {type(doc[key]).__name__}"), doc
        return None, doc

    def _check_cells(self, columns, i):
        for key in self.keys:
            value = columns[key][i]
            if value is None:
                return f"null '{key}'", "an empty cell"
            if not isinstance(value, str):
                return f"non-string '{key}'", f"a {type(value).__name__} cell"
        return None

    def _documents(self, task, numbers, texts, problems):
        """Tokenizes the good lines or rows (`numbers`) and packs those that tokenize; adds
        the others to `problems` (kept sorted)."""
        ids = {key: self._tokenize(texts[key]) for key in self.keys}
        keep = []
        for i, number in enumerate(numbers):
            problem = self._check_tokens(ids, i)
            if problem:
                problems.append((number, task.where(number)) + problem)
            else:
                keep.append(i)
        problems.sort(key=lambda p: p[0])
        return {key: self._pack([ids[key][i] for i in keep]) for key in self.keys}

    def _tokenize(self, texts):
        try:
            return self.tokenizer.tokenize_batch(texts)
        except Exception:
            # Some text broke the batch: redo one by one so only that line is skipped.
            return [self._tokenize_one(text) for text in texts]

    def _tokenize_one(self, text):
        try:
            return self.tokenizer.tokenize(text)
        except Exception as e:
            return e

    def _check_tokens(self, ids, i):
        for key in self.keys:
            if isinstance(ids[key][i], Exception):
                return "tokenizer error", f"{key!r}: {ids[key][i]}"
            if len(ids[key][i]) == 0:
                return f"empty '{key}'", "no tokens"
        return None

    def _pack(self, docs):
        """Documents -> (concatenated tokens in the dataset dtype, per-document lengths)."""
        if self.append_eod:
            for doc in docs:
                doc.append(self.tokenizer.eod)
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64,
                             count=int(lengths.sum()))
        info = np.iinfo(self.dtype)
        if tokens.size and (tokens.min() < info.min or tokens.max() > info.max):
            raise ValueError(f"token ids in [{tokens.min()}, {tokens.max()}] do not fit "
                             f"{self.dtype}: the tokenizer's vocab_size is "
                             f"{self.tokenizer.vocab_size}")
        return tokens.astype(self.dtype), lengths

    def _concatenate(self, parts):
        if not parts:
            return {key: self._pack([]) for key in self.keys}
        return {key: (np.concatenate([p[key][0] for p in parts]),
                      np.concatenate([p[key][1] for p in parts])) for key in self.keys}


_worker_encoder = None


def init_worker(args):
    """Pool initializer: each worker builds its own tokenizer from the flags."""
    from megatron.training.tokenizer import build_tokenizer_from_args

    global _worker_encoder
    # Parallelism comes from the worker processes: keep each one's Rust encoder on one thread
    # rather than every worker spawning a thread per core (unless the user chose otherwise).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_encoder = Encoder(args, build_tokenizer_from_args(args))


def encode_in_worker(task) -> Encoded:
    return _worker_encoder.encode(task)
