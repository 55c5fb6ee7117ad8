"""Reading the input files as tasks for the tokenizing workers, in document order.

Plain JSONL is read in byte ranges (`--partitions` splits each file), compressed JSONL is
decompressed as a stream (never to disk) and sent as batches of lines, and a Parquet file is
one task per row group, which the worker reads itself (`read_row_group`): the main process
never holds a Parquet file, and no process holds more than a row group.
"""
import gzip
import io
import os
import zlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

from megatron.training.corpus.inputs import (
    GZIP,
    PARQUET,
    PLAIN,
    CorruptInput,
    InputFile,
    one_line,
)

BATCH_LINES = 1024  # lines (or rows) per task: enough to amortize IPC, small enough to stream
CHUNK = 1 << 20  # compressed bytes read at a time
MAX_ZSTD_WINDOW = 1 << 31  # accept files written with `zstd --long=31`


@dataclass
class LineBatch:
    label: Optional[str]  # the file as reports name it (None: the lone --input)
    first_line: int  # 1-based, in its file
    lines: List[bytes]
    disk_bytes: int  # of the file on disk this batch accounts for (compressed, for .gz/.zst)

    def where(self, lineno: int) -> str:
        return f"line {lineno}" if self.label is None else f"line {lineno} of {self.label}"


@dataclass
class RowGroupTask:
    path: str
    label: str
    row_group: int  # pyarrow's 0-based index
    first_row: int  # 1-based, in its file
    disk_bytes: int  # the row group's share of the file's size

    def where(self, row: int) -> str:
        return f"row {row} of {self.label} (row group index {self.row_group})"


@dataclass
class Segment:
    file: InputFile
    start: int = 0  # byte range of a plain JSONL file; the whole file otherwise
    end: int = 0


def partition_bounds(path: str, partitions: int) -> List[int]:
    """Byte offsets splitting the file into `partitions` ranges that start at line starts."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, partitions):
            target = max(size * i // partitions, bounds[-1])
            if target > 0:
                f.seek(target - 1)
                f.readline()  # to the start of the next line
                target = f.tell()
            bounds.append(min(target, size))
    return bounds + [size]


def plan_partitions(files: List[InputFile], partitions: int) -> List[List[Segment]]:
    """Consecutive groups of segments, one group per partition: each plain JSONL file split in
    `partitions` byte ranges, other files whole; fewer groups when there are fewer segments."""
    segments = []
    for f in files:
        if f.kind == PLAIN and partitions > 1:
            bounds = partition_bounds(f.path, partitions)
            segments += [Segment(f, a, b) for a, b in zip(bounds, bounds[1:])]
        else:
            segments.append(Segment(f, 0, f.size))
    n = min(partitions, len(segments))
    return [segments[len(segments) * i // n:len(segments) * (i + 1) // n] for i in range(n)]


class _ZstdStream(io.RawIOBase):
    """A zstandard file as a raw stream of its decompressed bytes, frame after frame; unlike
    zstandard's stream_reader, a truncated last frame is an error, not a silent end."""

    def __init__(self, raw):
        import zstandard

        self.raw = raw
        self.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
        self.frame, self.in_frame, self.pending = self.dctx.decompressobj(), False, b""

    def readable(self):
        return True

    def readinto(self, buffer):
        while not self.pending:
            chunk = self.raw.read(CHUNK)
            if not chunk:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self.pending = self._decompress(chunk)
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def _decompress(self, chunk):
        out = []
        while chunk:
            out.append(self.frame.decompress(chunk))
            self.in_frame = True
            chunk = b""
            if self.frame.eof:  # the next frame starts in what this one left over
                chunk = self.frame.unused_data
                self.frame, self.in_frame = self.dctx.decompressobj(), False
        return b"".join(out)


def _decompressing(kind: str, raw):
    if kind == GZIP:
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return io.BufferedReader(_ZstdStream(raw), CHUNK)


def _read_errors(kind: str):
    if kind == GZIP:  # a .gz input must not need zstandard
        return OSError, EOFError, zlib.error
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError


class TaskReader:
    """Yields the tasks of segments in order, numbering lines and rows within each file
    across the segments (partitions) of that file."""

    def __init__(self):
        self.next_line: Dict[str, int] = {}

    def tasks(self, segments: List[Segment]) -> Iterator:
        for segment in segments:
            f = segment.file
            if f.kind == PLAIN:
                yield from self._plain(segment)
            elif f.kind == PARQUET:
                yield from self._row_groups(f)
            else:
                yield from self._compressed(f)

    def _plain(self, segment):
        path, start, end = segment.file.path, segment.start, segment.end
        lineno = self.next_line.get(path, 1)
        with open(path, "rb") as f:
            f.seek(start)
            position, lines = start, []
            while position < end:
                line = f.readline()
                if not line:
                    break
                position += len(line)
                lines.append(line)
                if len(lines) == BATCH_LINES:
                    yield self._batch(segment.file, lineno, lines, sum(map(len, lines)))
                    lineno, lines = lineno + len(lines), []
            if lines:
                yield self._batch(segment.file, lineno, lines, sum(map(len, lines)))

    def _batch(self, file, lineno, lines, disk_bytes):
        self.next_line[file.path] = lineno + len(lines)
        return LineBatch(file.label, lineno, lines, disk_bytes)

    def _compressed(self, file):
        lineno, lines, read_before = 1, [], 0
        with open(file.path, "rb") as raw, _decompressing(file.kind, raw) as stream:
            while True:
                line = self._readline(file, stream, lineno + len(lines) - 1)
                if line:
                    lines.append(line)
                if lines and (len(lines) == BATCH_LINES or not line):
                    read = raw.tell()
                    yield self._batch(file, lineno, lines, read - read_before)
                    lineno, lines, read_before = lineno + len(lines), [], read
                if not line:
                    return

    @staticmethod
    def _readline(file, stream, last_line):
        try:
            return stream.readline()
        except _read_errors(file.kind) as e:
            codec = "gzip" if file.kind == GZIP else "zstd"
            raise CorruptInput(f"{file.label}: {codec} data is truncated or corrupt after line "
                               f"{last_line} ({one_line(e)}); re-create or re-download the "
                               f"file") from None

    @staticmethod
    def _row_groups(file):
        first, total = 1, max(sum(file.row_groups), 1)
        for index, rows in enumerate(file.row_groups):
            yield RowGroupTask(file.path, file.label, index, first, file.size * rows // total)
            first += rows


def read_row_group(task: RowGroupTask, keys: List[str]) -> Iterator:
    """(first row, {key: cells as Python values}, UTF-8 bytes of the string cells) for each
    batch of rows of the task's row group, read in the calling (worker) process."""
    import pyarrow
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    row = task.first_row
    try:
        with pq.ParquetFile(task.path) as parquet:
            # One thread: the parallelism is the worker processes.
            for batch in parquet.iter_batches(batch_size=BATCH_LINES, row_groups=[task.row_group],
                                              columns=keys, use_threads=False):
                columns = {key: batch.column(key) for key in keys}
                text_bytes = sum(pc.sum(pc.binary_length(c)).as_py() or 0
                                 for c in columns.values()
                                 if pyarrow.types.is_string(c.type)
                                 or pyarrow.types.is_large_string(c.type))
                yield row, {k: c.to_pylist() for k, c in columns.items()}, text_bytes
                row += batch.num_rows
    except (OSError, pyarrow.ArrowException) as e:
        raise CorruptInput(f"{task.label}: cannot read row group index {task.row_group} (rows "
                           f"from {row}): {one_line(e)}; the file is truncated or corrupt: "
                           f"re-create or re-download it") from None
