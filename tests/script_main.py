"""Run a script as ``__main__`` in this process and give its exit code, as ``python script``
would end: SystemExit's code (a message printed to stderr, code 1), or an uncaught exception's
traceback on stderr and code 1. Shared by the bad-input fork server and the warm launch."""
import runpy
import sys
import traceback


def run_as_main(script_path: str) -> int:
    try:
        runpy.run_path(script_path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter would do: traceback, exit 1
        traceback.print_exc()
        return 1
    return 0
