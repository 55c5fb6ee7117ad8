"""The bad-input catalogue's runner and its assertions.

``run(script, argv)`` runs ``python script argv`` as a user would (CPU, one thread), in a
child forked from a warm server (forkserver.py): torch is imported once for all cases.
``run_torchrun`` starts a real torchrun for the cases that need several ranks.
``assert_clean_error`` is the contract every case checks: the exit code, exactly one
``error:`` line saying what is wrong (and the fix), no Python traceback, and no training
iteration when the problem was knowable at start."""
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence

import pytest

from tests.e2e.runner import ROOT, run_script

_SERVER = None
_LOCK = threading.Lock()


class _Server:
    def __init__(self):
        env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.bad_inputs.forkserver"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _reply(self, timeout: float):
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def run(self, request: dict, timeout: float) -> Optional[int]:
        self.popen.stdin.write(json.dumps(request) + "\n")
        self.popen.stdin.flush()
        pid = self._reply(60)["pid"]
        reply = self._reply(timeout)
        if reply is None:  # hung: kill its session (the child called setsid) and the server,
            # whose pipe may still deliver the late reply and so answer the next case wrongly
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.close()
            return None
        return reply["returncode"]

    def close(self) -> None:
        self.popen.kill()
        self.popen.wait()


def _server() -> _Server:
    global _SERVER
    if _SERVER is None or _SERVER.popen.poll() is not None:
        _SERVER = _Server()
    return _SERVER


def _run_retrying_a_hang(request: dict, timeout: float) -> Optional[int]:
    """The case's exit code, or None if it hung twice. One case hung once (never reproduced)
    while the machine ran at load 20-40, a plausible fork-from-a-threaded-server deadlock;
    a hang is therefore retried once from a fresh server, so a hang the product causes still
    fails the case, and one hung case no longer leaves the next ones a stale reply."""
    with _LOCK:
        code = _server().run(request, timeout)
        if code is None:
            code = _server().run(request, timeout)
    return code


def run(script: str, argv: Sequence, env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python script argv`` (script relative to the repository), as a CompletedProcess.
    ``env`` adds to the test's environment."""
    argv = [str(a) for a in argv]
    full_env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1", **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(script=os.path.join(ROOT, script), argv=argv, env=full_env,
                       cwd=cwd or ROOT, stdout=out, stderr=err)
        code = _run_retrying_a_hang(request, timeout)
        stdout, stderr = open(out).read(), open(err).read()
    if code is None:
        raise AssertionError(f"{script} {' '.join(argv)} hung for {timeout} s:\n"
                             f"{stdout[-2000:]}{stderr[-2000:]}")
    return subprocess.CompletedProcess([script, *argv], code, stdout, stderr)


def run_torchrun(script: str, argv: Sequence, nproc: int = 2,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    """A real ``torchrun --nproc-per-node nproc``: for what only several ranks show."""
    return run_script(script, list(argv), nproc=nproc, timeout=timeout, warm=False)


def error_lines(text: str) -> List[str]:
    # "prog: error:", or argparse's sub-command form "convert.py hf-to-megatron: error:"
    return [line for line in text.splitlines() if re.match(r"^(\S+( [\w-]+)?: )?error: ", line)]


ITERATION = re.compile(r" iteration +\d+/ *\d+ \|")


def assert_clean_error(proc: subprocess.CompletedProcess, code: int, *fragments: str,
                       trained: bool = False, torchrun: bool = False) -> str:
    """The contract of a bad input; returns the error line.

    ``fragments``: each must be in the one ``error:`` line (what is wrong, and the fix).
    ``trained``: iterations may have run (the problem shows only during training).
    ``torchrun``: torchrun's own launcher report (its ChildFailedError with a traceback of
    torchrun's frames) follows a failed worker; only our code's frames are forbidden then."""
    both = proc.stdout + proc.stderr
    shown = f"\n--- exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n" \
            f"{proc.stderr[-3000:]}"
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}{shown}"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, f"wanted one error: line, got {lines}{shown}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}{shown}"
    if torchrun:
        ours = [line for line in both.splitlines() if re.search(
            r'File ".*/(megatron/|pretrain_\w+\.py|tools/)', line)]
        assert not ours, f"a traceback through our code{shown}"
    else:
        assert "Traceback" not in both, f"a traceback{shown}"
    if not trained:
        assert not ITERATION.search(proc.stdout), f"training ran before the error{shown}"
    return lines[0]


def listing(root) -> Dict[str, int]:
    """{relative path: size} of every file under ``root`` (to show nothing was left)."""
    found = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            found[os.path.relpath(path, root)] = os.path.getsize(path)
    return found


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """A real tmpfs of ``size`` at ``path`` (skipped where mounting is not allowed)."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
