"""Benchmark tools/preprocess_data.py against two peers on real text that does not repeat.

    python3 bench/preprocess.py [--work-dir DIR] [--trials 3] [--workers 1,2]

Builds (bench/preprocess_corpus.py) a JSONL of ~31 MB of documents from the Python standard
library's .py files, deduplicated, and a 32,000-token GPT-2-style byte-level BPE trained on it.
Then times, each as a fresh process on the same input (start-up and imports count for all):
  - peer "python-bpe": Megatron-LLaMA's method, a per-document pure-Python GPT-2 BPE with a
    word cache (bench/python_bpe.py); one process, it has no workers;
  - peer "tokenizers": a per-document `tokenizers.Tokenizer.encode` loop; one process;
  - ours, --workers 1 with TOKENIZERS_PARALLELISM=false (one core, one thread);
  - ours, --workers 1 as shipped (tokenize_batch spreads a batch over a thread per core);
  - ours, --workers N for each N in --workers above 1;
  - ours, --workers 2 with tiktoken turned off (the tokenizers BPE + unit cache of before),
    to show what the tiktoken encoder brings.
Trials go round-robin over the configurations (background load hits all alike); the table
has the best trial, the spread of MB/s over trials, and ratios against both peers, for the
whole process and for the work after start-up (each program's own "Done: in Xs" timer, from
after its tokenizer is built to the finalized dataset). Every run's .bin/.idx must be
byte-identical to the python-bpe peer's, or the benchmark fails.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(BENCH, os.pardir))
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from preprocess_corpus import build_corpus  # noqa: E402


def without_tiktoken(argv):
    """tools/preprocess_data.py with GPT2BPETokenizer forced onto its tokenizers path (worker
    processes are forked and inherit the patch)."""
    from megatron.training.tokenizer import gpt2_bpe

    init = gpt2_bpe.GPT2BPETokenizer.__init__
    gpt2_bpe.GPT2BPETokenizer.__init__ = (
        lambda self, vocab, merges, use_tiktoken=True: init(self, vocab, merges, False))
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data

    sys.argv[0] = "preprocess_data.py"
    sys.exit(preprocess_data.main(argv))


def timed(cmd, env=None):
    """(wall seconds of the whole process, seconds of its work after start-up and imports)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    work = re.search(r"^Done:.* in ([\d.]+)s", proc.stdout + proc.stderr, re.MULTILINE)
    return elapsed, float(work.group(1))


def same_files(prefix_a, prefix_b):
    def read(path):
        with open(path, "rb") as f:
            return f.read()
    return all(read(prefix_a + ext) == read(prefix_b + ext) for ext in (".bin", ".idx"))


def configurations(jsonl, vocab, merges, work_dir, workers):
    """(name, processes, command, environment, output prefix) of every run, peers first."""
    peers = os.path.join(BENCH, "preprocess_peers.py")
    out = lambda name: os.path.join(work_dir, name)  # noqa: E731
    configs = [
        (f"peer: {peer}", "1", [sys.executable, peers, peer, jsonl, vocab, merges, out(peer)],
         None, out(peer))
        for peer in ("python-bpe", "tokenizers")]
    ours = ["--input", jsonl, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
            "--merge-file", merges, "--append-eod", "--log-interval", "100000000"]
    tool = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py")] + ours
    one_thread = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    shipped = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    configs.append(("ours --workers 1, TOKENIZERS_PARALLELISM=false", "1",
                    tool + ["--workers", "1", "--output-prefix", out("w1_1thread")],
                    one_thread, out("w1_1thread_text_document")))
    configs.append(("ours --workers 1 (threads as shipped)", "1",
                    tool + ["--workers", "1", "--output-prefix", out("w1")],
                    shipped, out("w1_text_document")))
    for n in workers:
        if n > 1:
            configs.append((f"ours --workers {n}", f"1+{n}",
                            tool + ["--workers", str(n), "--output-prefix", out(f"w{n}")],
                            shipped, out(f"w{n}_text_document")))
    configs.append(("ours --workers 2, tiktoken off (before)", "1+2",
                    [sys.executable, os.path.abspath(__file__), "--without-tiktoken"] + ours
                    + ["--workers", "2", "--output-prefix", out("w2_hf")],
                    shipped, out("w2_hf_text_document")))
    return configs


def report(results, megabytes, n_docs):
    """Markdown table: best whole-process and work-only figures, spread, ratios to peers."""
    best = {name: (min(w for w, _ in runs), min(k for _, k in runs))
            for name, _, runs in results}
    python_bpe, hf = best["peer: python-bpe"], best["peer: tokenizers"]
    print("| configuration | processes | whole process: s | MB/s (spread) | docs/s "
          "| vs python-bpe | vs tokenizers | work only: MB/s | vs python-bpe | vs tokenizers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, processes, runs in results:
        wall, work = best[name]
        spread = f"{megabytes / max(w for w, _ in runs):.2f}-{megabytes / wall:.2f}"
        print(f"| {name} | {processes} | {wall:.2f} | {megabytes / wall:.2f} ({spread}) "
              f"| {n_docs / wall:,.0f} | {python_bpe[0] / wall:.2f}x | {hf[0] / wall:.2f}x "
              f"| {megabytes / work:.2f} | {python_bpe[1] / work:.2f}x | {hf[1] / work:.2f}x |")


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
    if len(sys.argv) > 1 and sys.argv[1] == "--without-tiktoken":
        without_tiktoken(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--workers", default="1,2", help="comma-separated --workers to time")
    parser.add_argument("--trials", type=int, default=3, help="runs per configuration")
    args = parser.parse_args()
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work_dir, exist_ok=True)
    jsonl, vocab, merges, n_docs, description = build_corpus(work_dir)
    megabytes = os.path.getsize(jsonl) / 1e6

    from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer

    encoder = "tiktoken" if GPT2BPETokenizer(vocab, merges).uses_tiktoken else "tokenizers"
    print(f"input: {jsonl}: {megabytes:.2f} MB of JSONL, {description}; tokenizer: 32,000-token "
          f"byte-level BPE (ours encodes with {encoder}); {os.cpu_count()} CPUs; "
          f"best of {args.trials} trials, round-robin")
    configs = configurations(jsonl, vocab, merges, work_dir,
                             [int(w) for w in args.workers.split(",")])
    runs = {name: [] for name, *_ in configs}
    for _ in range(args.trials):
        for name, _, cmd, env, _ in configs:
            runs[name].append(timed(cmd, env))
    report([(name, processes, runs[name]) for name, processes, *_ in configs], megabytes, n_docs)
    reference = configs[0][4]
    for name, _, _, _, out in configs[1:]:
        if not same_files(out, reference):
            sys.exit(f"MISMATCH: {name} wrote different .bin/.idx bytes than the python-bpe peer")
    print(f"all {len(configs)} outputs byte-identical (.bin and .idx)")
    time_gpt_dataset_indices(os.path.join(work_dir, "w1_text_document"))


if __name__ == "__main__":
    main()
