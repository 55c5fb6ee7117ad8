"""Bad inputs around disk space and padded vocabularies: a conversion into a disk too small
(one line with the whole output's bytes, nothing left), --padded-vocab-size that cannot hold
the tokenizer, --vocab-size given to a tokenizer with its own vocabulary, and a padded
checkpoint loaded without --padded-vocab-size. Each: the exit code, one ``error:`` line with
what and the fix, no traceback, nothing trained when knowable at start."""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, listing, run, tmpfs
from tests.e2e.runner import LLAMA, TINY, without
from tests.e2e.test_checkpoint_convert_padded_vocab import ROWS, TOKENS, _flags, _qwen2
from tests.hf_checkpoints import read_safetensors_dir, save_tokenizer

FLAGS = without(TINY, "--train-iters", "--eval-interval") + LLAMA + [
    "--train-iters", "2", "--eval-interval", "100"]
CONVERT = "tools/checkpoint/convert.py"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 of 300 rows for 260 tokens, and its converted checkpoint."""
    root = tmp_path_factory.mktemp("qwen")
    src = _qwen2(str(root / "hf"))
    proc = run(CONVERT, ["hf-to-megatron", "--load", src, "--save", root / "meg"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def test_disk_full_at_conversion_says_the_whole_output(tmp_path, qwen):
    """The sharded writer's DiskFullError (it knows one file's bytes) becomes one line with
    the whole output's estimate against the free space before writing."""
    with tmpfs(tmp_path / "small", "64k") as mount:
        out = mount / "meg"
        proc = run(CONVERT, ["megatron-to-megatron", "--load", qwen / "meg", "--save", out])
        line = assert_clean_error(proc, 1, f"no space left on device: writing {out} needs "
                                  "about", "were free when it began", "free some space")
        needed = int(line.split(" needs about ")[1].split()[0])
        free = int(line.split(" on its file system, ")[1].split()[0])
        weights = read_safetensors_dir(str(qwen / "hf"))
        assert needed == sum(t.numel() * t.element_size() for t in weights.values()), line
        assert free < needed, line
        assert listing(mount) == {}


def test_padded_vocab_size_below_the_tokenizer(tmp_path):
    proc = run("pretrain_llama.py", FLAGS + ["--padded-vocab-size", "50"])
    assert_clean_error(proc, 2, "--padded-vocab-size 50 is smaller than the tokenizer's 65 "
                       "tokens", "pass at least 65")


def test_padded_vocab_size_that_tensor_parallelism_cannot_split(tmp_path):
    """67 rows over TP 2: each rank's vocabulary slice must be whole. Rank 0 of a 2-process
    launch (the world size torchrun gives it: it must allow TP 2 before this check is
    reached), which stops at the flags, before any process group; that one rank of a real
    torchrun launch says a flag error once is tests/e2e/bad_inputs/test_training_inputs.py's
    test_a_config_error_under_torchrun_is_printed_once."""
    proc = run("pretrain_llama.py", FLAGS + [
        "--padded-vocab-size", "67", "--tensor-model-parallel-size", "2"],
        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert_clean_error(proc, 2, "--padded-vocab-size 67 does not split evenly over "
                       "--tensor-model-parallel-size 2", "choose a tensor-parallel size that "
                       "divides 67")


def test_vocab_size_with_a_tokenizer_of_its_own(tmp_path):
    save_tokenizer(str(tmp_path / "tok"), TOKENS)
    flags = without(FLAGS, "--tokenizer-type", "--vocab-size") + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", tmp_path / "tok",
        "--vocab-size", str(ROWS)]
    proc = run("pretrain_llama.py", flags)
    assert_clean_error(proc, 2, f"--vocab-size {ROWS} does not apply to --tokenizer-type "
                       f"HuggingFaceTokenizer", f"{TOKENS} tokens",
                       f"pass --padded-vocab-size {ROWS} instead")


def test_padded_checkpoint_without_padded_vocab_size(qwen):
    flags = _flags(qwen / "meg")
    i = flags.index("--padded-vocab-size")
    flags = flags[:i] + flags[i + 2:]
    proc = run("pretrain_llama.py", flags + [
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--eval-iters", "0"])
    assert_clean_error(proc, 1, f"has {ROWS} vocabulary rows and this run {TOKENS}",
                       f"pass --padded-vocab-size {ROWS}")
