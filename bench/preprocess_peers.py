"""The preprocessing benchmark's peers, each a single process that reads the JSONL, encodes one
document at a time, appends the end-of-document id and writes with our IndexedDatasetBuilder
(so the .bin/.idx can be compared byte for byte with ours):

    python3 bench/preprocess_peers.py {python-bpe,tokenizers} JSONL VOCAB MERGES OUTPUT_PREFIX

  python-bpe  Megatron-LLaMA's method: json.loads + a pure-Python GPT-2 BPE with a word cache.
  tokenizers  json.loads + tokenizers.Tokenizer.encode (GPT-2's byte-level BPE) per document.

Prints "Done: in Xs", timed from after the tokenizer is built, like tools/preprocess_data.py.
"""
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH, os.pardir))
sys.path.insert(0, BENCH)

EOD = "<|endoftext|>"


def python_bpe_encoder(vocab, merges):
    from python_bpe import PythonBPE

    bpe = PythonBPE(vocab, merges)
    return bpe.encode, bpe.ids[EOD], len(bpe.ids)


def tokenizers_encoder(vocab, merges):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE.from_file(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return ((lambda text: tokenizer.encode(text, add_special_tokens=False).ids),
            tokenizer.token_to_id(EOD), tokenizer.get_vocab_size())


PEERS = {"python-bpe": python_bpe_encoder, "tokenizers": tokenizers_encoder}


def run(peer, jsonl, vocab, merges, output_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype

    encode, eod, vocab_size = PEERS[peer](vocab, merges)
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=best_fitting_dtype(vocab_size))
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            ids = encode(json.loads(line)["text"])
            if ids:
                builder.add_item(ids + [eod])
                builder.end_document()
    builder.finalize(output_prefix + ".idx")
    print(f"Done: in {time.perf_counter() - start:.3f}s")


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] not in PEERS:
        sys.exit(__doc__)
    run(*sys.argv[1:])
