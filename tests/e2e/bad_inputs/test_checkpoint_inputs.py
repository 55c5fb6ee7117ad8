"""Bad inputs around checkpoints and conversion: an unusable --save found before iteration 1
(converting: before the checkpoint is read), a full disk during a save or a conversion (a real
tiny tmpfs), damaged or incomplete checkpoints, and a checkpoint loaded with another tokenizer.
Each case: the exit code, one ``error:`` line saying what and the fix, no traceback, and
nothing half-written left."""
import shutil
import uuid

import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, listing, run, tmpfs
from tests.e2e.conftest import load_tool
from tests.e2e.runner import LLAMA, TINY, without

FLAGS = without(TINY, "--train-iters", "--eval-interval") + LLAMA + [
    "--train-iters", "2", "--eval-interval", "100"]
CONVERT = "tools/checkpoint/convert.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaMA checkpoint of iteration 2 (weights only, the sharded default format) and
    its TP=2 copy in the torch format (mp_rank_* directories)."""
    root = tmp_path_factory.mktemp("ckpt")
    proc = run("pretrain_llama.py", FLAGS + ["--save", root / "tp1", "--no-save-optim"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / "tp1" / "iter_0000002" / "metadata.json").is_file()
    proc = run(CONVERT, ["megatron-to-megatron", "--load", root / "tp1", "--save", root / "tp2",
                         "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "1", "--ckpt-format", "torch"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / "tp2" / "iter_0000002" / "mp_rank_01").is_dir()
    return root


def _saved_args(iteration_dir):
    """The args a checkpoint records, in either format."""
    import json

    import torch

    index = iteration_dir / "metadata.json"
    if index.is_file():
        return json.loads(index.read_text())["args"]
    path = iteration_dir / "mp_rank_00" / "model_optim_rng.pt"
    return torch.load(path, weights_only=True)["args"]


def _copy(saved, name, tmp_path):
    shutil.copytree(saved / name, tmp_path / name)
    return tmp_path / name


# --------------------------------------------------------------------------------------------
# --save that cannot be written: found before iteration 1, exit 2, nothing created.
def _save_is_file(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    return tmp_path / "ckpt", ("is a file, not a directory", "give a directory path")


def _save_under_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "run" / "ckpt", (f"{tmp_path / 'afile'} is a file",
                                                 "whose parents are directories")


@pytest.mark.parametrize("make", [_save_is_file, _save_under_file],
                         ids=["save-is-a-file", "save-under-a-file"])
def test_unusable_save_dir_is_an_error_before_training(tmp_path, make):
    save, fragments = make(tmp_path)
    before = listing(tmp_path)
    proc = run("pretrain_llama.py", FLAGS + ["--save", save])
    assert_clean_error(proc, 2, f"--save {save}", *fragments)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("below,what", [("", "is not writable"),
                                        ("ckpt", "cannot be created")],
                         ids=["save-read-only", "save-in-read-only-dir"])
def test_read_only_save_dir_is_an_error_before_training(tmp_path, below, what):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mount:
        save = mount / below if below else mount
        proc = run("pretrain_llama.py", FLAGS + ["--save", save])
        assert_clean_error(proc, 2, f"--save {save} {what} (read-only file system)",
                           "--save directory")
        assert listing(mount) == {}


def test_new_save_dir_is_not_left_behind_by_the_probe(tmp_path, saved):
    """The probe creates a missing --save to test it and removes it again: a run that stops
    before its first save (here: nothing to do) leaves no empty directories."""
    save = tmp_path / "new" / "ckpt"
    proc = run("pretrain_llama.py", FLAGS + ["--save", save, "--load", saved / "tp1",
                                             "--no-load-optim"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing to do" in proc.stdout
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------------------------
# A full disk (a real tmpfs too small): one line with the bytes needed, nothing partial left.
@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync-save", "async-save"])
def test_disk_full_at_save_keeps_the_previous_checkpoint(tmp_path, mode):
    """Room for the iteration-1 checkpoint (weights only, ~180 KB in the sharded format: no
    vocabulary padding rows) but not for iteration 2: the tracker still names 1, and neither
    the temporary file nor iter_0000002.partial is left filling the disk."""
    with tmpfs(tmp_path / "small", "300k") as mount:
        save = mount / "ckpt"
        proc = run("pretrain_llama.py", FLAGS + mode + ["--save", save, "--save-interval", "1",
                                                        "--no-save-optim"])
        line = assert_clean_error(proc, 1, "no space left on device: writing",
                                  "iter_0000002", "were free when it began",
                                  "the previous checkpoint (iteration 1) remains the latest",
                                  trained=True)
        needed = int(line.split(" needs about ")[1].split()[0])
        free = int(line.split(" on its file system, ")[1].split()[0])
        assert 150_000 < needed < 300_000, line  # 43k fp32 params and the RNG states
        assert free < needed, line  # free space before the save began: no contradiction
        assert "checkpoint of iteration 1 " in proc.stdout
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
        assert sorted(listing(save)) == ["iter_0000001/metadata.json",
                                         "iter_0000001/shard_00000.safetensors",
                                         "latest_checkpointed_iteration.txt"]


def test_free_space_too_small_is_an_error_at_start(tmp_path):
    """A disk smaller than one checkpoint (weights + Adam state) is an error before training,
    naming the flag that goes on anyway; nothing is left on it."""
    with tmpfs(tmp_path / "tiny", "64k") as mount:
        proc = run("pretrain_llama.py", FLAGS + ["--save", mount / "ckpt"])
        line = assert_clean_error(proc, 2, f"--save {mount / 'ckpt'} has",
                                  "bytes free on its file system but one checkpoint needs about",
                                  "--skip-disk-space-check")
        needed = int(line.split(" needs about ")[1].split()[0])
        assert 400_000 < needed < 700_000, line  # 43k params: 4 B weights + 8 B Adam
        assert listing(mount) == {}


def test_skip_disk_space_check_warns_then_the_save_fails_cleanly(tmp_path):
    with tmpfs(tmp_path / "tiny", "64k") as mount:
        proc = run("pretrain_llama.py", FLAGS + ["--save", mount / "ckpt",
                                                 "--skip-disk-space-check"])
        line = assert_clean_error(proc, 1, "no space left on device",
                                  f"no earlier checkpoint exists in {mount / 'ckpt'}",
                                  trained=True)
        assert "previous checkpoint" not in line
        warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: --save")]
        assert len(warning) == 1 and "the save will fail" in warning[0], proc.stderr[-2000:]
        assert listing(mount) == {}


@pytest.mark.parametrize("command", ["megatron-to-hf", "megatron-to-megatron"])
def test_conversion_save_under_a_file_is_an_error_before_converting(tmp_path, saved, command):
    """The same check as pretrain's --save (preflight.output_path_problem), before the
    checkpoint is read: no NotADirectoryError from the staging directory."""
    (tmp_path / "file.txt").write_text("x")
    before = listing(tmp_path)
    out = tmp_path / "file.txt" / "ckpt"
    proc = run(CONVERT, [command, "--load", saved / "tp1", "--save", out])
    assert_clean_error(proc, 1, f"--save {out} cannot be created",
                       f"{tmp_path / 'file.txt'} is a file, not a directory",
                       "choose a --save path whose parents are directories")
    assert listing(tmp_path) == before


def test_disk_full_at_conversion_removes_the_partial_output(tmp_path, saved):
    with tmpfs(tmp_path / "small", "64k") as mount:
        out = mount / "hf"
        proc = run(CONVERT, ["megatron-to-hf", "--load", saved / "tp1", "--save", out])
        assert_clean_error(proc, 1, f"no space left on device: writing {out} needs about",
                           "free some space")
        assert listing(mount) == {}


# --------------------------------------------------------------------------------------------
# Damaged or incomplete checkpoints: exit 1 (the existing code of load errors), one line.
def _missing_rank_dir(ckpt):
    shutil.rmtree(ckpt / "iter_0000002" / "mp_rank_01")
    return ("mp_rank_01 is missing", "saved with TP=2 x PP=1", "--ckpt-step")


def _truncated_file(ckpt):
    path = ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)
    return (str(path), "corrupt or truncated", "--ckpt-step")


def _tracker_points_nowhere(ckpt):
    (ckpt / "latest_checkpointed_iteration.txt").write_text("40")
    return ("names", "iter_0000040, which does not exist", "--ckpt-step")


def _tracker_garbage(ckpt):
    (ckpt / "latest_checkpointed_iteration.txt").write_text("latest\n")
    return ("should hold an iteration number", "fix or delete it")


def _no_rank_dirs(ckpt):
    for name in ("mp_rank_00", "mp_rank_01"):
        shutil.rmtree(ckpt / "iter_0000002" / name)
    return ("holds no mp_rank_* directories", "--ckpt-step")


DAMAGE = {"missing-mp-rank-dir": _missing_rank_dir, "truncated-checkpoint-file": _truncated_file,
          "tracker-names-a-missing-iteration": _tracker_points_nowhere,
          "tracker-not-a-number": _tracker_garbage, "no-mp-rank-dirs": _no_rank_dirs}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_checkpoint_is_one_line(tmp_path, saved, damage):
    ckpt = _copy(saved, "tp2", tmp_path)
    fragments = damage(ckpt)
    before = listing(ckpt)
    proc = run("pretrain_llama.py", FLAGS + ["--load", ckpt])
    assert_clean_error(proc, 1, *fragments)
    assert listing(ckpt) == before


# The sharded format (tp1): a shard file missing or truncated, a damaged or crafted index.
SHARD = "shard_00000.safetensors"


def _missing_shard(ckpt):
    (ckpt / "iter_0000002" / SHARD).unlink()
    return (f"{ckpt / 'iter_0000002' / SHARD} is missing", "--ckpt-step")


def _truncated_shard(ckpt):
    path = ckpt / "iter_0000002" / SHARD
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)
    return (str(path), "truncated", "--ckpt-step")


def _index_not_json(ckpt):
    (ckpt / "iter_0000002" / "metadata.json").write_text("{not json")
    return ("metadata.json cannot be read", "--ckpt-step")


def _index_points_outside(ckpt):
    import json

    path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(path.read_text())
    entry = next(iter(meta["tensors"].values()))
    entry["pieces"][0][0] = "../../x.safetensors"
    path.write_text(json.dumps(meta))
    return ("piece file '../../x.safetensors' is not a shard file name", "--ckpt-step")


def _missing_index(ckpt):
    (ckpt / "iter_0000002" / "metadata.json").unlink()
    return ("holds shard files but no metadata.json", "--ckpt-step")


SHARDED_DAMAGE = {"missing-shard-file": _missing_shard, "truncated-shard-file": _truncated_shard,
                  "index-not-json": _index_not_json,
                  "index-names-a-file-outside": _index_points_outside,
                  "missing-index": _missing_index}


@pytest.mark.parametrize("damage", SHARDED_DAMAGE.values(), ids=SHARDED_DAMAGE.keys())
def test_damaged_sharded_checkpoint_is_one_line(tmp_path, saved, damage):
    ckpt = _copy(saved, "tp1", tmp_path)
    fragments = damage(ckpt)
    before = listing(ckpt)
    proc = run("pretrain_llama.py", FLAGS + ["--load", ckpt, "--no-load-optim"])
    assert_clean_error(proc, 1, *fragments)
    assert listing(ckpt) == before


def test_ckpt_step_that_does_not_exist(saved):
    proc = run("pretrain_llama.py", FLAGS + ["--load", saved / "tp1", "--ckpt-step", "7",
                                             "--no-load-optim"])
    assert_clean_error(proc, 1, "--ckpt-step 7", "no complete checkpoint of that iteration",
                       "it has: [2]")


def test_conversion_of_an_incomplete_checkpoint_names_the_missing_dir(tmp_path, saved):
    ckpt = _copy(saved, "tp2", tmp_path)
    shutil.rmtree(ckpt / "iter_0000002" / "mp_rank_01")
    proc = run(CONVERT, ["megatron-to-hf", "--load", ckpt, "--save", tmp_path / "hf"])
    assert_clean_error(proc, 1, "mp_rank_01 is missing", "TP=2 x PP=1")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


@pytest.mark.parametrize("command,fragment", [
    ("megatron-to-hf", "checkpoint directory {load} does not exist"),
    ("hf-to-megatron", "Hugging Face model directory {load} does not exist"),
], ids=["convert-missing-megatron-dir", "convert-missing-hf-dir"])
def test_conversion_of_a_missing_directory(tmp_path, command, fragment):
    load = tmp_path / "nowhere"
    proc = run(CONVERT, [command, "--load", load, "--save", tmp_path / "out"])
    assert_clean_error(proc, 1, fragment.format(load=load))
    assert listing(tmp_path) == {}


# --------------------------------------------------------------------------------------------
# The tokenizer a checkpoint was trained with.
@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory):
    """Two byte-level BPE tokenizers of the same size trained on different text."""
    corpus = load_tool("make_quickstart_corpus")
    root = tmp_path_factory.mktemp("tokenizers")
    docs = corpus.generate_documents(150, seed=3)
    corpus.train_tokenizer(docs, str(root / "a"), 300)
    corpus.train_tokenizer([d[::-1].upper() for d in docs], str(root / "b"), 300)
    return root / "a", root / "b"


def _hf_flags(tokenizer):
    return without(FLAGS, "--tokenizer-type", "--vocab-size") + [
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer]


def test_tokenizer_mismatch_warns_and_same_tokenizer_does_not(tmp_path, two_tokenizers):
    a, b = two_tokenizers
    save = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    proc = run("pretrain_llama.py", _hf_flags(a) + ["--save", save, "--no-save-optim"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    resume = ["--load", save, "--finetune", "--train-iters", "1"]

    same = run("pretrain_llama.py", _hf_flags(a) + resume)
    assert same.returncode == 0, same.stderr[-2000:]
    assert "trained with the tokenizer" not in same.stderr

    other = run("pretrain_llama.py", _hf_flags(b) + resume)
    assert other.returncode == 0, other.stderr[-2000:]
    warnings = [ln for ln in other.stderr.splitlines() if "trained with the tokenizer" in ln]
    assert len(warnings) == 1, other.stderr[-2000:]
    assert warnings[0].startswith("warning: the checkpoint ")
    assert f"HuggingFaceTokenizer {a} (300 tokens" in warnings[0]
    assert f"HuggingFaceTokenizer {b} (300 tokens" in warnings[0]
    assert "With --finetune a new tokenizer is legitimate only if the embedding rows" in \
        warnings[0]


def test_converted_checkpoints_carry_the_tokenizer_fingerprint(tmp_path, two_tokenizers):
    """Megatron -> HF writes the fingerprint beside the weights; HF -> Megatron records it in
    the args, so a later load with another tokenizer is noticed there too."""
    import json

    from megatron.training.tokenizer.fingerprint import FINGERPRINT_FILE

    a, b = two_tokenizers
    save = tmp_path / "ckpt"
    assert run("pretrain_llama.py", _hf_flags(a) + ["--save", save, "--no-save-optim",
                                                    "--train-iters", "1"]).returncode == 0
    saved = _saved_args(save / "iter_0000001")["tokenizer_fingerprint"]
    proc = run(CONVERT, ["megatron-to-hf", "--load", save, "--save", tmp_path / "hf",
                         "--tokenizer-dir", a])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = json.loads((tmp_path / "hf" / FINGERPRINT_FILE).read_text())
    assert exported["sha256"] == saved["sha256"] and exported["vocab_size"] == 300
    proc = run(CONVERT, ["hf-to-megatron", "--load", tmp_path / "hf", "--save", tmp_path / "back"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    back = _saved_args(tmp_path / "back" / "release")["tokenizer_fingerprint"]
    assert back["sha256"] == saved["sha256"]
    other = run("pretrain_llama.py", _hf_flags(b) + ["--load", tmp_path / "back",
                                                     "--train-iters", "1"])
    assert other.returncode == 0, other.stderr[-2000:]
    assert sum("trained with the tokenizer" in ln for ln in other.stderr.splitlines()) == 1
