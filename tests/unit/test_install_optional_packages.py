"""shtools/install_deps.sh without a package index (a lent GPU machine) goes on when only
optional packages are missing: zstandard (.jsonl.zst inputs), wandb (--wandb-project) and
pyarrow (.parquet inputs) are imported when used, not by training."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts pip: the full suite, not the quick tier
def test_install_without_an_index_goes_on_without_the_optional_packages(tmp_path):
    for package in ("zstandard", "wandb", "pyarrow"):  # each import raises ImportError
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f"raise ImportError(\"No module named '{package}' (a test's stub)\")\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": os.devnull,
           "PYTHON": sys.executable, "INSTALL_DEPS_FORCE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    done = subprocess.run(["bash", os.path.join(ROOT, "shtools", "install_deps.sh"), "dev"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every requirement is already importable" in done.stdout, done.stdout


@pytest.mark.slow
def test_install_without_an_index_still_stops_when_training_needs_a_package(tmp_path):
    (tmp_path / "tiktoken").mkdir()  # megatron.training.tokenizer imports it
    (tmp_path / "tiktoken" / "__init__.py").write_text("raise ImportError('stub')\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": os.devnull,
           "PYTHON": sys.executable, "INSTALL_DEPS_FORCE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    done = subprocess.run(["bash", os.path.join(ROOT, "shtools", "install_deps.sh"), "dev"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    # pip prints its own "error:" lines above; the script's is the last line
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pip could not install") and "tiktoken" in last, last
