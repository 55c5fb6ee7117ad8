"""Was each training corpus made with this run's tokenizer? Read at start from the corpora's
tokenizer sidecars (``<prefix>.tokenizer.json``, written by tools/preprocess_data.py and
tools/merge_datasets.py): ids that are in range but mean other tokens train without a single
error otherwise.

A sidecar's fingerprint must be this run's tokenizer's, and its largest token id must be inside
this run's vocabulary (so every id of the ``.bin`` is checked without reading it). A corpus
without a sidecar (made by Megatron) trains after one warning for the run; the bounded read of
its first bytes (guards/token_guard.py) is all that checks it. NullTokenizer has no vocabulary
to compare (its ids are the text), so only the id range is checked when either side is one."""
import os
import sys
from typing import List, NamedTuple, Optional

import torch.distributed as dist

from megatron.core.datasets.config import parse_data_path
from megatron.core.datasets.tokenizer_sidecar import SIDECAR_SUFFIX, read_sidecar, sidecar_path
from megatron.training.guards.errors import exit_with_error
from megatron.training.tokenizer.fingerprint import describe, differ

DATA_PATH_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
_FIX = ("re-tokenize the corpus with this run's tokenizer (tools/preprocess_data.py), or train "
        "with the tokenizer it was made with")


class Verdict(NamedTuple):
    problem: Optional[str]  # the error line's text, or None
    warning: Optional[str]  # the one warning of the run, or None
    checked: List[str]  # prefixes whose sidecar vouched for every id (absolute paths)


def data_prefixes(args) -> List[str]:
    """The distinct dataset prefixes the data flags name, in order (none for mock data)."""
    if getattr(args, "mock_data", False):
        return []
    found = []
    for name in DATA_PATH_FLAGS:
        words = getattr(args, name, None)
        if words:
            found += [p for p in parse_data_path(words)[0] if p not in found]
    return found


def _has_vocabulary(fp) -> bool:
    return fp.get("type") != "NullTokenizer"


def corpus_verdict(prefixes: List[str], current: dict, vocab_size: int) -> Verdict:
    """The sidecars of ``prefixes`` against this run's tokenizer fingerprint and vocabulary."""
    lacking, checked = [], []
    for prefix in prefixes:
        sidecar = read_sidecar(prefix)
        if sidecar is None:
            lacking.append(prefix)
            continue
        made_with = sidecar["tokenizer"]
        if _has_vocabulary(made_with) and _has_vocabulary(current) and \
                differ(made_with, current):
            return Verdict(f"the corpus {prefix} was tokenized with {describe(made_with)}, but "
                           f"this run uses {describe(current)}: the same ids mean other "
                           f"tokens; {_FIX}.", None, [])
        largest = sidecar["max_token_id"]
        if largest is not None and largest >= vocab_size:
            return Verdict(f"the corpus {prefix} holds token ids up to {largest} (says "
                           f"{sidecar_path(prefix)}), but this run's vocabulary is "
                           f"[0, {vocab_size}) ({describe(current)}); {_FIX}.", None, [])
        checked.append(os.path.abspath(prefix))
    warning = None
    if lacking:
        warning = (f"warning: {len(lacking)} of the {len(prefixes)} data prefixes (first: "
                   f"{lacking[0]}) have no tokenizer sidecar ({SIDECAR_SUFFIX}, written by "
                   f"tools/preprocess_data.py), so they cannot be checked against this run's "
                   f"tokenizer; only the first bytes of their .bin are checked against the "
                   f"vocabulary. Re-run tools/preprocess_data.py to write one.")
    return Verdict(None, warning, checked)


def check_corpus_tokenizers(args, current: dict, vocab_size: int) -> List[str]:
    """Collective. Rank 0 reads the sidecars and every rank gets its verdict: a problem exits
    2 on every rank (one error line), a corpus without sidecar is one warning from rank 0.
    Returns the prefixes (absolute) whose every id is known to be in the vocabulary."""
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            verdict[0] = corpus_verdict(data_prefixes(args), current, vocab_size)
        except ValueError as exc:  # an unreadable sidecar (IndexedDatasetError)
            verdict[0] = Verdict(str(exc), None, [])
    dist.broadcast_object_list(verdict, src=0)
    problem, warning, checked = verdict[0]
    if problem is not None:
        exit_with_error(problem, code=2)
    if warning is not None and dist.get_rank() == 0:
        print(warning, file=sys.stderr, flush=True)
    return checked
