"""Megatron's memory-mapped indexed dataset: a `.bin` of raw tokens and a `.idx` that indexes it.

The format is byte-compatible with Megatron-LM, so datasets made by either side load in both.

`.idx` (all little-endian):
    b"MMIDIDX\\x00\\x00"        9-byte magic
    version          <Q    always 1
    dtype code       <B    see DTYPE_CODES
    sequence count   <Q
    document count   <Q    = len(document_indices), including the leading 0
    sequence lengths       int32 x sequence count   (tokens per sequence)
    sequence pointers      int64 x sequence count   (byte offset of each sequence in .bin)
    document indices       int64 x document count   (0, then the sequence count at each
                                                      document end)
`.bin`: the tokens of all sequences, concatenated, in the dtype of the index.

Reading is zero-copy: arrays are views of an mmap of the files, so a dataset larger than memory
costs only the pages actually touched. Loading validates the structure (cheap, vectorized) so a
truncated or corrupt file fails at load with the file's name, not with garbage tokens mid-run.
"""
import mmap
import os
import shutil
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# The fix for a damaged or mismatched pair, in every message about one.
REWRITE = "re-run tools/preprocess_data.py to rewrite the .bin/.idx pair"
# An .idx shorter than its header says (an interrupted write or copy, a full disk).
_DAMAGED = "index file truncated or damaged"

# Vectorized checks walk the data in blocks of this many elements to bound temporary memory.
_BLOCK = 1 << 24


class IndexedDatasetError(ValueError):
    """A `.bin/.idx` pair is missing, corrupt, or inconsistent with what was asked of it."""


def best_fitting_dtype(vocab_size=None):
    """uint16 when every token id fits (Megatron's threshold), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(path_prefix):
    return path_prefix + ".bin"


def index_file_path(path_prefix):
    return path_prefix + ".idx"


def dtype_code(dtype):
    """The `.idx` code of a numpy dtype; a clear error for dtypes the format cannot hold."""
    code = _CODE_OF_DTYPE.get(np.dtype(dtype))
    if code is None:
        supported = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise ValueError(f"dtype {np.dtype(dtype)} cannot be stored in a .bin/.idx dataset; "
                         f"use one of: {supported}")
    return code


def _map_file(path):
    """Read-only mmap of a whole file (an empty buffer for an empty file, which mmap refuses)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDataset:
    """Read-only view of `{path_prefix}.bin` / `{path_prefix}.idx`.

    `ds[i]` is sequence i as a numpy view into the mapped `.bin` (no copy); `ds[a:b]` is a list
    of such views. With `vocab_size`, every token id is checked to lie in [0, vocab_size).
    """

    def __init__(self, path_prefix, vocab_size=None):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (dataset prefix "
                                          f"{path_prefix!r} needs both .bin and .idx)")
        self._read_index(idx_path)
        self._bin = _map_file(bin_path)
        self._check_pointers(bin_path)
        if vocab_size is not None:
            self._check_token_ids(bin_path, vocab_size)

    # ---- loading and validation -------------------------------------------------------------

    def _read_index(self, idx_path):
        buf = _map_file(idx_path)
        if len(buf) < _HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: {_DAMAGED}: {len(buf)} bytes, shorter than "
                                      f"the {_HEADER.size}-byte header; {REWRITE}")
        magic, version, code, n_seq, n_doc = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not a Megatron indexed dataset index (magic "
                                      f"{magic!r}, expected {_MAGIC!r})")
        if version != _VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} "
                                      f"(this reader knows version {_VERSION})")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (known: "
                                      f"{sorted(DTYPE_CODES)})")
        self._dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 12 * n_seq + 8 * n_doc
        if len(buf) < expected:
            raise IndexedDatasetError(
                f"{idx_path}: {_DAMAGED}: {len(buf)} bytes, but its header's {n_seq} sequences "
                f"and {n_doc} document indices need {expected}; {REWRITE}")
        # Megatron's multimodal variant appends one int8 mode per sequence; tolerate (ignore) it.
        if len(buf) not in (expected, expected + n_seq):
            raise IndexedDatasetError(f"{idx_path}: index file damaged: {len(buf) - expected} "
                                      f"unexpected bytes after the document indices (file is "
                                      f"{len(buf)} bytes, the counts in its header say "
                                      f"{expected}); {REWRITE}")
        offset = _HEADER.size
        self._lengths = np.frombuffer(buf, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self._pointers = np.frombuffer(buf, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self._doc_indices = np.frombuffer(buf, np.int64, n_doc, offset)
        self._check_document_indices(idx_path, n_seq)

    def _check_document_indices(self, idx_path, n_seq):
        docs = self._doc_indices
        if len(docs) == 0:
            return
        if docs[0] != 0:
            raise IndexedDatasetError(f"{idx_path}: document indices must start at 0, "
                                      f"found {docs[0]}")
        falls = np.flatnonzero(np.diff(docs) < 0)
        if len(falls):
            i = int(falls[0]) + 1
            raise IndexedDatasetError(f"{idx_path}: document indices must be non-decreasing, but "
                                      f"entry {i} is {docs[i]} after {docs[i - 1]}")
        if docs[-1] > n_seq:
            i = int(np.argmax(docs > n_seq))
            raise IndexedDatasetError(f"{idx_path}: document index entry {i} is {docs[i]}, past "
                                      f"the sequence count {n_seq}")

    def _check_pointers(self, bin_path):
        """Sequences must tile the .bin exactly: each starts where the previous one ends."""
        idx_path = index_file_path(self.path_prefix)
        size, itemsize = len(self._bin), self._dtype.itemsize
        expected_start = 0
        for start in range(0, len(self), _BLOCK):
            lengths = self._lengths[start:start + _BLOCK].astype(np.int64)
            pointers = self._pointers[start:start + _BLOCK]
            if (lengths < 0).any():
                i = start + int(np.argmax(lengths < 0))
                raise IndexedDatasetError(f"{idx_path}: sequence {i} has negative length "
                                          f"{self._lengths[i]}")
            ends = np.cumsum(lengths * itemsize) + expected_start
            expected = np.concatenate(([expected_start], ends[:-1]))
            bad = np.flatnonzero(pointers != expected)
            if len(bad):
                i = start + int(bad[0])
                where = (f", past the end of {bin_path} ({size} bytes)"
                         if self._pointers[i] + self._lengths[i] * itemsize > size else "")
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {i} starts at byte {self._pointers[i]}, but the "
                    f"lengths before it put it at byte {expected[bad[0]]}{where}; the index "
                    f"is corrupt: {REWRITE}")
            expected_start = int(ends[-1])
        if size != expected_start:
            raise IndexedDatasetError(self._size_mismatch(bin_path, idx_path, size,
                                                          expected_start))

    def _size_mismatch(self, bin_path, idx_path, size, expected):
        """Why the .bin is not the size its index says: another dtype's tokens (the pair comes
        from different runs), or a damaged file (an interrupted write or copy)."""
        tokens = expected // self._dtype.itemsize
        for other in (np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64)):
            if tokens and other != self._dtype and size == tokens * other.itemsize:
                return (f"{bin_path}: holds {size} bytes, exactly {tokens} tokens of {other}, "
                        f"but {idx_path} says its tokens are {self._dtype} ({expected} bytes): "
                        f"the .bin and .idx come from different runs; {REWRITE}")
        kind = "truncated" if size < expected else "longer than its index"
        return (f"{bin_path}: data file {kind}: {size} bytes, but {idx_path} describes "
                f"{expected} ({len(self)} sequences of {self._dtype}); {REWRITE}")

    def _check_token_ids(self, bin_path, vocab_size):
        tokens = np.frombuffer(self._bin, self._dtype) if len(self._bin) else np.empty(0)
        for start in range(0, len(tokens), _BLOCK):
            block = tokens[start:start + _BLOCK]
            bad = np.flatnonzero((block >= vocab_size) | (block < 0))
            if len(bad):
                position = start + int(bad[0])
                seq = int(np.searchsorted(self._pointers // self._dtype.itemsize, position,
                                          side="right")) - 1
                offset = position - int(self._pointers[seq]) // self._dtype.itemsize
                raise IndexedDatasetError(
                    f"{bin_path}: token id {tokens[position]} at sequence {seq}, position "
                    f"{offset} is outside the vocabulary [0, {vocab_size}) "
                    f"({len(bad)} bad ids in this block); was the dataset made with another "
                    f"tokenizer?")

    # ---- access -------------------------------------------------------------------------------

    def __len__(self):
        return len(self._lengths)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence idx, as a view into the .bin."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.path_prefix} "
                             f"({n} sequences)")
        idx = int(idx) % n
        seq_len = int(self._lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence "
                             f"{idx} of {self.path_prefix} (length {seq_len})")
        pointer = int(self._pointers[idx]) + offset * self._dtype.itemsize
        return np.frombuffer(self._bin, self._dtype, length, pointer)

    @property
    def sequence_lengths(self):
        return self._lengths

    @property
    def sequence_pointers(self):
        return self._pointers

    @property
    def document_indices(self):
        return self._doc_indices

    @property
    def dtype(self):
        return self._dtype

    @staticmethod
    def exists(path_prefix):
        return (os.path.isfile(index_file_path(path_prefix))
                and os.path.isfile(data_file_path(path_prefix)))

    def __getstate__(self):
        # mmaps do not pickle (DataLoader workers); reopen from the path instead.
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"])

    def __repr__(self):
        return (f"IndexedDataset({self.path_prefix!r}: {len(self)} sequences, "
                f"{max(len(self._doc_indices) - 1, 0)} documents, {self._dtype})")


class _IntList:
    """Append-only int64 list kept as numpy chunks: a billion lengths stay 8 bytes each."""

    def __init__(self):
        self._chunks, self._tail, self._len = [], [], 0

    def append(self, value):
        self._tail.append(value)
        self._len += 1
        if len(self._tail) >= 1 << 16:
            self._flush()

    def extend(self, values):
        self._flush()
        self._chunks.append(np.asarray(values, dtype=np.int64).copy())
        self._len += len(values)

    def _flush(self):
        if self._tail:
            self._chunks.append(np.array(self._tail, dtype=np.int64))
            self._tail = []

    def array(self):
        self._flush()
        return np.concatenate(self._chunks) if self._chunks else np.empty(0, np.int64)

    def __len__(self):
        return self._len


class IndexedDatasetBuilder:
    """Writes a `.bin/.idx` pair. Output appears under its real names only in `finalize`.

    Tokens stream into `{bin_path}.tmp`; `finalize` writes the index to `{idx_path}.tmp` and
    renames both into place, the index last, so an interrupted build never leaves a pair that
    looks complete. Call `abort()` to remove the temporary files instead.
    """

    def __init__(self, bin_path, dtype=np.int32):
        self._dtype = np.dtype(dtype)
        self._code = dtype_code(self._dtype)
        self._bin_path = bin_path
        self._bin_tmp = bin_path + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = _IntList()
        self._doc_indices = _IntList()
        self._doc_indices.append(0)

    @property
    def dtype(self):
        return self._dtype

    def _as_tokens(self, tokens):
        """One sequence as a contiguous array of our dtype; refuses values the dtype would wrap."""
        if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
            tokens = tokens.detach().cpu().numpy()
        array = np.asarray(tokens)
        if array.dtype != self._dtype:
            if array.size and self._dtype.kind in "iu" and array.dtype.kind in "iub":
                info = np.iinfo(self._dtype)
                low, high = array.min(), array.max()
                if low < info.min or high > info.max:
                    raise ValueError(f"token ids in [{low}, {high}] do not fit {self._dtype} "
                                     f"(range [{info.min}, {info.max}]); build with a wider dtype")
            array = array.astype(self._dtype)
        return np.ascontiguousarray(array).reshape(-1)

    def add_item(self, tokens):
        """Append one sequence (list, numpy array or torch tensor of token ids)."""
        array = self._as_tokens(tokens)
        self._bin.write(array.data)
        self._lengths.append(len(array))

    def end_document(self):
        """Close the current document: the sequences added since the last one form it."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths):
        """Append one document made of sequences of the given lengths (tokens concatenated)."""
        if isinstance(tokens, (list, tuple)) and tokens and not np.isscalar(tokens[0]):
            tokens = np.concatenate([self._as_tokens(t) for t in tokens])  # list of sequences
        array = self._as_tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != len(array):
            raise ValueError(f"sequence lengths sum to {lengths.sum()} but the document has "
                             f"{len(array)} tokens")
        self._bin.write(array.data)
        self._lengths.extend(lengths)
        self.end_document()

    def add_documents(self, tokens, document_lengths):
        """Append many single-sequence documents at once (tokens concatenated); the bulk path
        of preprocess_data, equal to add_item + end_document per document."""
        array = self._as_tokens(tokens)
        lengths = np.asarray(document_lengths, dtype=np.int64)
        if lengths.sum() != len(array):
            raise ValueError(f"document lengths sum to {lengths.sum()} but {len(array)} tokens "
                             f"were given")
        self._bin.write(array.data)
        first = len(self._lengths)
        self._lengths.extend(lengths)
        self._doc_indices.extend(np.arange(first + 1, first + 1 + len(lengths)))

    def add_index(self, path_prefix):
        """Append a whole existing dataset: its .bin bytes are copied, its index offset."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self._dtype:
            raise IndexedDatasetError(f"{index_file_path(path_prefix)}: dtype {other.dtype} "
                                      f"differs from this builder's {self._dtype}; datasets "
                                      f"can only be merged when their dtypes match")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths)
        self._doc_indices.extend(other.document_indices[1:] + offset)
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    def finalize(self, idx_path):
        lengths = self._lengths.array()
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {lengths.max()} tokens does not fit the format's "
                             f"int32 lengths")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self._dtype.itemsize, out=pointers[1:])
        doc_indices = self._doc_indices.array()
        idx_tmp = idx_path + ".tmp"
        try:
            with open(idx_tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, len(lengths),
                                     len(doc_indices)))
                f.write(lengths.astype(np.int32).tobytes())
                f.write(pointers.tobytes())
                f.write(doc_indices.tobytes())
                f.flush()
                os.fsync(f.fileno())
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
        except BaseException:  # e.g. a full disk: the half-written index must not stay
            _remove_quietly(idx_tmp)
            raise
        # Drop a previous index first: a new .bin beside an old .idx must never look complete.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._bin_tmp, self._bin_path)
        os.replace(idx_tmp, idx_path)

    def abort(self):
        """Close and delete the temporary files; nothing is left behind."""
        try:
            self._bin.close()  # flushes its buffer: fails again on a full disk
        except OSError:
            pass
        _remove_quietly(self._bin_tmp)


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
