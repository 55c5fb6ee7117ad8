"""``pip install .`` (not editable) gives working commands: the working tree is copied to a
temporary directory (no build or egg-info directories of the checkout leak in), installed into
a fresh venv that sees this Python's packages (torch and the rest, no network), and run from
a directory that is not the checkout: every command's --help, megatron-preprocess-data on a
tiny corpus with a tiny BPE (ids checked against the BPE itself), a 2-iteration
megatron-pretrain-llama whose losses equal `python pretrain_llama.py`'s from the clone."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.runner import LLAMA, ROOT, TINY, parse_losses, run_script, without

COMMANDS = ("pretrain-gpt", "pretrain-llama", "preprocess-data", "merge-datasets",
            "make-quickstart-corpus", "plan-parallelism", "plot-pipeline",
            "check-tensor-parallel", "convert-checkpoint", "verify-checkpoint", "generate")
PRETRAIN = without(TINY, "--train-iters") + LLAMA + ["--train-iters", "2"]


def _working_tree_copy(dest):
    """Tracked and untracked-but-not-ignored files, as they are on disk now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):  # a tracked file deleted in the working tree is skipped
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("packaging")
    src, env_dir = root / "src", root / "venv"
    _working_tree_copy(src)
    # The new venv sees the packages of the Python running the tests (pip, setuptools,
    # torch...), which the project's own install put there. Not --system-site-packages: run
    # from inside a virtual environment that reaches the base interpreter's packages (an old
    # setuptools: "invalid command 'bdist_wheel'"), not the environment's. Plain path lines,
    # so the .pth files there (an editable install of this checkout) are not run.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
             and os.path.isdir(p)]
    with open(os.path.join(own_site, "_tests_outer_site.pth"), "w") as pth:
        pth.write("".join(f"{p}\n" for p in outer))
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps",
                              "--no-build-isolation", "--no-index", "--disable-pip-version-check",
                              "--quiet", "."], cwd=src, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return env_dir, elsewhere


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the clone
    return dict(env, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")


def _start(argv, cwd):
    return subprocess.Popen([str(a) for a in argv], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_installed_package_comes_from_the_venv(venv):
    env_dir, elsewhere = venv
    probe = _finish(_start([env_dir / "bin" / "python", "-c",
                            "import megatron, megatron_tools.checkpoint.convert as c, "
                            "pretrain_llama as p; print(megatron.__file__, c.__file__, "
                            "p.__file__)"], elsewhere))
    assert probe.returncode == 0, probe.stderr[-3000:]
    site = os.path.realpath(str(env_dir))
    for path in probe.stdout.split():
        assert os.path.realpath(path).startswith(site + os.sep), (path, site)
    assert ROOT not in probe.stdout


def test_every_command_answers_help(venv):
    env_dir, elsewhere = venv
    procs = {name: _start([env_dir / "bin" / f"megatron-{name}", "--help"], elsewhere)
             for name in COMMANDS}
    for name, proc in procs.items():
        done = _finish(proc)
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert "usage:" in done.stdout, (name, done.stdout[:500])


def test_installed_preprocessing_writes_the_bpe_ids(venv, tmp_path):
    import json

    from tokenizers import ByteLevelBPETokenizer

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    env_dir, elsewhere = venv
    docs = [f"document {i}: the quick brown fox {'jumps ' * (i % 5)}over {i * 7} dogs."
            for i in range(60)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                   for d in docs))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(tmp_path))
    done = _finish(_start([env_dir / "bin" / "megatron-preprocess-data", "--input",
                           tmp_path / "corpus.jsonl", "--output-prefix", tmp_path / "out",
                           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                           tmp_path / "vocab.json", "--merge-file", tmp_path / "merges.txt",
                           "--append-eod", "--workers", "2"], elsewhere))
    assert done.returncode == 0, done.stderr[-3000:]
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    eod = bpe.token_to_id("<|endoftext|>")
    assert [dataset[i].tolist() for i in range(len(dataset))] == \
        [bpe.encode(d).ids + [eod] for d in docs]


def test_installed_pretraining_equals_the_clone(venv):
    env_dir, elsewhere = venv
    installed = _start([env_dir / "bin" / "megatron-pretrain-llama", *PRETRAIN], elsewhere)
    clone = run_script("pretrain_llama.py", PRETRAIN)
    installed = _finish(installed)
    losses, _ = parse_losses(installed)
    assert len(losses) == 2
    assert losses == parse_losses(clone)[0]  # same code, same seed: the same printed losses
