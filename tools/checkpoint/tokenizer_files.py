"""The tokenizer a conversion carries along: where a checkpoint's tokenizer is, the files of
tokenizers given as files, and the fingerprint of the copy training will load."""
import os
import shutil
import tempfile

import hf_io

from megatron.training.tokenizer.fingerprint import fingerprint_of_hf_directory

TOKENIZER_DIR = "tokenizer"  # beside the converted checkpoint


def checkpoint_tokenizer_dir(load: str, args, override):
    """The tokenizer directory of a Megatron checkpoint: ``override``, the converted copy, or
    the one its args name; None if there is none."""
    if override:
        return override
    for candidate in (os.path.join(load, TOKENIZER_DIR), args.get("tokenizer_name_or_path"),
                      args.get("tokenizer_model")):
        if candidate and os.path.isdir(candidate):
            return candidate
    return None


def copy_megatron_tokenizer_files(args, out_dir, copied) -> None:
    """GPT-2 BPE and sentencepiece tokenizers given as files: their HF file names."""
    kind = args.get("tokenizer_type")
    sources = {"GPT2BPETokenizer": (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")),
               "SentencePieceTokenizer": (("tokenizer_model", "tokenizer.model"),),
               "Llama2Tokenizer": (("tokenizer_model", "tokenizer.model"),)}.get(kind, ())
    for dest, name in sources:
        path = args.get(dest)
        if path and os.path.isfile(path) and name not in copied:
            shutil.copyfile(path, os.path.join(out_dir, name))


def fingerprint_as_copied(tokenizer_src: str):
    """The fingerprint of the tokenizer files a conversion copies, loaded as training will
    load them: beside a model's config.json the same tokenizer can load with other tokens (a
    Qwen2 directory: one more)."""
    with tempfile.TemporaryDirectory() as copied:
        hf_io.copy_tokenizer_files(tokenizer_src, copied)
        return fingerprint_of_hf_directory(copied)
