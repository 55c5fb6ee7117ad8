"""Checkpoints end to end with torchrun on CPU: bitwise resume at TP=2 x PP=2 x DP=2 (plain and
distributed optimizer, the sharded format; the torch format with the distributed one), the
sharded save loading into other layouts, and a rank killed in the middle of a save (both
formats).

Bitwise: a resumed run repeats the uninterrupted run's arithmetic exactly (same layout, same
data order, the saved dropout streams), so losses, parameters, optimizer state and RNG states
must be equal, not close. Resharding changes the order of sums: <= 1e-5 as in the models issue.
"""
import glob
import json
import os
import re

import pytest
import torch

from tests.e2e.runner import (
    LLAMA,
    TINY,
    checkpoint_tensors,
    parse_losses,
    run_script,
    without,
)
from tests.shared_fixture import once_per_run

TOL = 1e-5
PARALLEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _flags(*extra, dropout="0.1", loader="cyclic"):
    base = without(TINY, "--train-iters", "--eval-interval", "--lr-decay-style",
                   "--hidden-dropout", "--attention-dropout")
    return base + LLAMA + [
        "--train-iters", "4", "--eval-interval", "2", "--lr-decay-style", "cosine",
        "--hidden-dropout", dropout, "--attention-dropout", dropout,
        "--dataloader-type", loader, *extra]


def _iteration_losses(proc):
    """{iteration: the printed loss text} (compared as text: equal digits, not close)."""
    parse_losses(proc)  # exit status
    return dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", proc.stdout))


def _assert_bitwise(a_root, b_root, iteration):
    a, b = checkpoint_tensors(a_root, iteration), checkpoint_tensors(b_root, iteration)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _straight_then_resume(tmp_path, flags, nproc):
    """An uninterrupted 4-iteration run saving at 2 and 4, and a run resumed from its
    iteration 2 that saves its own iteration 4."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run_script("pretrain_llama.py", flags + ["--save", straight, "--save-interval", "2"],
                       nproc)
    second = run_script("pretrain_llama.py", flags + [
        "--load", straight, "--ckpt-step", "2", "--save", resumed], nproc)
    assert "loaded checkpoint" in second.stdout and "resharded" not in second.stdout
    return first, second, straight, resumed


def _is_sharded(iteration_dir, nproc):
    """The sharded format: the index and one shard file per rank, no mp_rank_* directory."""
    names = sorted(os.listdir(iteration_dir))
    return names == sorted(["metadata.json"] + [f"shard_{r:05d}.safetensors"
                                                for r in range(nproc)])


DISTRIBUTED = ["--use-distributed-optimizer"]


# The plain optimizer's sharded state (spread over DP ranks) is checked bitwise after a load by
# tests/unit/test_sharded_checkpoint.py and test_moe_checkpoint.py; here each format once, at
# 8 ranks (35 s a case).
@pytest.mark.parametrize("ckpt_format,optimizer", [
    ("torch_dist", DISTRIBUTED), ("torch", DISTRIBUTED),
], ids=["sharded-distributed", "torch-distributed"])
def test_resume_at_tp2_pp2_dp2_is_bitwise(tmp_path, ckpt_format, optimizer):
    flags = _flags(*PARALLEL, *optimizer, "--ckpt-format", ckpt_format)
    first, second, straight, resumed = _straight_then_resume(tmp_path, flags, nproc=8)
    want, got = _iteration_losses(first), _iteration_losses(second)
    assert sorted(want) == ["1", "2", "3", "4"] and sorted(got) == ["3", "4"]
    assert [got[i] for i in "34"] == [want[i] for i in "34"]
    _assert_bitwise(straight, resumed, 4)  # model, optimizer, scheduler, RNG of every rank
    for root in (straight, resumed):
        saved = root / "iter_0000004"
        assert _is_sharded(saved, 8) == (ckpt_format == "torch_dist"), os.listdir(saved)
    if ckpt_format == "torch":
        assert glob.glob(str(straight / "iter_0000004" / "mp_rank_*" / "distrib_optim.pt"))


@pytest.fixture(scope="module")
@once_per_run
def saved_at_tp2_pp2_dp2(tmp_path_factory):
    """A 4-iteration run with the distributed optimizer, no dropout (masks depend on the
    layout) and the sequential loader (the shuffled one deals samples per DP rank)."""
    root = tmp_path_factory.mktemp("reshard") / "saved"
    flags = _flags(dropout="0", loader="single")
    proc = run_script("pretrain_llama.py", flags + PARALLEL + [
        "--use-distributed-optimizer", "--save", root, "--save-interval", "2"], nproc=8)
    assert _is_sharded(root / "iter_0000002", 8)  # the default format
    return flags, root, _iteration_losses(proc)


@pytest.mark.parametrize("layout,nproc", [
    ([], 1),  # TP=1 x PP=1, plain optimizer: also loads distributed-optimizer state
    (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 8),  # DP=4
    (PARALLEL + ["--num-layers-per-virtual-pipeline-stage", "1"], 4),  # VPP=2, DP=1
], ids=["tp1-pp1-dp1", "tp1-pp2-dp4", "tp2-pp2-vpp2-dp1"])
def test_checkpoint_loads_into_another_layout(saved_at_tp2_pp2_dp2, tmp_path, layout, nproc):
    flags, root, want = saved_at_tp2_pp2_dp2
    proc = run_script("pretrain_llama.py", flags + layout + [
        "--load", root, "--ckpt-step", "2", "--save", tmp_path / "again"], nproc)
    got = _iteration_losses(proc)
    assert "resharded from TP=2 x PP=2 x DP=2" in proc.stdout
    if "--num-layers-per-virtual-pipeline-stage" in layout:  # saved per virtual chunk
        with open(tmp_path / "again" / "iter_0000004" / "metadata.json") as f:
            saved = json.load(f)["layout"]
        assert saved["virtual_pipeline_model_parallel_size"] == 2
        assert saved["layer_ranges"] == [[0, 1], [2, 3]], saved  # rank 0's two chunks
    assert sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= TOL, (got, want)


@pytest.mark.parametrize("ckpt_format,half_written", [
    ("torch_dist", "shard_00001.safetensors.tmp"), ("torch", "mp_rank_01/*.tmp")])
def test_rank_killed_while_saving_leaves_previous_checkpoint_latest(tmp_path, monkeypatch,
                                                                    ckpt_format, half_written):
    root = tmp_path / "ckpt"
    flags = _flags("--tensor-model-parallel-size", "2", "--save", root, "--load", root,
                   "--save-interval", "2", "--ckpt-format", ckpt_format)
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", "save:1:4")  # rank 1, iteration 4's save
    crashed = run_script("pretrain_llama.py", flags, nproc=2, warm=False)
    assert crashed.returncode != 0
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (root / "iter_0000004").exists()
    assert glob.glob(str(root / "iter_0000004.partial" / half_written)), os.listdir(root)
    assert _is_sharded(root / "iter_0000002", 2) == (ckpt_format == "torch_dist")
    monkeypatch.delenv("MEGATRON_FAULT_INJECTION")
    want = dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", crashed.stdout))
    resumed = run_script("pretrain_llama.py", flags, nproc=2)  # same --save/--load: auto-resume
    got = _iteration_losses(resumed)
    assert "iter_0000002 at iteration 2" in resumed.stdout
    assert [got[i] for i in "34"] == [want[i] for i in "34"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not glob.glob(str(root / "*.partial"))
