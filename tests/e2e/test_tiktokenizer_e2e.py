"""--tokenizer-type TikTokenizer used by preprocessing and training alike: a tiktoken BPE file
made here, tools/preprocess_data.py with it (2 workers), then 2 iterations of pretrain_llama.py
on that data with the same flags; the checkpoint records the tokenizer's sizes and fingerprint."""
import json
import math

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import TikTokenizer
from megatron.training.tokenizer.fingerprint import fingerprint
from tests.e2e.runner import LLAMA, TINY, parse_iterations, parse_losses, run_script, without
from tests.unit.test_tiktokenizer import WORDS, random_texts, train_ranks, write_bpe

SPECIALS = 16  # few special ids: a small embedding (16 + 500 ranks = 516, padded to 640)


def test_preprocess_then_train_two_iterations(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    model = write_bpe(tmp_path / "tokenizer.model",
                      train_ranks(random_texts(0, 300) + WORDS * 20, vocab_size=500))
    texts = [t for t in random_texts(7, 400) if t.strip()]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tiktoken_flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", model,
                      "--tiktoken-pattern", "llama3", "--tiktoken-num-special-tokens",
                      str(SPECIALS)]
    proc = run_script("tools/preprocess_data.py", [
        "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "corpus",
        "--append-eod", "--workers", "2", *tiktoken_flags], timeout=120)
    assert proc.returncode == 0, proc.stderr
    tokenizer = TikTokenizer(model, "llama3", num_special_tokens=SPECIALS)
    data = IndexedDataset(str(tmp_path / "corpus_text_document"))
    assert [d.tolist() for d in data] == [tokenizer.tokenize(t) + [2] for t in texts]

    flags = without(TINY, "--train-iters", "--tokenizer-type", "--vocab-size")
    flags = [f for f in flags if f != "--mock-data"] + LLAMA + tiktoken_flags + [
        "--train-iters", "2", "--data-path", tmp_path / "corpus_text_document",
        "--split", "100,0,0", "--save", tmp_path / "ckpt", "--save-interval", "2"]
    proc = run_script("pretrain_llama.py", flags)
    assert [i for i, _, _ in parse_iterations(proc)] == [1, 2]
    losses, _ = parse_losses(proc)
    assert all(abs(loss - math.log(640)) < 0.5 for loss in losses), losses  # ~uniform at init
    with open(tmp_path / "ckpt" / "iter_0000002" / "metadata.json") as f:
        meta = json.load(f)
    assert (meta["layout"]["vocab_size"], meta["layout"]["padded_vocab_size"]) == (516, 640)
    assert meta["args"]["tiktoken_pattern"] == "llama3"
    assert meta["args"]["tokenizer_fingerprint"]["sha256"] == fingerprint(tokenizer)["sha256"]
    assert np.max(data[0]) < 516
