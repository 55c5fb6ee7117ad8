"""The preprocessing benchmark's corpus: real text that does not repeat itself.

Every machine with Python has its standard library. The corpus is its `.py` files (the
`stdlib` directory of `sysconfig`, without `site-packages` and `__pycache__`), read in sorted
path order, each cut into documents at its triple newlines (the two blank lines PEP 8 puts
between top-level definitions), so documents are a few kB, like web pages. Identical documents
(licence headers, empty `__init__` bodies) are kept once (sha256), files that are not UTF-8 are
skipped, and whitespace-only pieces are dropped. The same Python version gives the same corpus.

The tokenizer is a 32,000-token byte-level BPE trained on those documents with GPT-2's settings
(`tokenizers.ByteLevelBPETokenizer`, no prefix space, special token `<|endoftext|>`), saved as
vocab.json + merges.txt.
"""
import hashlib
import json
import os
import sysconfig

SKIPPED_DIRS = ("site-packages", "__pycache__")
EOD = "<|endoftext|>"


def stdlib_files(root=None):
    """Sorted paths of the standard library's .py files."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
        paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return sorted(paths)


def stdlib_documents(root=None):
    """(documents, files read, files skipped as not UTF-8, duplicate documents dropped)."""
    documents, seen, files, not_utf8, duplicates = [], set(), 0, 0, 0
    for path in stdlib_files(root):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            not_utf8 += 1
            continue
        files += 1
        for document in text.split("\n\n\n"):
            if not document.strip():
                continue
            digest = hashlib.sha256(document.encode("utf-8")).digest()
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            documents.append(document)
    return documents, files, not_utf8, duplicates


def write_jsonl(documents, path):
    with open(path, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps({"text": document}, ensure_ascii=False) + "\n")


def train_bpe(documents, work_dir, vocab_size=32000):
    """vocab.json and merges.txt of a GPT-2-style byte-level BPE trained on the documents."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator(documents, vocab_size=vocab_size, special_tokens=[EOD],
                                show_progress=False)
    return trainer.save_model(work_dir)


def build_corpus(work_dir, vocab_size=32000):
    """Writes corpus.jsonl, vocab.json and merges.txt into work_dir (reused when present);
    returns (jsonl, vocab, merges, description)."""
    jsonl = os.path.join(work_dir, "corpus.jsonl")
    vocab, merges = (os.path.join(work_dir, name) for name in ("vocab.json", "merges.txt"))
    documents, files, not_utf8, duplicates = stdlib_documents()
    if not os.path.isfile(jsonl):
        write_jsonl(documents, jsonl + ".tmp")
        os.replace(jsonl + ".tmp", jsonl)
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        train_bpe(documents, work_dir, vocab_size)
    text_mb = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    description = (f"{len(documents):,} documents ({text_mb:.2f} MB of text) from {files:,} .py "
                   f"files of the Python {sysconfig.get_python_version()} standard library "
                   f"({not_utf8} not UTF-8 skipped, {duplicates:,} duplicate documents dropped)")
    return jsonl, vocab, merges, len(documents), description
