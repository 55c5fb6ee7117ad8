"""The two checkpoint formats offline: two runs of the same seed and flags, one saving
``--ckpt-format torch`` and one the sharded default, read the same by offline.py; convert.py
megatron-to-megatron converts each into the other, and training resumes from a converted
checkpoint exactly as from the original (TP=2 x DP=2, distributed optimizer, dropout on, so
the RNG states matter).

Bitwise everywhere except the vocabulary padding rows of the torch format's weights: the
sharded format does not store them (they load as zeros), so a checkpoint converted from it
holds zeros there where the run that saved them holds its initial values; nothing reads those
rows (the loss leaves padding columns out), so they are compared apart.
"""
import pytest
import torch

from megatron.training.checkpointing.offline import read_checkpoint
from tests.e2e.runner import LLAMA, TINY, checkpoint_tensors, finish, start_script, without
from tests.hf_checkpoints import converter
from tests.shared_fixture import once_per_run

VOCAB = 65  # TINY's NullTokenizer: --vocab-size 64 plus its eod token
FLAGS = without(TINY, "--train-iters", "--eval-interval") + LLAMA + [
    "--train-iters", "4", "--eval-interval", "2", "--hidden-dropout", "0.1",
    "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2",
    "--use-distributed-optimizer"]
NPROC = 4


def _run_all(*flag_lists):
    procs = [start_script("pretrain_llama.py", FLAGS + flags, NPROC) for flags in flag_lists]
    results = [finish(p) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return results


def _losses(proc):
    import re

    return dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", proc.stdout))


@pytest.fixture(scope="module")
@once_per_run
def runs(tmp_path_factory):
    """Straight 4-iteration runs in both formats (saves at 2 and 4)."""
    root = tmp_path_factory.mktemp("formats")
    procs = _run_all(*[["--save", root / fmt, "--save-interval", "2", "--ckpt-format", fmt]
                       for fmt in ("torch", "torch_dist")])
    return root, {fmt: _losses(p) for fmt, p in zip(("torch", "torch_dist"), procs)}


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):  # JSON (the sharded header) has no tuples
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_both_formats_read_the_same(runs):
    root, losses = runs
    assert losses["torch"] == losses["torch_dist"] and sorted(losses["torch"]) == list("1234")
    a = read_checkpoint(str(root / "torch" / "iter_0000004"))
    b = read_checkpoint(str(root / "torch_dist" / "iter_0000004"))
    assert sorted(a.model) == sorted(b.model) and len(a.model) > 10
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
        assert a.model[name].shape[0] == VOCAB or "word_embeddings" not in name
    assert _equal(a.optimizer, b.optimizer) and sorted(a.optimizer) == ["exp_avg",
                                                                         "exp_avg_sq"]
    assert _equal(a.optimizer_meta, b.optimizer_meta) and a.scheduler == b.scheduler
    assert sorted(a.rng) == [(t, 0, d) for t in range(2) for d in range(2)]
    assert _equal(a.rng, b.rng)
    assert (a.iteration, a.consumed_train_samples) == (b.iteration, b.consumed_train_samples) \
        == (4, 32)


def _assert_same_checkpoint(got, want):
    """Bitwise, the torch format's vocabulary padding rows apart (zeros in ``got``)."""
    assert got.keys() == want.keys() and got
    for key in want:
        if key.endswith(("word_embeddings.weight", "output_layer.weight")) and \
                key.startswith("mp_rank") and "/model/" in key:
            local = want[key].shape[0]  # this TP rank's rows of the padded vocabulary
            real = max(0, min(local, VOCAB - int(key[len("mp_rank_"):][:2]) * local))
            assert torch.equal(got[key][:real], want[key][:real]), key
            assert not got[key][real:].any(), key
        else:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("source, target", [("torch", "torch_dist"), ("torch_dist", "torch")])
def test_conversion_then_resume_is_bitwise(runs, tmp_path, source, target):
    root, losses = runs
    converted = tmp_path / "converted"
    assert converter().main(["megatron-to-megatron", "--load", str(root / source),
                             "--ckpt-step", "2", "--save", str(converted),
                             "--ckpt-format", target]) == 0
    # The converted iteration 2 is what the other format's run saved there.
    _assert_same_checkpoint(checkpoint_tensors(converted, 2), checkpoint_tensors(root / target, 2))
    (resumed,) = _run_all(["--load", converted, "--save", tmp_path / "resumed",
                           "--ckpt-format", target])
    assert "loaded checkpoint" in resumed.stdout and "resharded" not in resumed.stdout
    got = _losses(resumed)
    assert sorted(got) == ["3", "4"] and all(got[i] == losses[target][i] for i in "34")
    _assert_same_checkpoint(checkpoint_tensors(tmp_path / "resumed", 4),
                            checkpoint_tensors(root / target, 4))
