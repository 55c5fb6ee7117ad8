"""Tokenize a JSONL or Parquet corpus into Megatron `.bin/.idx` datasets, one per JSON key.

    python3 tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx` (one per `--json-keys` key). Each JSON line is one
document and one sequence (Megatron's behaviour without sentence splitting), with the EOD token
appended under `--append-eod`. Sentence splitting (`--split-sentences`, nltk) is not supported,
so `--keep-newlines` is accepted for compatibility but changes nothing: text is tokenized as is.

`--input` may be `.jsonl` (or `.json`, `.ndjson`), the same compressed (`.jsonl.gz`,
`.jsonl.zst`, decompressed as a stream), `.parquet` (each row a document, `--json-keys` naming
columns), or a directory (searched recursively) or glob of such files, read in sorted order as
one corpus: the output is byte-identical to that of one JSONL file of the same documents.

Bad lines (malformed JSON, a missing or non-string key, text the tokenizer rejects, text that
tokenizes to nothing) and bad rows (a null or non-string cell, ...) are reported with their
1-based line or row number (and the file, unless --input is one plain JSONL file) and skipped,
so document i of every key's dataset comes from the same line; a summary counts them.
`--strict` stops at the first one instead, exit code 1, with no output left. Blank lines are
ignored. A truncated or corrupt file (gzip, zstd, Parquet) stops the run the same way.

Lines are tokenized in batches by `--workers` processes (`tokenize_batch`), Parquet row groups
each by one worker that reads it; results are written in input order, so the output does not
depend on the number of workers. With `--workers 1` the batches are tokenized in this process,
where a Rust tokenizer may itself use several threads (set TOKENIZERS_PARALLELISM=false to
prevent it); each of several workers uses one thread.

Zero documents is an error, not an empty dataset: an empty input file exits 2 at start; a
run whose every line was skipped (malformed, or without a `--json-keys` key: the keys the lines
did have are listed) exits 1 with no output, as `--strict` does. So does a full disk ("no
space left on device"): every file the run wrote is removed.

`--partitions N` splits each plain JSONL file into N byte ranges (other files stay whole),
processed in N groups one after another and merged at the end (parallelism comes from
--workers); the result is identical to one partition. Outputs are written under temporary
names and renamed into place when complete.

Beside each pair goes `{prefix}.tokenizer.json` (after it, atomically): the tokenizer's
fingerprint and the largest token id written, so that training can refuse a corpus made with
another tokenizer; the `.idx` stays byte-identical to Megatron's.
"""
import argparse
import collections
import errno
import os
import shutil
import sys
import tempfile

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.core.datasets.tokenizer_sidecar import (  # noqa: E402
    remove_sidecar,
    sidecar_path,
    write_sidecar,
)
from megatron.training.corpus.encoder import Encoder, encode_in_worker, init_worker  # noqa: E402
from megatron.training.corpus.inputs import (  # noqa: E402
    CorruptInput,
    InputError,
    check_packages,
    check_parquet,
    resolve_inputs,
)
from megatron.training.corpus.progress import NoDocuments, Progress  # noqa: E402
from megatron.training.corpus.readers import (  # noqa: E402, F401 (partition_bounds: tests)
    TaskReader,
    partition_bounds,
    plan_partitions,
)
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer_from_args  # noqa: E402
from megatron.training.tokenizer.fingerprint import fingerprint_from_args  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="a JSONL file (one JSON object per line; .jsonl, .json or .ndjson, "
                            "optionally .gz or .zst compressed), a Parquet file (.parquet), a "
                            "directory of such files (recursive) or a glob; read in sorted "
                            "order")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object (columns of Parquet "
                            "files); one dataset per key")
    group.add_argument("--keep-newlines", action="store_true",
                       help="accepted for compatibility; only matters for sentence splitting, "
                            "which is not supported: text is always tokenized as is")
    group.add_argument("--strict", action="store_true",
                       help="stop at the first bad line or row (exit 1, no output) instead of "
                            "skipping")
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

    try:
        args.files = resolve_inputs(args.input)
        check_packages(args.files)
        check_parquet(args.files, args.json_keys)
    except InputError as e:
        fail(str(e))
    except CorruptInput as e:  # a damaged file is bad data, not a bad flag: exit 1, as later
        print(f"{parser.prog}: error: {e}; no output written", file=sys.stderr)
        sys.exit(1)
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


def ordered_results(pool, encoder, tasks, max_pending):
    """Encode tasks on the pool (or here, without one), yielding results in input order.
    A bounded window of tasks, unlike Pool.imap, which would read the whole input ahead."""
    if pool is None:
        for task in tasks:
            yield task, encoder.encode(task)
        return
    pending = collections.deque()
    for task in tasks:
        pending.append((task, pool.apply_async(encode_in_worker, (task,))))
        if len(pending) >= max_pending:
            task, result = pending.popleft()
            yield task, result.get()
    while pending:
        task, result = pending.popleft()
        yield task, result.get()


class BadLine(Exception):
    pass


def disk_full_message(args, progress):
    """One line for ENOSPC: where, how much input was done, what is free, what is needed."""
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    free = shutil.disk_usage(out_dir).free
    need = progress.bytes_needed(sum(f.size for f in args.files), args.json_keys)
    return (f"no space left on device: writing {args.output_prefix}_*.bin/.idx in {out_dir} "
            f"({need}{free} bytes free); free some space or choose another --output-prefix "
            f"(the partial output was removed)")


def finish_output(builder, prefix, largest, tokenizer_fingerprint, written):
    """Put one output in place: the .bin/.idx pair, then its tokenizer sidecar (a stale one
    goes first, so the new pair never sits beside it)."""
    remove_sidecar(prefix)
    builder.finalize(index_file_path(prefix))
    written.append(prefix)
    write_sidecar(prefix, tokenizer_fingerprint, largest)


def process(args, encoder, pool, prefixes, progress, tasks, written, largest, final=True):
    """Tokenize the tasks' documents into datasets at `prefixes` (key -> prefix), appending
    each finalized prefix to `written` and keeping each key's largest token id in `largest`
    (seen as the tokens are written: no second pass). `final`: these are the outputs (not
    parts to merge), which must hold documents, and get their tokenizer sidecar."""
    builders = {key: IndexedDatasetBuilder(data_file_path(prefix), dtype=encoder.dtype)
                for key, prefix in prefixes.items()}
    try:
        for task, encoded in ordered_results(pool, encoder, tasks, 4 * args.workers):
            if encoded.problems and args.strict:
                raise BadLine("{}: {} ({})".format(*encoded.problems[0][1:]))
            docs = len(encoded.arrays[args.json_keys[0]][1])  # the same for every key
            # Counted before writing, so a full disk's message can extrapolate what is needed.
            progress.add(encoded, docs, task.disk_bytes)
            for key, (tokens, lengths) in encoded.arrays.items():
                progress.tokens_bytes += tokens.nbytes
                builders[key].add_documents(tokens, lengths)
                if len(tokens):
                    largest[key] = max(largest.get(key, 0), int(tokens.max()))
        if final:
            progress.check_documents(args.input, args.json_keys)
        for key, prefix in prefixes.items():
            if final:
                finish_output(builders[key], prefix, largest.get(key),
                              args.tokenizer_fingerprint, written)
            else:
                builders[key].finalize(index_file_path(prefix))
                written.append(prefix)
            del builders[key]
    finally:
        for builder in builders.values():  # only those not finalized: an error stopped us
            builder.abort()


def main(argv=None):
    args, tokenizer = get_args(argv)
    args.tokenizer_fingerprint = fingerprint_from_args(args, tokenizer)
    encoder = Encoder(args, tokenizer)
    outputs = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    progress = Progress(args.log_interval)
    written = []  # output prefixes finalized by this run: removed if a later step fails
    try:
        run(args, encoder, outputs, progress, written)
    except (BadLine, NoDocuments, CorruptInput, OSError) as e:
        for prefix in written:
            for path in (data_file_path(prefix), index_file_path(prefix), sidecar_path(prefix)):
                if os.path.exists(path):
                    os.remove(path)
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if isinstance(e, BadLine):
            message = f"{e}; stopping (--strict), no output written"
        elif isinstance(e, (NoDocuments, CorruptInput)):
            message = f"{e}; no output written"
        else:
            message = disk_full_message(args, progress)
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
        return 1
    print(progress.summary(), file=sys.stderr)
    for key, prefix in outputs.items():
        print(f"wrote {prefix}.bin/.idx (dtype {encoder.dtype.name}) and "
              f"{os.path.basename(sidecar_path(prefix))}", file=sys.stderr)
    return 0


def run(args, encoder, outputs, progress, written):
    """Tokenize the input into `outputs` (key -> prefix), via partitions if asked."""
    pool = None
    part_dir = None
    largest = {}  # key -> the largest token id written under it
    try:
        if args.workers > 1:
            import multiprocessing
            pool = multiprocessing.Pool(args.workers, initializer=init_worker, initargs=(args,))
        groups, reader = plan_partitions(args.files, args.partitions), TaskReader()
        if len(groups) == 1:
            process(args, encoder, pool, outputs, progress, reader.tasks(groups[0]), written,
                    largest)
            return
        part_dir = tempfile.mkdtemp(prefix=".preprocess_data-",
                                    dir=os.path.dirname(os.path.abspath(args.output_prefix)))
        parts = [{key: os.path.join(part_dir, f"part{i}_{key}") for key in args.json_keys}
                 for i in range(len(groups))]
        for group, prefixes in zip(groups, parts):
            process(args, encoder, pool, prefixes, progress, reader.tasks(group), [],
                    largest, final=False)
        progress.check_documents(args.input, args.json_keys)
        for key, prefix in outputs.items():
            merged = IndexedDatasetBuilder(data_file_path(prefix), dtype=encoder.dtype)
            try:
                for part in parts:
                    merged.add_index(part[key])
                finish_output(merged, prefix, largest.get(key), args.tokenizer_fingerprint,
                              written)
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
