"""Optional packages missing (as on a lent GPU machine without a package index): zstandard for
``.jsonl.zst``, pyarrow for ``.parquet``, wandb for ``--wandb-project``. Each is imported only
when used, and its absence is one ``error:`` line at start naming what to install.

The absence is simulated by a directory first on PYTHONPATH holding a stub that raises
ImportError. The harness's fork server cannot do that (its children share its sys.path and its
imported modules), so each case is a fresh ``python script ...``."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, listing
from tests.e2e.runner import ROOT, TINY

PREPROCESS = "tools/preprocess_data.py"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


def _stub_dir(tmp_path, *packages):
    """A directory whose ``import <package>`` raises ImportError, for each package."""
    stubs = tmp_path / "stubs"
    for package in packages:
        (stubs / package).mkdir(parents=True)
        (stubs / package / "__init__.py").write_text(textwrap.dedent(f"""\
            raise ModuleNotFoundError("No module named '{package}' (a test's stub)")
            """))
    return stubs


def run_without(stubs, script, argv, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(stubs), ROOT]))
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, argv)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _numbers_jsonl(n):
    return b"".join(b'{"text": "%d %d"}\n' % (i % 60, i % 7) for i in range(n))


# id -> (input file name, its bytes, the stubbed package): the content is never read
INPUTS = {
    "pp-zst-without-zstandard": ("in.jsonl.zst", b"(\xb5/\xfd not read", "zstandard"),
    "pp-parquet-without-pyarrow": ("in.parquet", b"PAR1 not read PAR1", "pyarrow"),
}


@pytest.mark.parametrize("case", list(INPUTS), ids=list(INPUTS))
def test_preprocessing_input_whose_package_is_missing(tmp_path, case):
    name, content, package = INPUTS[case]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_bytes(content)
    (tmp_path / "out").mkdir()
    before = listing(tmp_path / "data") | listing(tmp_path / "out")
    proc = run_without(_stub_dir(tmp_path, package), PREPROCESS,
                       ["--input", tmp_path / "data" / name, "--output-prefix",
                        tmp_path / "out" / "x", *NULL], cwd=tmp_path)
    suffix = name.split(".", 1)[1]
    assert_clean_error(proc, 2, f"--input {tmp_path / 'data' / name}: .{suffix} files need "
                                f"the {package} package", f"pip install {package}")
    assert listing(tmp_path / "data") | listing(tmp_path / "out") == before


def test_truncated_gzip_input_does_not_need_zstandard(tmp_path):
    """The read-error check of a .gz file used to import zstandard, whose absence then hid the
    gzip error behind a traceback."""
    import gzip

    data = gzip.compress(_numbers_jsonl(20000))
    (tmp_path / "in.jsonl.gz").write_bytes(data[:len(data) * 2 // 3])
    proc = run_without(_stub_dir(tmp_path, "zstandard"), PREPROCESS,
                       ["--input", tmp_path / "in.jsonl.gz", "--output-prefix",
                        tmp_path / "out", *NULL], cwd=tmp_path)
    assert_clean_error(proc, 1, f"{tmp_path / 'in.jsonl.gz'}: gzip data is truncated or "
                                f"corrupt after line", "no output written")


def test_wandb_project_without_wandb_stops_before_training(tmp_path):
    proc = run_without(_stub_dir(tmp_path, "wandb"), "pretrain_gpt.py",
                       TINY + ["--wandb-project", "p", "--wandb-save-dir", tmp_path / "wb"],
                       cwd=tmp_path)
    assert_clean_error(proc, 2, "--wandb-project needs the wandb package",
                       "pip install wandb", "(or drop --wandb-project)")
    assert not (tmp_path / "wb").exists()


def test_plain_and_gzip_jsonl_need_none_of_the_optional_packages(tmp_path):
    """Preprocessing JSONL (plain and .gz) works with pyarrow, zstandard and wandb missing:
    the Parquet check used to import pyarrow whatever the inputs."""
    import gzip

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(_numbers_jsonl(50))
    (tmp_path / "data" / "b.jsonl.gz").write_bytes(gzip.compress(_numbers_jsonl(30)))
    proc = run_without(_stub_dir(tmp_path, "pyarrow", "zstandard", "wandb"), PREPROCESS,
                       ["--input", tmp_path / "data", "--output-prefix", tmp_path / "out",
                        *NULL], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"out_text_document.bin", "out_text_document.idx"} <= set(listing(tmp_path))
