"""Progress of a preprocessing run: the bad lines and rows reported (the first MAX_REPORTED
one by one, all counted), progress lines, the final summary, and the zero-documents error."""
import collections
import sys
import time

from megatron.training.corpus.encoder import MAX_SEEN_KEYS

MAX_REPORTED = 100  # bad lines reported one by one; the summary still counts all of them


class NoDocuments(Exception):
    pass


class Progress:
    def __init__(self, log_interval):
        self.log_interval = log_interval
        self.start = time.time()
        self.docs = self.lines = self.rows = self.bytes = self.blank = 0
        self.disk_bytes = 0  # of the input files as stored (compressed), for extrapolation
        self.tokens_bytes = 0  # bytes of tokens given to the outputs (all keys)
        self.problems = collections.Counter()
        self.seen_keys = set()
        self.next_log = log_interval

    def add(self, encoded, docs, disk_bytes):
        if len(self.seen_keys) < MAX_SEEN_KEYS:
            self.seen_keys.update(encoded.seen_keys)
        self.lines += encoded.lines
        self.rows += encoded.rows
        self.bytes += encoded.text_bytes
        self.disk_bytes += disk_bytes
        self.docs += docs
        self.blank += encoded.blank
        for _, where, category, detail in encoded.problems:
            self.problems[category] += 1
            reported = sum(self.problems.values())
            if reported <= MAX_REPORTED:
                print(f"warning: {where}: {category} ({detail}); skipped", file=sys.stderr)
            if reported == MAX_REPORTED:
                print(f"warning: further bad {self.unit()} are counted but not reported one "
                      f"by one", file=sys.stderr)
        if self.docs >= self.next_log:
            print(f"Processed {self.docs} documents ({self.rates()})", file=sys.stderr,
                  flush=True)
            self.next_log = (self.docs // self.log_interval + 1) * self.log_interval

    def unit(self):
        """What the input's records are called: lines (JSONL), rows (Parquet), or both."""
        if not self.rows:
            return "lines"
        return "rows" if not self.lines else "lines and rows"

    def records(self):
        if self.lines and self.rows:
            return f"{self.lines} lines and {self.rows} rows"
        return f"{self.rows} rows" if self.rows else f"{self.lines} lines"

    def rates(self):
        elapsed = max(time.time() - self.start, 1e-9)
        return f"{self.docs / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s"

    def summary(self):
        skipped = sum(self.problems.values())
        lines = [f"Done: {self.docs} documents from {self.records()} "
                 f"({self.bytes / 1e6:.2f} MB) in {time.time() - self.start:.2f}s, {self.rates()}"]
        if skipped:
            counts = ", ".join(f"{n} {category}" for category, n in self.problems.items())
            lines.append(f"skipped {skipped} {self.unit()}: {counts}")
        if self.blank:
            lines.append(f"ignored {self.blank} blank lines")
        return "\n".join(lines)

    def check_documents(self, input_spec, keys):
        """Zero documents is a mistake (a wrong --json-keys, a wrong file): say which, with the
        keys the lines did have, before any output is written."""
        if self.docs:
            return
        where = f"--input {input_spec}"
        if self.lines + self.rows == self.blank:
            if self.rows or not self.lines:
                raise NoDocuments(f"no documents in {where}: it holds no lines or rows")
            raise NoDocuments(f"no documents in {where}: its {self.lines} lines are blank; "
                              f"give a JSONL file with one JSON object per line")
        counts = ", ".join(f"{n} {category}" for category, n in self.problems.items())
        message = f"no documents in {where}: all {self.lines + self.rows - self.blank} " \
                  f"{self.unit()} were skipped ({counts})"
        other_keys = sorted(self.seen_keys - set(keys))
        if other_keys:
            shown = " ".join(other_keys[:10]) + (" ..." if len(other_keys) > 10 else "")
            fix = (f"pass --json-keys {other_keys[0]}" if len(other_keys) == 1
                   else "pass --json-keys with the key(s) holding the text")
            message += (f"; --json-keys is {' '.join(keys)} but the lines have keys: "
                        f"{shown}; {fix}")
        elif self.lines:
            message += f"; each line must be a JSON object with a string under " \
                       f"{' and '.join(repr(k) for k in keys)} (see the warnings above)"
        else:
            message += f"; each row must hold a string in column(s) {' and '.join(keys)} " \
                       f"(see the warnings above)"
        raise NoDocuments(message)

    def bytes_needed(self, input_size, keys):
        """The outputs' size extrapolated from the input read so far ("" before any)."""
        if not (self.tokens_bytes and self.disk_bytes):
            return ""
        docs = self.docs * input_size // self.disk_bytes
        index = len(keys) * (34 + 12 * docs + 8 * (docs + 1))  # see indexed_dataset
        estimate = self.tokens_bytes * input_size // self.disk_bytes + index
        return f"about {estimate} bytes needed, "
