"""A warm process that runs entry-point scripts in forked children, so that a catalogue of
bad inputs pays for importing torch (and transformers) once, not once per case.

Protocol: one JSON request per line on stdin ({"script", "argv", "env", "cwd", "stdout",
"stderr"}), two JSON replies per request on stdout ({"pid"} once forked, then {"returncode"}). Each child gets a new session,
the request's environment and working directory, /dev/null as stdin and the two files as
stdout/stderr, then runs the script as ``__main__``, as ``python script argv`` would.
Nothing here runs a torch op before forking (no thread pools to inherit)."""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MEGATRON_DEVICE", "cpu")

import torch  # noqa: E402,F401  (the import is the cost shared between cases)
import torch._dynamo  # noqa: E402,F401  (a torch optimizer's constructor imports it)
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401

import megatron.training.pretrain  # noqa: E402,F401
from tests.script_main import run_as_main  # noqa: E402


def _child(request) -> None:
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    script = request["script"]
    sys.argv = [script] + request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = run_as_main(script)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _child(request)
            finally:
                os._exit(70)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
