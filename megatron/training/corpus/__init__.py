"""Reading a pretraining corpus for tools/preprocess_data.py: which files `--input` names
(`inputs`), how their documents are read in tasks for the worker processes (`readers`), and
how a task becomes token arrays (`encoder`) and progress lines (`progress`).

Formats: JSONL (`.jsonl`, `.json`, `.ndjson`), the same compressed with gzip (`.gz`) or
zstandard (`.zst`, `.zstd`), and Parquet (`.parquet`). Every format yields the same documents
in the same order, so the tokenized output is byte-identical whatever the input format.
"""
