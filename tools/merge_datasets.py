"""Concatenate `.bin/.idx` datasets into one, as if they had been built in one go.

    python3 tools/merge_datasets.py --input data/parts --output-prefix data/all_text_document
    python3 tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document

`--input` is either one directory (every `.bin/.idx` pair in it, in sorted name order, as
Megatron's merge_datasets does) or a list of dataset prefixes (merged in the order given). The
`.bin` bytes are copied and the indices offset, so merging is I/O-bound. All inputs must share
one dtype. The output appears under its real name only when complete.

Each input's tokenizer sidecar (`<prefix>.tokenizer.json`, written by tools/preprocess_data.py)
must name the same tokenizer: corpora made with different tokenizers are refused before
anything is written. The merged sidecar records that tokenizer and the largest of the inputs'
largest token ids. Inputs without a sidecar (made by Megatron) give an output without one.
"""
import argparse
import errno
import os
import shutil
import sys

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
)
from megatron.core.datasets.tokenizer_sidecar import (  # noqa: E402
    read_sidecar,
    remove_sidecar,
    write_sidecar,
)
from megatron.training.tokenizer.fingerprint import describe  # noqa: E402


def prefixes_in_directory(directory):
    """Sorted dataset prefixes in a directory; an unpaired .bin or .idx is an error."""
    stems = {}
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in sorted(stems.items()):
        if len(exts) != 2:
            missing = ({".bin", ".idx"} - exts).pop()
            raise IndexedDatasetError(f"{os.path.join(directory, stem + missing)}: file not "
                                      f"found (its {exts.pop()} is in --input {directory})")
    return [os.path.join(directory, stem) for stem in sorted(stems)]


def resolve_inputs(inputs):
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        prefixes = prefixes_in_directory(inputs[0])
        if not prefixes:
            raise IndexedDatasetError(f"--input {inputs[0]}: no .bin/.idx datasets in directory")
        return prefixes
    for prefix in inputs:
        for path in (index_file_path(prefix), data_file_path(prefix)):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (give --input as one "
                                          f"directory or as dataset prefixes, without .bin/.idx)")
    return list(inputs)


def merged_sidecar(prefixes):
    """(tokenizer fingerprint, largest token id) for the merged output, or None when an input
    has no sidecar; IndexedDatasetError when two inputs were made with different tokenizers."""
    sidecars = {prefix: read_sidecar(prefix) for prefix in prefixes}
    known = [(prefix, s) for prefix, s in sidecars.items() if s is not None]
    for prefix, sidecar in known[1:]:
        first, first_sidecar = known[0]
        if sidecar["tokenizer"]["sha256"] != first_sidecar["tokenizer"]["sha256"]:
            raise IndexedDatasetError(
                f"refusing to merge corpora made with different tokenizers: {first} was "
                f"tokenized with {describe(first_sidecar['tokenizer'])}, {prefix} with "
                f"{describe(sidecar['tokenizer'])}; re-tokenize one of them with the other's "
                f"tokenizer (tools/preprocess_data.py) and merge again")
    if len(known) < len(prefixes):
        return None
    ids = [s["max_token_id"] for _, s in known]
    return known[0][1]["tokenizer"], (None if None in ids else max(ids))


def merge(prefixes, output_prefix, sidecar=None):
    """Merge datasets at `prefixes` into `output_prefix`, with `sidecar` ((tokenizer, largest
    id) from merged_sidecar, or None: no sidecar); returns the merged dataset."""
    dtype = IndexedDataset(prefixes[0]).dtype
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), dtype=dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        remove_sidecar(output_prefix)  # a previous output's: it would describe other tokens
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    if sidecar is not None:
        try:
            write_sidecar(output_prefix, *sidecar)
        except BaseException:  # e.g. a full disk: no pair left without the sidecar it needs
            for path in (data_file_path(output_prefix), index_file_path(output_prefix)):
                if os.path.exists(path):
                    os.remove(path)
            raise
    return IndexedDataset(output_prefix)


def disk_full_message(prefixes, output_prefix):
    """The merged files are the inputs' sizes, less the index header (34 bytes) and leading
    document index (8 bytes) of every input after the first."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    needed = sum(os.path.getsize(data_file_path(p)) + os.path.getsize(index_file_path(p))
                 for p in prefixes) - (len(prefixes) - 1) * (34 + 8)
    return (f"no space left on device: writing {output_prefix}.bin/.idx in {out_dir} ("
            f"{needed} bytes needed, {shutil.disk_usage(out_dir).free} bytes free); free some "
            f"space or choose another --output-prefix (the partial output was removed)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="a directory of datasets, or dataset prefixes")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.bin/.idx")
    args = parser.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        if not os.path.isdir(out_dir):
            raise IndexedDatasetError(f"--output-prefix {args.output_prefix}: directory "
                                      f"{out_dir} does not exist; create it first")
        prefixes = resolve_inputs(args.input)
        out = os.path.abspath(args.output_prefix)
        if any(os.path.abspath(p) == out for p in prefixes):
            raise IndexedDatasetError(f"--output-prefix {args.output_prefix} is also an input")
        sidecar = merged_sidecar(prefixes)
        merged = merge(prefixes, args.output_prefix, sidecar)
    except IndexedDatasetError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"{parser.prog}: error: {disk_full_message(prefixes, args.output_prefix)}",
              file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx: {len(merged)} "
          f"sequences, {len(merged.document_indices) - 1} documents, {merged.dtype}",
          file=sys.stderr)
    if sidecar is None:
        lacking = sum(read_sidecar(p) is None for p in prefixes)
        print(f"note: {lacking} of the {len(prefixes)} inputs have no tokenizer sidecar "
              f"(.tokenizer.json, written by tools/preprocess_data.py), so the merged dataset "
              f"has none: training cannot check it against its tokenizer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
