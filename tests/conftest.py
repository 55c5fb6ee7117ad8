"""Session settings for every tier. The unit and e2e tiers are CPU tests (gloo, fp32, bitwise
references): they run on CPU even on a machine with a GPU, unless MEGATRON_DEVICE says
otherwise. Without this, rank pools small enough to get a GPU each and the in-process code
would pick CUDA (and nccl) while other pools and references stay on CPU. The GPU tier
(tests/gpu) sets its own device for its modules (tests/gpu/conftest.py)."""
import os

os.environ.setdefault("MEGATRON_DEVICE", "cpu")


import pytest  # noqa: E402
import torch  # noqa: E402

from tests import shared_fixture  # noqa: E402

_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep


def pytest_configure(config):
    shared_fixture.begin_run(config)


def pytest_unconfigure(config):
    shared_fixture.end_run(config)


def pytest_collection_modifyitems(items):
    """The quick tier (``-m quick``) is every unit test not marked slow (those start processes,
    or are the larger cases of a matrix whose smaller case stays quick) plus the e2e runs
    marked quick: one per parallel dimension."""
    for item in items:
        if str(item.path).startswith(_UNIT_DIR) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)

# torch's math switches live on special module objects (torch.backends.cuda.matmul is a
# cuBLASModule with its own __getattr__/__setattr__): monkeypatch cannot always undo a
# setattr there (pytest 9.2 raises at teardown and skips the rest of that test's undo
# list, leaking its other patches into later tests). Every test gets them back by plain
# assignment instead; tests change them directly and need not restore them.
_MATH_SWITCHES = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
)


@pytest.fixture(autouse=True)
def _restore_torch_math_switches():
    saved = [(owner, name, getattr(owner, name)) for owner, name in _MATH_SWITCHES]
    deterministic = torch.are_deterministic_algorithms_enabled()
    default_dtype = torch.get_default_dtype()
    yield
    for owner, name, value in saved:
        if getattr(owner, name) != value:
            setattr(owner, name, value)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        torch.use_deterministic_algorithms(deterministic)
    if torch.get_default_dtype() != default_dtype:
        torch.set_default_dtype(default_dtype)
