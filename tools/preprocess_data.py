"""Tokenize a JSONL corpus into Megatron `.bin/.idx` datasets, one per JSON key.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx` (one per `--json-keys` key). Each JSON line is one
document and one sequence (Megatron's behaviour without sentence splitting), with the EOD token
appended under `--append-eod`. Sentence splitting (`--split-sentences`, nltk) is not supported,
so `--keep-newlines` is accepted for compatibility but changes nothing: text is tokenized as is.

Bad lines (malformed JSON, a missing or non-string key, text the tokenizer rejects, text that
tokenizes to nothing) are reported with their 1-based line number and skipped, so document i
of every key's dataset comes from the same line; a summary counts them. `--strict` stops at the
first one instead, exit code 1, with no output left. Blank lines are ignored.

Lines are tokenized in batches by `--workers` processes (`tokenize_batch`); results are written
in input order, so the output does not depend on the number of workers. With `--workers 1` the
batches are tokenized in this process, where a Rust tokenizer may itself use several threads
(set TOKENIZERS_PARALLELISM=false to prevent it); each of several workers uses one thread.

Zero documents is an error, not an empty dataset: an empty input file exits 2 at start; a
run whose every line was skipped (malformed, or without a `--json-keys` key: the keys the lines
did have are listed) exits 1 with no output, as `--strict` does. So does a full disk ("no
space left on device"): every file the run wrote is removed.

`--partitions N` splits the input into N byte ranges processed one after another and merged at
the end (parallelism comes from --workers); the result is identical to one partition. Outputs
are written under temporary names and renamed into place when complete.
"""
import argparse
import collections
import errno
import itertools
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer_from_args  # noqa: E402

BATCH_LINES = 1024  # lines per worker task: big enough to amortize IPC, small enough to stream
MAX_REPORTED = 100  # bad lines reported one by one; the summary still counts all of them
MAX_SEEN_KEYS = 50  # keys of skipped lines remembered, to suggest --json-keys


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object; one dataset per key")
    group.add_argument("--keep-newlines", action="store_true",
                       help="accepted for compatibility; only matters for sentence splitting, "
                            "which is not supported: text is always tokenized as is")
    group.add_argument("--strict", action="store_true",
                       help="stop at the first bad line (exit 1, no output) instead of skipping")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes {prefix}_{key}_document.bin/.idx per key")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many parts, processed then merged")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="report progress every this many documents")
    args = parser.parse_args(argv)

    def fail(message):  # one line, no usage dump: the flags themselves parsed fine
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    if not os.path.isfile(args.input):
        fail(f"--input {args.input}: no such file")
    if os.path.getsize(args.input) == 0:
        fail(f"--input {args.input} is empty (0 bytes): nothing to tokenize; give a JSONL file "
             f"with one JSON object per line")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--output-prefix {args.output_prefix}: {out_dir} is a file, not a directory; "
             f"choose another --output-prefix")
    if not os.path.isdir(out_dir):
        fail(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist; "
             f"create it first")
    if not os.access(out_dir, os.W_OK):
        fail(f"--output-prefix {args.output_prefix}: directory {out_dir} is not writable; "
             f"choose another --output-prefix or fix its permissions")
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        fail(f"--json-keys has duplicates: {args.json_keys}")
    # Megatron's tokenizer builder may look at these training-time fields.
    for name, value in (("rank", 0), ("tensor_model_parallel_size", 1), ("vocab_extra_ids", 0)):
        if not hasattr(args, name):
            setattr(args, name, value)
    try:
        tokenizer = build_tokenizer_from_args(args)
    except Exception as e:  # any failure here is a bad flag or file: report it, write nothing
        fail(f"cannot build the tokenizer ({args.tokenizer_type}): {e}")
    if args.append_eod and tokenizer.eod is None:
        fail(f"--append-eod: the {args.tokenizer_type} tokenizer has no end-of-document token")
    return args, tokenizer


class Encoder:
    """Turns a batch of raw lines into token arrays per key; runs in the worker processes."""

    def __init__(self, args, tokenizer):
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = tokenizer
        self.dtype = np.dtype(best_fitting_dtype(tokenizer.vocab_size))

    def encode(self, batch):
        """(first line number, lines) -> ({key: (tokens, lengths)}, problems, blank lines,
        keys of the skipped JSON objects). Problems are (line number, category, detail), in
        line order. The keys say what --json-keys could have been when nothing matched."""
        first_lineno, lines = batch
        problems, linenos, blank, seen_keys = [], [], 0, set()
        texts = {key: [] for key in self.keys}
        for lineno, line in enumerate(lines, first_lineno):
            if not line.strip():
                blank += 1
                continue
            problem, doc = self._parse(line)
            if problem:
                problems.append((lineno,) + problem)
                if isinstance(doc, dict) and len(seen_keys) < MAX_SEEN_KEYS:
                    seen_keys.update(doc)
                continue
            linenos.append(lineno)
            for key in self.keys:
                texts[key].append(doc[key])
        ids = {key: self._tokenize(texts[key]) for key in self.keys}
        keep = []
        for i, lineno in enumerate(linenos):
            problem = self._check_tokens(ids, i)
            if problem:
                problems.append((lineno,) + problem)
            else:
                keep.append(i)
        problems.sort(key=lambda p: p[0])
        arrays = {key: self._pack([ids[key][i] for i in keep]) for key in self.keys}
        return arrays, problems, blank, seen_keys

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


_worker_encoder = None


def _init_worker(args):
    global _worker_encoder
    # Parallelism comes from the worker processes: keep each one's Rust encoder on one thread
    # rather than every worker spawning a thread per core (unless the user chose otherwise).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_encoder = Encoder(args, build_tokenizer_from_args(args))


def _encode_in_worker(batch):
    return _worker_encoder.encode(batch)


def read_batches(path, start, end, first_lineno):
    """(first line number, lines) for the lines starting in bytes [start, end) of the file."""
    with open(path, "rb") as f:
        f.seek(start)
        position, lineno, lines = start, first_lineno, []
        while position < end:
            line = f.readline()
            if not line:
                break
            position += len(line)
            lines.append(line)
            if len(lines) == BATCH_LINES:
                yield lineno, lines
                lineno, lines = lineno + len(lines), []
        if lines:
            yield lineno, lines


def partition_bounds(path, partitions):
    """Byte offsets splitting the file into `partitions` ranges that start at line starts."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, partitions):
            target = max(size * i // partitions, bounds[-1])
            if target > 0:
                f.seek(target - 1)
                f.readline()  # to the start of the next line
                target = f.tell()
            bounds.append(min(target, size))
    return bounds + [size]


class Progress:
    def __init__(self, args):
        self.args = args
        self.start = time.time()
        self.docs = self.lines = self.bytes = self.blank = 0
        self.tokens_bytes = 0  # bytes of tokens given to the outputs (all keys)
        self.problems = collections.Counter()
        self.seen_keys = set()
        self.next_log = args.log_interval

    def add(self, lines, docs, problems, blank, seen_keys=()):
        if len(self.seen_keys) < MAX_SEEN_KEYS:
            self.seen_keys.update(seen_keys)
        self.lines += len(lines)
        self.bytes += sum(map(len, lines))
        self.docs += docs
        self.blank += blank
        for lineno, category, detail in problems:
            self.problems[category] += 1
            reported = sum(self.problems.values())
            if reported <= MAX_REPORTED:
                print(f"warning: line {lineno}: {category} ({detail}); skipped", file=sys.stderr)
            if reported == MAX_REPORTED:
                print("warning: further bad lines are counted but not reported one by one",
                      file=sys.stderr)
        if self.docs >= self.next_log:
            print(f"Processed {self.docs} documents ({self.rates()})", file=sys.stderr,
                  flush=True)
            self.next_log = (self.docs // self.args.log_interval + 1) * self.args.log_interval

    def rates(self):
        elapsed = max(time.time() - self.start, 1e-9)
        return f"{self.docs / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s"

    def summary(self):
        skipped = sum(self.problems.values())
        lines = [f"Done: {self.docs} documents from {self.lines} lines "
                 f"({self.bytes / 1e6:.2f} MB) in {time.time() - self.start:.2f}s, {self.rates()}"]
        if skipped:
            counts = ", ".join(f"{n} {category}" for category, n in self.problems.items())
            lines.append(f"skipped {skipped} lines: {counts}")
        if self.blank:
            lines.append(f"ignored {self.blank} blank lines")
        return "\n".join(lines)


def ordered_results(pool, encoder, batches, max_pending):
    """Encode batches on the pool (or here, without one), yielding results in input order.
    A bounded window of tasks, unlike Pool.imap, which would read the whole input ahead."""
    if pool is None:
        for batch in batches:
            yield batch, encoder.encode(batch)
        return
    pending = collections.deque()
    for batch in batches:
        pending.append((batch, pool.apply_async(_encode_in_worker, (batch,))))
        if len(pending) >= max_pending:
            batch, result = pending.popleft()
            yield batch, result.get()
    while pending:
        batch, result = pending.popleft()
        yield batch, result.get()


class BadLine(Exception):
    pass


class NoDocuments(Exception):
    pass


def check_documents(args, progress):
    """Zero documents is a mistake (a wrong --json-keys, a wrong file): say which, with the
    keys the lines did have, before any output is written."""
    if progress.docs:
        return
    where = f"--input {args.input}"
    if progress.lines == progress.blank:
        raise NoDocuments(f"no documents in {where}: its {progress.lines} lines are blank; "
                          f"give a JSONL file with one JSON object per line")
    counts = ", ".join(f"{n} {category}" for category, n in progress.problems.items())
    message = f"no documents in {where}: all {progress.lines - progress.blank} lines were " \
              f"skipped ({counts})"
    other_keys = sorted(progress.seen_keys - set(args.json_keys))
    if other_keys:
        shown = " ".join(other_keys[:10]) + (" ..." if len(other_keys) > 10 else "")
        fix = (f"pass --json-keys {other_keys[0]}" if len(other_keys) == 1
               else "pass --json-keys with the key(s) holding the text")
        message += (f"; --json-keys is {' '.join(args.json_keys)} but the lines have keys: "
                    f"{shown}; {fix}")
    else:
        message += f"; each line must be a JSON object with a string under " \
                   f"{' and '.join(repr(k) for k in args.json_keys)} (see the warnings above)"
    raise NoDocuments(message)


def disk_full_message(args, progress):
    """One line for ENOSPC: where, how much input was done, what is free, what is needed."""
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    free = shutil.disk_usage(out_dir).free
    size = os.path.getsize(args.input)
    need = ""
    if progress.tokens_bytes and progress.bytes:  # extrapolate from the input read so far
        docs = progress.docs * size // progress.bytes
        index = len(args.json_keys) * (34 + 12 * docs + 8 * (docs + 1))  # see indexed_dataset
        estimate = progress.tokens_bytes * size // progress.bytes + index
        need = f"about {estimate} bytes needed, "
    return (f"no space left on device: writing {args.output_prefix}_*.bin/.idx in {out_dir} "
            f"({need}{free} bytes free); free some space or choose another --output-prefix "
            f"(the partial output was removed)")


def process(args, encoder, pool, prefixes, progress, start, end, first_lineno, written,
            final=True):
    """Tokenize bytes [start, end) of the input into datasets at `prefixes` (key -> prefix),
    appending each finalized prefix to `written`. `final`: these are the outputs (not parts
    to merge), which must hold documents. Returns the line number after the last line read."""
    builders = {key: IndexedDatasetBuilder(data_file_path(prefix), dtype=encoder.dtype)
                for key, prefix in prefixes.items()}
    next_lineno = first_lineno
    try:
        batches = read_batches(args.input, start, end, first_lineno)
        for (batch_lineno, lines), (arrays, problems, blank, seen_keys) in ordered_results(
                pool, encoder, batches, 4 * args.workers):
            if problems and args.strict:
                raise BadLine("line {}: {} ({})".format(*problems[0]))
            docs = len(arrays[args.json_keys[0]][1])  # the same for every key
            # Counted before writing, so a full disk's message can extrapolate what is needed.
            progress.add(lines, docs, problems, blank, seen_keys)
            for key, (tokens, lengths) in arrays.items():
                progress.tokens_bytes += tokens.nbytes
                builders[key].add_documents(tokens, lengths)
            next_lineno = batch_lineno + len(lines)
        if final:
            check_documents(args, progress)
        for key, prefix in prefixes.items():
            builders[key].finalize(index_file_path(prefix))
            del builders[key]
            written.append(prefix)
    finally:
        for builder in builders.values():  # only those not finalized: an error stopped us
            builder.abort()
    return next_lineno


def main(argv=None):
    args, tokenizer = get_args(argv)
    encoder = Encoder(args, tokenizer)
    outputs = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    progress = Progress(args)
    written = []  # output prefixes finalized by this run: removed if a later step fails
    try:
        run(args, encoder, outputs, progress, written)
    except (BadLine, NoDocuments, OSError) as e:
        for prefix in written:
            for path in (data_file_path(prefix), index_file_path(prefix)):
                if os.path.exists(path):
                    os.remove(path)
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if isinstance(e, BadLine):
            message = f"{e}; stopping (--strict), no output written"
        elif isinstance(e, NoDocuments):
            message = f"{e}; no output written"
        else:
            message = disk_full_message(args, progress)
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
        return 1
    print(progress.summary(), file=sys.stderr)
    for key, prefix in outputs.items():
        print(f"wrote {prefix}.bin/.idx (dtype {encoder.dtype.name})", file=sys.stderr)
    return 0


def run(args, encoder, outputs, progress, written):
    """Tokenize the input into `outputs` (key -> prefix), via partitions if asked."""
    pool = None
    part_dir = None
    try:
        if args.workers > 1:
            import multiprocessing
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
        bounds = partition_bounds(args.input, args.partitions)
        if args.partitions == 1:
            process(args, encoder, pool, outputs, progress, 0, bounds[-1], 1, written)
            return
        part_dir = tempfile.mkdtemp(prefix=".preprocess_data-",
                                    dir=os.path.dirname(os.path.abspath(args.output_prefix)))
        parts = [{key: os.path.join(part_dir, f"part{i}_{key}") for key in args.json_keys}
                 for i in range(args.partitions)]
        lineno = 1
        for i, prefixes in enumerate(parts):
            lineno = process(args, encoder, pool, prefixes, progress, bounds[i],
                             bounds[i + 1], lineno, [], final=False)
        check_documents(args, progress)
        for key, prefix in outputs.items():
            merged = IndexedDatasetBuilder(data_file_path(prefix), dtype=encoder.dtype)
            try:
                for part in parts:
                    merged.add_index(part[key])
                merged.finalize(index_file_path(prefix))
                written.append(prefix)
            except BaseException:
                merged.abort()
                raise
    finally:
        if pool is not None:
            pool.terminate()
        if part_dir is not None:
            shutil.rmtree(part_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
