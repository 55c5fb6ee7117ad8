"""The GPU tier: tests that need CUDA, skipped without it (each file's own ``pytestmark``).
Run it on one GPU with ``bash shtools/run_tests.sh tests/gpu`` (docs/gpu.md)."""
import os

import pytest

from tests.distributed import close_pools
from tests.gpu.harness import GPU_ENV


@pytest.fixture(scope="module")
def gpu_env():
    """GPU_ENV for this module's ranks and runs; fresh rank pools before and after (the
    session's CPU pools must not serve it, nor its GPU pools the CPU tests)."""
    close_pools()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in GPU_ENV.items():
            mp.setenv(key, value)
        mp.setenv("MEGATRON_DIST_BACKEND", os.environ.get("MEGATRON_DIST_BACKEND", "gloo"))
        try:
            yield
        finally:
            close_pools()
