"""Megatron's checkpoint directory layout.

    SAVE/latest_checkpointed_iteration.txt       "100" (or "release")
    SAVE/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
    SAVE/iter_0000100/mp_rank_.../distrib_optim.pt   (distributed optimizer state)

An iteration is written under ``iter_0000100.partial`` and renamed when every rank has
finished; the tracker file is replaced last, so it always names a complete directory.
"""
import os
import re
import shutil
from typing import List, Optional, Tuple

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
STAGING_SUFFIX = ".partial"
RELEASE = "release"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message says which and what to do."""


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return RELEASE if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def parse_rank_dir_name(name: str) -> Optional[Tuple[int, int]]:
    match = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str) -> Optional[Tuple[int, bool]]:
    """(iteration, release) from the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return 0, True
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number or 'release', not "
                              f"{text[:40]!r}; fix or delete it.")
    return int(text), False


def previous_checkpoint_note(root: str) -> str:
    """What a failed save leaves as the latest checkpoint of ``root``, for its error line."""
    try:
        latest = read_tracker(root)
    except CheckpointError:
        latest = None
    if latest is None:
        return f"no earlier checkpoint exists in {root}"
    iteration, release = latest
    return ("the previous checkpoint (release) remains the latest" if release else
            f"the previous checkpoint (iteration {iteration}) remains the latest")


def write_tracker(root: str, iteration) -> None:
    """Replace the tracker file atomically (write, fsync, rename); ``iteration`` is a number
    or "release"."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def complete_iterations(root: str) -> List[int]:
    """Iterations with a complete directory under ``root`` (staging directories excluded)."""
    if not os.path.isdir(root):
        return []
    found = [_ITER_DIR.match(name) for name in os.listdir(root)]
    return sorted(int(m.group(1)) for m in found if m)


def publish(root: str, staging: str, final_name: str, tracker_value) -> None:
    """Once every file is written: rename the staging directory into place, then point the
    tracker at it (the tracker is replaced last, so it always names a complete directory)."""
    final = os.path.join(root, final_name)
    replaced = final + ".old"
    if os.path.exists(final):  # saving an iteration again (e.g. after resuming from it)
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_dir(root)
    write_tracker(root, tracker_value)
    shutil.rmtree(replaced, ignore_errors=True)


def remove_stale_staging(root: str) -> None:
    for name in os.listdir(root):
        if name.endswith(STAGING_SUFFIX) or name.endswith(".old"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
