"""What `--input` names: a file, a directory (searched recursively) or a glob, resolved at
start to an ordered list of supported files, so that a mistake is one error before any work.

Order is stable: a directory's files sorted by their relative path (compared folder by
folder), a glob's matches sorted. Inside a directory, files of other types are ignored, as are
names starting with "." or "_" (hidden files, Spark's `_SUCCESS` and `_temporary`), the
convention of pyarrow's datasets; a file named explicitly must be of a supported type.
"""
import glob
import importlib
import os
from dataclasses import dataclass, field
from typing import List, Optional

PLAIN, GZIP, ZSTD, PARQUET = "jsonl", "jsonl.gz", "jsonl.zst", "parquet"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = {".gz": GZIP, ".zst": ZSTD, ".zstd": ZSTD}
SUPPORTED = ("JSONL (.jsonl, .json or .ndjson, optionally compressed as .gz or .zst) "
             "and Parquet (.parquet)")


class InputError(Exception):
    """A mistake in --input or --json-keys, found at start (exit code 2)."""


class CorruptInput(Exception):
    """A file that cannot be read to the end: truncated or corrupt (exit code 1)."""


def one_line(error: BaseException) -> str:
    """A library's message on one line (pyarrow's may hold newlines)."""
    return " ".join(str(error).split())


@dataclass
class InputFile:
    path: str
    kind: str
    size: int
    # How reports name the file; None for a lone plain JSONL --input, whose reports say
    # "line N" as they always have.
    label: Optional[str]
    row_groups: List[int] = field(default_factory=list)  # Parquet: rows per row group


def kind_of(path: str) -> Optional[str]:
    """The format a file name says, or None when it is not a supported one."""
    name = os.path.basename(path).lower()
    if name.endswith(".parquet"):
        return PARQUET
    stem, suffix = os.path.splitext(name)
    if suffix in COMPRESSED_SUFFIXES:
        return COMPRESSED_SUFFIXES[suffix] if stem.endswith(JSONL_SUFFIXES) else None
    return PLAIN if suffix in JSONL_SUFFIXES else None


def _ignored(name: str) -> bool:
    return name.startswith((".", "_"))


def _files_under(directory: str) -> List[str]:
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not _ignored(d)]
        found += [os.path.join(root, n) for n in names if not _ignored(n) and kind_of(n)]
    # Folder by folder ("a/b" before "a-b"), so the order does not depend on the separator.
    return sorted(found, key=lambda p: os.path.relpath(p, directory).split(os.sep))


def _listing(directory: str, limit: int = 8) -> str:
    names = sorted(os.listdir(directory))
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return shown or "nothing"


def _matches(spec: str) -> List[str]:
    if os.path.isdir(spec):
        files = _files_under(spec)
        if not files:
            raise InputError(f"--input {spec}: the directory holds no supported file (it has: "
                             f"{_listing(spec)}); supported: {SUPPORTED}")
        return files
    if os.path.exists(spec):
        return [spec]
    if not glob.has_magic(spec):
        raise InputError(f"--input {spec}: no such file")
    matches = sorted(glob.glob(spec, recursive=True))
    if not matches:
        raise InputError(f"--input {spec}: the pattern matches no file; give a file, a "
                         f"directory or a glob of {SUPPORTED} files")
    files = []
    for match in matches:
        files += _files_under(match) if os.path.isdir(match) else [match]
    return files


def resolve_inputs(spec: str) -> List[InputFile]:
    """The files `--input` names, in reading order; InputError for a path that is missing, an
    unsupported file, or nothing to read."""
    paths = list(dict.fromkeys(_matches(spec)))  # a glob may name a file and its folder
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"--input {spec}: {path} is not a regular file")
        if kind_of(path) is None:
            raise InputError(f"--input {spec}: {path} is not a supported file type (by its "
                             f"name); supported: {SUPPORTED}")
    lone = len(paths) == 1 and kind_of(paths[0]) == PLAIN and paths[0] == spec
    files = [InputFile(p, kind_of(p), os.path.getsize(p), None if lone else p) for p in paths]
    if all(f.size == 0 for f in files):
        if len(files) == 1:
            raise InputError(f"--input {spec} is empty (0 bytes): nothing to tokenize; give a "
                             f"JSONL file with one JSON object per line")
        raise InputError(f"--input {spec}: its {len(files)} files are all empty (0 bytes): "
                         f"nothing to tokenize")
    return files


PACKAGE_OF_KIND = {ZSTD: "zstandard", PARQUET: "pyarrow"}  # imported only when read


def check_packages(files: List[InputFile]) -> None:
    """InputError when a file's format needs a package that does not import here, so that a
    missing zstandard or pyarrow is one line at start, not a reader's traceback."""
    for kind, package in PACKAGE_OF_KIND.items():
        first = next((f for f in files if f.kind == kind), None)
        if first is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError:
            raise InputError(f"--input {first.path}: .{kind} files need the {package} package, "
                             f"which is not installed: pip install {package}") from None


def check_parquet(files: List[InputFile], keys: List[str]) -> None:
    """Reads each Parquet file's footer: its row groups, and that it has the --json-keys as
    columns (InputError naming the columns it has); CorruptInput when the footer is bad."""
    parquet_files = [f for f in files if f.kind == PARQUET]
    if not parquet_files:  # pyarrow is optional: JSONL inputs never import it
        return
    import pyarrow
    import pyarrow.parquet as pq

    for f in parquet_files:
        try:
            with pq.ParquetFile(f.path) as parquet:
                columns = parquet.schema_arrow.names
                meta = parquet.metadata
                f.row_groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        except (OSError, pyarrow.ArrowException) as e:
            raise CorruptInput(f"{f.path}: not a readable Parquet file ({one_line(e)}); the file "
                               f"is truncated or corrupt: re-create or re-download it") from None
        missing = [key for key in keys if key not in columns]
        if missing:
            shown = " ".join(columns[:20]) + (" ..." if len(columns) > 20 else "")
            raise InputError(f"--json-keys {' '.join(keys)}: {f.path} has no column "
                             f"{', '.join(repr(k) for k in missing)}; its columns are: "
                             f"{shown}; pass --json-keys with the column(s) holding the text")
