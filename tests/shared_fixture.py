"""Expensive module- and session-scoped fixtures computed once per test run, not once per
pytest worker.

pytest-xdist gives each worker its own fixture instances, and ``--dist worksteal`` hands a
module's tests to whichever worker is free: a module whose tests land on both workers ran its
fixture twice (bench/pipeline.py's 15-20 s run was seen twice in one CI run). Under
``@once_per_run`` (below ``@pytest.fixture``) the first worker to ask computes the value
under a file lock and leaves it pickled in a directory of this run (xdist's run id); a worker
asking later waits for the lock and reads it back. Only for fixtures whose value the tests
read: files it names are shared by both workers from then on. Pickle is safe here: both
sides are this run's own workers, as tests/distributed.py's rank results are. Without xdist
the fixture is called as it is. tests/conftest.py gives the run its id up front and removes
the directory at the end (``begin_run``, ``end_run``)."""
import functools
import os
import pickle
import shutil
import tempfile
import uuid
from pathlib import Path

from filelock import FileLock  # a dependency of torch's


def _directory(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"pytest-shared-{run}"


def begin_run(config) -> None:
    """On the xdist controller: the run id its workers will get (PYTEST_XDIST_TESTRUNUID),
    chosen here so that ``end_run`` knows the directory."""
    if hasattr(config.option, "testrunuid") and not hasattr(config, "workerinput"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex


def end_run(config) -> None:
    run = getattr(config.option, "testrunuid", None)
    if run and not hasattr(config, "workerinput"):
        shutil.rmtree(_directory(run), ignore_errors=True)


def once_per_run(fixture):
    @functools.wraps(fixture)  # pytest reads the fixture's own parameters through this
    def shared(*args, **kwargs):
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if run is None:
            return fixture(*args, **kwargs)
        root = _directory(run)
        root.mkdir(exist_ok=True)
        path = root / f"{fixture.__module__}.{fixture.__name__}.pickle"
        with FileLock(f"{path}.lock"):
            if path.exists():
                return pickle.loads(path.read_bytes())
            value = fixture(*args, **kwargs)
            partial = path.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(value))
            os.replace(partial, path)
            return value
    return shared
