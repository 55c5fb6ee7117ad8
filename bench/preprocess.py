"""Benchmark tools/preprocess_data.py against a plain per-document loop, side by side.

    python bench/preprocess.py [--work-dir DIR] [--tinyshakespeare PATH] [--trials 3]

Builds the reference input of ../shared/data/README.md in the work directory: tinyshakespeare
split on blank lines into documents, one `{"text": paragraph}` per line, the whole set repeated
20 times (144,440 documents, ~24 MB), and the 8,000-token byte-level BPE trained on the file
(`ByteLevelBPETokenizer`, special token `<|endoftext|>`, saved as vocab.json + merges.txt).

Then times, each as a fresh process (so interpreter and import start-up count for everyone):
  - ours, --workers 1 with TOKENIZERS_PARALLELISM=false (strictly one core),
  - ours, --workers 1 as shipped (the Rust batch encoder may use every core),
  - ours, --workers 2 (and any others given with --workers),
  - the baseline: what Megatron's preprocess_data does per document, in one process:
    json.loads + transformers.GPT2TokenizerFast(vocab, merges).encode(text) + eod, written with
    our IndexedDatasetBuilder.
Reports MB/s of JSONL input and documents/s (best of --trials) and the speed-up over the
baseline, for the whole process and for the work after start-up (each program's own timer from
after its tokenizer is built to the finalized dataset), and checks that every run wrote
byte-identical .bin/.idx files.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)

DEFAULT_TEXT = os.path.join(REPO, os.pardir, "shared", "data", "tinyshakespeare.txt")


def build_inputs(text_path, work_dir, repeat):
    """The reference JSONL and tokenizer; returns (jsonl path, documents, vocab, merges)."""
    from tokenizers import ByteLevelBPETokenizer

    with open(text_path, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    jsonl = os.path.join(work_dir, "tinyshakespeare.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
        for _ in range(repeat):
            f.write(lines)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train([text_path], vocab_size=8000, special_tokens=["<|endoftext|>"],
                    show_progress=False)
    vocab, merges = tokenizer.save_model(work_dir)
    return jsonl, len(paragraphs) * repeat, vocab, merges


def baseline(jsonl, vocab, merges, output_prefix):
    """Megatron's per-document loop: parse, encode, append eod, add to the builder."""
    import transformers
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype

    transformers.logging.set_verbosity_error()  # no "longer than model_max_length" warnings
    # Positional: transformers 4 names these vocab_file/merges_file, 5 names them vocab/merges
    # (and silently ignores the old keywords, leaving an empty vocabulary).
    tokenizer = transformers.GPT2TokenizerFast(vocab, merges)
    if len(tokenizer) < 2:
        sys.exit(f"GPT2TokenizerFast did not load {vocab} and {merges}")
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    dtype = best_fitting_dtype(len(tokenizer))
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=dtype)
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            ids = tokenizer.encode(json.loads(line)["text"])
            if ids:
                builder.add_item(ids + [eod])
                builder.end_document()
    builder.finalize(output_prefix + ".idx")
    print(f"Done: in {time.perf_counter() - start:.3f}s")  # the same line ours prints


def timed(cmd, env=None):
    """(wall seconds of the whole process, seconds of its work after start-up and imports)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    work = re.search(r"^Done:.* in ([\d.]+)s", proc.stdout + proc.stderr, re.MULTILINE)
    return elapsed, float(work.group(1))


def same_files(prefix_a, prefix_b):
    def read(path):
        with open(path, "rb") as f:
            return f.read()
    return all(read(prefix_a + ext) == read(prefix_b + ext) for ext in (".bin", ".idx"))


def python_sample_index(lengths, document_index, seq_length):
    """The peer: the per-sample loop that Megatron's C++ helper runs, in plain Python."""
    samples = [(0, 0)]
    position, offset = 0, 0
    total = int(lengths[document_index].sum())
    for _ in range((total - 1) // seq_length):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(lengths[document_index[position]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        samples.append((position, offset))
    return samples


def time_gpt_dataset_indices(prefix, target_tokens=100_000_000, seq_length=2048):
    """Build GPT dataset indices for ~1e8 tokens of the preprocessed documents (their length
    distribution tiled), beside a plain-Python per-sample loop for the sample index."""
    import numpy as np

    from megatron.core.datasets.gpt_dataset import build_gpt_dataset_indices
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lengths = np.asarray(IndexedDataset(prefix).sequence_lengths)
    lengths = np.tile(lengths, -(-target_tokens // int(lengths.sum())))
    documents = np.arange(len(lengths))
    start = time.perf_counter()
    document_index, sample_index, _ = build_gpt_dataset_indices(
        lengths, documents, None, seq_length, seed=1234)
    ours = time.perf_counter() - start
    start = time.perf_counter()
    peer = python_sample_index(lengths, document_index, seq_length)
    peer_time = time.perf_counter() - start
    if [tuple(row) for row in sample_index.tolist()] != peer:
        sys.exit("MISMATCH: vectorized sample index differs from the per-sample loop")
    print(f"GPT dataset indices: {int(lengths.sum()):,} tokens in {len(lengths):,} documents, "
          f"seq {seq_length}, {len(sample_index) - 1:,} samples: ours {ours:.2f} s (document, "
          f"sample and shuffle index; target < 10 s); per-sample Python loop (sample index "
          f"only) {peer_time:.2f} s; ratio {peer_time / ours:.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--tinyshakespeare", default=DEFAULT_TEXT)
    parser.add_argument("--repeat", type=int, default=20, help="copies of the document set")
    parser.add_argument("--workers", default="1,2", help="comma-separated --workers to time")
    parser.add_argument("--trials", type=int, default=3, help="runs per configuration; best kept")
    parser.add_argument("--baseline-run", nargs=4, metavar=("JSONL", "VOCAB", "MERGES", "OUT"),
                        help=argparse.SUPPRESS)  # internal: the baseline in its own process
    args = parser.parse_args()
    if args.baseline_run:
        baseline(*args.baseline_run)
        return
    if not os.path.isfile(args.tinyshakespeare):
        sys.exit(f"--tinyshakespeare {args.tinyshakespeare}: no such file")
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work_dir, exist_ok=True)
    jsonl, n_docs, vocab, merges = build_inputs(args.tinyshakespeare, work_dir, args.repeat)
    megabytes = os.path.getsize(jsonl) / 1e6
    print(f"input: {jsonl}: {n_docs} documents, {megabytes:.2f} MB; tokenizer: 8000-token "
          f"byte-level BPE; {os.cpu_count()} CPUs; best of {args.trials}")

    ours = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", jsonl,
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
            merges, "--append-eod", "--log-interval", "100000000"]
    single_core = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    configs = [("baseline (json.loads + GPT2TokenizerFast.encode per doc)",
                [sys.executable, os.path.abspath(__file__), "--baseline-run", jsonl, vocab,
                 merges, os.path.join(work_dir, "baseline")], None, "baseline"),
               ("ours --workers 1, TOKENIZERS_PARALLELISM=false",
                ours + ["--workers", "1", "--output-prefix", os.path.join(work_dir, "w1_1core")],
                single_core, "w1_1core_text_document")]
    for w in args.workers.split(","):
        configs.append((f"ours --workers {w}", ours + ["--workers", w, "--output-prefix",
                                                       os.path.join(work_dir, f"w{w}")],
                        None, f"w{w}_text_document"))

    results = []
    for name, cmd, env, out in configs:
        wall, work = min(timed(cmd, env) for _ in range(args.trials))
        results.append((name, wall, work, out))
    _, base_wall, base_work, _ = results[0]
    print("whole process (start-up and imports included) | work only (after start-up)")
    print(f"{'configuration':56s} {'s':>6s} {'MB/s':>6s} {'docs/s':>7s} {'ratio':>6s} | "
          f"{'s':>6s} {'MB/s':>6s} {'docs/s':>7s} {'ratio':>6s}")
    for name, wall, work, out in results:
        print(f"{name:56s} {wall:6.2f} {megabytes / wall:6.2f} {n_docs / wall:7.0f} "
              f"{base_wall / wall:5.2f}x | {work:6.2f} {megabytes / work:6.2f} "
              f"{n_docs / work:7.0f} {base_work / work:5.2f}x")
    for name, _, _, out in results[1:]:
        if not same_files(os.path.join(work_dir, out), os.path.join(work_dir, "baseline")):
            sys.exit(f"MISMATCH: {name} wrote different .bin/.idx bytes than the baseline")
    print("all outputs byte-identical to the baseline's")
    time_gpt_dataset_indices(os.path.join(work_dir, "w1_text_document"))


if __name__ == "__main__":
    main()
