"""Vectorized builders for the GPT dataset and blending indices (Megatron's helpers.cpp, in numpy).

The arrays are the ones Megatron-LM builds, element for element, given the same inputs and
seed, so its cached index files and ours describe the same sample order:

    document_index   the dataset's documents repeated for every epoch, shuffled
    sample_index     [num_samples + 1, 2] (position in document_index, token offset) where
                     each sample starts; sample i covers seq_length + 1 tokens and ends on the
                     first token of sample i + 1
    shuffle_index    the order in which samples are served
    dataset_index, dataset_sample_index   which sub-dataset and which of its samples a blend's
                     sample i is
"""
import math
from typing import Sequence, Tuple

import numpy as np

# Megatron separates the final epoch when it covers less than this fraction of an epoch.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80
# Samples overlap by one token: the last token of a sample (the last label) starts the next.
ADD_EXTRA_TOKEN = 1


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens make ``num_samples`` samples of ``seq_length + 1`` tokens."""
    needed = num_samples * seq_length + ADD_EXTRA_TOKEN
    return max(1, -(-needed // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                        num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own when it is used for < 80% of it.

    Otherwise the few samples taken from the last epoch would be drawn from all epochs' worth
    of shuffled documents, making some documents appear far more often than others early on.
    """
    if num_epochs == 1:
        return False
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
    samples_from_last = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
    assert 0 <= samples_from_last <= samples_per_epoch + 1
    return samples_from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int,
                         rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled (the last epoch apart if asked)."""
    if not separate_last or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """[n + 1, 2] start (document_index position, offset) of every whole sample, plus the end.

    Sample i starts at token i * seq_length of the documents laid end to end in
    ``document_index`` order; a start on a document's last token stays in that document, as in
    Megatron's C++ loop (empty documents are stepped over).
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = (total - ADD_EXTRA_TOKEN) // seq_length
    if num_samples < 1:
        raise ValueError(f"{total} tokens cannot make one sample of {seq_length} + 1 tokens.")
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    position[0] = offset[0] = 0  # Megatron's first entry, even when document 0 is empty
    big = max(len(document_index), int(lengths.max())) >= np.iinfo(np.int32).max
    return np.stack((position, offset), axis=1).astype(np.int64 if big else np.int32)


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """Shuffled arange(total_size); the first ``num_samples`` and the rest shuffled separately."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


# ---- blending -------------------------------------------------------------------------------

_LANES = 2048  # chunks simulated side by side
_WARMUP = 256  # steps each chunk starts early from a guessed state


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample s goes to the dataset furthest behind its share.

    At step s every dataset k has error ``w_k * max(s, 1) - count_k``; the largest error wins
    (lowest k on ties) and that dataset's next sample is used. Returns (dataset_index int16,
    dataset_sample_index int64), identical to Megatron's ``build_blending_indices``.

    The greedy is sequential, so it runs as many short simulations side by side: the steps are
    cut into chunks, and every chunk starts ``warmup`` steps early from a guessed state. Runs
    from different states agree after a few steps, so a chunk's guessed run is the true one
    exactly when its state at the chunk start equals the previous chunk's state at its end;
    a chunk where they differ (rare) is re-run one step at a time from the true state.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or len(w) > np.iinfo(np.int16).max:
        raise ValueError(f"need 1 to 32767 blend weights, got {len(w)}")
    dataset_index = np.empty(size, dtype=np.int16)
    if size == 0:
        return dataset_index, np.empty(0, dtype=np.int64)
    chunk = max(256, -(-size // _LANES))
    lanes = -(-size // chunk)
    warmup = 0 if lanes == 1 else min(chunk - 1, _WARMUP)  # so only lane 0 starts at step 0
    starts = np.arange(lanes, dtype=np.int64) * chunk
    ends = np.minimum(starts + chunk, size)
    first = np.maximum(starts - warmup, 0)  # lane 0 needs no warm-up: its start state is known
    counts = _guess_counts(w, first).astype(np.float64)  # exact: counts stay far below 2**53
    t = np.maximum(first, 1).astype(np.float64)
    picks = np.empty((warmup + chunk, lanes), dtype=np.int16)
    errors = np.empty((lanes, len(w)))
    flat_rows = np.arange(lanes) * len(w)
    last_step = size - 1 - int(first[-1])  # the step at which the last, short lane ends
    at_end = np.empty_like(counts)
    for step in range(warmup + chunk if lanes > 1 else size):
        if step == warmup:
            at_start = counts.copy()
        np.multiply(t[:, None], w, out=errors)
        errors -= counts
        winner = errors.argmax(axis=1)
        picks[step] = winner
        counts.reshape(-1)[flat_rows + winner] += 1
        t += 1.0
        t[0] = step + 1  # lane 0 starts at s = 0, where t = max(s, 1) is 1, as at s = 1
        if step == chunk - 1:
            at_end[0] = counts[0]
        if step == last_step:
            at_end[-1] = counts[-1]
    at_start[0] = 0
    if lanes > 2:
        at_end[1:-1] = counts[1:-1]
    dataset_index[:ends[0]] = picks[:ends[0], 0]
    if lanes > 1:
        dataset_index[chunk:] = picks[warmup:, 1:].T.reshape(-1)[:size - chunk]
    # Chunk 0 starts from the true (empty) state; walk the chain, repairing broken links.
    state = at_end[0]
    for lane in range(1, lanes):
        if not np.array_equal(at_start[lane], state):
            state = _greedy_steps(w, state, int(starts[lane]), int(ends[lane]), dataset_index)
        else:
            state = at_end[lane]
    return dataset_index, _ranks_within_dataset(dataset_index, len(w))


def _guess_counts(w: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A plausible greedy state at each of ``steps``: floor(w_k s) each, plus one for the
    datasets with the largest fractional parts, as many as make the counts sum to s. Any
    guess gives exact results; good ones only avoid repairs."""
    share = steps.astype(np.float64)[:, None] * w
    counts = np.floor(share).astype(np.int64)
    extra = np.clip(steps - counts.sum(axis=1), 0, len(w))
    order = np.argsort(counts - share, axis=1, kind="stable")  # largest fraction first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(len(w))[None, :], axis=1)
    return counts + (rank < extra[:, None])


def _greedy_steps(w: np.ndarray, counts: np.ndarray, begin: int, end: int,
                  out: np.ndarray) -> np.ndarray:
    """The greedy one step at a time over [begin, end) from ``counts``; returns the end state."""
    weights = w.tolist()
    c = [int(x) for x in counts]
    picks = []
    for s in range(begin, end):
        t = float(max(s, 1))
        best, best_error = 0, weights[0] * t - c[0]
        for k in range(1, len(weights)):
            error = weights[k] * t - c[k]
            if error > best_error:
                best, best_error = k, error
        picks.append(best)
        c[best] += 1
    out[begin:end] = picks
    return np.asarray(c, dtype=np.float64)


def _ranks_within_dataset(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each position, how many earlier positions chose the same dataset."""
    order = np.argsort(dataset_index, kind="stable")
    first_of = np.concatenate(([0], np.cumsum(np.bincount(dataset_index, minlength=num_datasets))))
    ranks = np.empty(len(dataset_index), dtype=np.int64)
    ranks[order] = np.arange(len(dataset_index)) - first_of[dataset_index[order]]
    return ranks


def over_provisioned_sizes(weights: Sequence[float], size: int, surplus: float = 0.005) -> list:
    """Samples to build per sub-dataset for a blend of ``size``: Megatron's ceil(n * w * 1.005).

    The greedy blend can take one sample more than the exact share; the surplus covers that.
    """
    return [int(math.ceil(size * weight * (1.0 + surplus))) for weight in weights]
