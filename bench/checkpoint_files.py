"""Files and the page cache for bench/checkpoint.py: sizes, fsync, eviction, residency, and
letting the VM settle before a timed save or load."""
import os
import shutil
import subprocess
import time

def files_under(path):
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def size_of(path):
    return sum(os.path.getsize(f) for f in files_under(path))


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path):
    """Drop the (clean, after fsync) pages of the files under ``path`` from the page cache."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path):
    """Fraction of the files' bytes in the page cache (util-linux fincore), or None."""
    try:
        total = 0
        for f in files_under(path):
            out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", f],
                                 capture_output=True, text=True, check=True).stdout
            total += int(out.split()[0])
        return total / size_of(path)
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def settle(idle):
    """Untimed, right before every timed save or load: flush dirty pages (os.sync), then
    wait ``idle`` seconds. Measured on the development VM: writing 644 MB to a new file takes
    0.16 s right after deleting a file of that size that was in the page cache, and 1.8-2.1 s
    after a few seconds idle or with no such file (its virtio-balloon has free page
    reporting: memory free for ~2 s goes back to the host, the likely cause). With the
    default 0 the saves run back to back, each right after deleting its previous file; with
    ``--idle 4`` every save/load starts from "cold" free memory, as after a quiet spell."""
    os.sync()
    if idle:
        time.sleep(idle)


def remove_iterations(root):
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("iter_"):
                shutil.rmtree(os.path.join(root, name))
